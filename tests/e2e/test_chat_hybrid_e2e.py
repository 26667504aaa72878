"""A hybrid model (sliding-window and full-attention layers) keeps vLLM's hybrid KV-cache manager
with DuplexConnector, and a streamed chat through `kvduplex proxy` pulls P->D and D->P on every
turn with answers equal to a single server's.

The model is the tiny model's size in Gemma-2's shape (`build_hybrid_chat_model`): its
sliding-window layers attend to the last 256 tokens (two 128-token blocks), so every turn's
history is longer than the window and D holds only the window's blocks of that group; P pulls
the full-attention group's blocks of the whole history and the sliding-window group's blocks of
the window. An edited history pulls only what the edit left matching.

Three servers: the reference (no connector), P and D, stopped when the module ends; the file
name runs it right after test_chat_e2e.py, before the session's shared servers start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from chat_stream import (
    Servers,
    assert_hybrid_manager_kept,
    chat_through_proxy,
    delta,
    edited_history_turn,
    kv_cache_groups_line,
    pulls_per_group,
    reference_and_pair,
    token_prompt_through_proxy,
)
from kvduplex_testing.tiny_model import build_hybrid_chat_model, sample_chat_text

logger = logging.getLogger(__name__)

BLOCK = 128
WINDOW = 256
TURNS = 4
MAX_TOKENS = 40
# P/D runs the same kernels on the same tokens as the single server; computing a different
# number of tokens per step moves logprobs by up to ~3e-6 here. A wrong window block moved
# them by 2e-4..7e-4, which 1e-3 would have let through.
LOGPROB_ATOL = 5e-5


@pytest.fixture(scope="module")
def servers(pytestconfig: pytest.Config, server_log_dir: Path) -> Iterator[Servers]:
    model_dir = build_hybrid_chat_model(pytestconfig.cache.mkdir("kvduplex-hybrid-chat-model"))
    with reference_and_pair(model_dir, "hybrid", server_log_dir) as servers:
        yield servers


@pytest.mark.e2e
def test_the_hybrid_kv_cache_manager_stays_on_with_the_connector(servers):
    assert_hybrid_manager_kept(servers)
    # Two KV-cache groups, not one.
    assert kv_cache_groups_line(servers.reference).count(",") == 1


@pytest.mark.e2e
def test_streamed_hybrid_chat_pulls_both_ways_on_every_turn(servers):
    # 600 words: D's first pull (no cache of its own) spans five blocks, more than the window.
    messages = [{"role": "system", "content": sample_chat_text(600, seed=7)}]
    before = pulls_per_group(servers)
    for turn in chat_through_proxy(servers, messages, TURNS, MAX_TOKENS, 69, LOGPROB_ATOL):
        on_p, on_d, prompt = turn.on_p, turn.on_d, len(turn.expected.prompt_ids)
        # P -> D: D pulls what its own cache lacks and computes at most the last token.
        assert on_d.get("external_kv_transfer", 0) > 0, (turn.number, on_d)
        assert on_d.get("local_compute", 0) <= 1, (turn.number, on_d)
        if turn.previous is not None:
            # D -> P: the history beyond the window came back from D; P computed only the new
            # tokens (and the previous answer's last token, which D never computed).
            held = len(turn.previous.prompt_ids) + len(turn.previous.token_ids) - 1
            assert held > WINDOW
            assert on_p.get("external_kv_transfer", 0) > 0, (turn.number, on_p)
            assert on_p.get("local_compute", 0) == prompt - held, (turn.number, on_p)
    pulled = {key: delta(after, before[key]) for key, after in pulls_per_group(servers).items()}
    logger.info("pulled per KV-cache group: %s", pulled)
    for server in (servers.prefill, servers.decode):
        blocks = pulled[(server.name, "group_blocks")]
        assert set(blocks) == {"0", "1"} and all(blocks.values()), (server.name, blocks)
    # D's pulls reach further back than the window: the sliding-window group's are fewer.
    d_blocks = pulled[(servers.decode.name, "group_blocks")]
    assert min(d_blocks.values()) < max(d_blocks.values()), d_blocks


@pytest.mark.e2e
def test_an_edited_hybrid_history_pulls_only_the_matching_prefix(servers):
    # The edit is inside D's window: the history matches D's turn up to there.
    edited = edited_history_turn(servers, seed=8, max_tokens=MAX_TOKENS)
    first, expected, answer, on_p = edited.first, edited.expected, edited.answer, edited.on_p
    logger.info("edited turn: %d prompt tokens; P %s", len(expected.prompt_ids), on_p)
    assert answer.token_ids == expected.token_ids
    assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL)
    matching = next(
        index
        for index, (a, b) in enumerate(zip(expected.prompt_ids, first.prompt_ids + first.token_ids))
        if a != b
    )
    reused = on_p.get("external_kv_transfer", 0) + on_p.get("local_cache_hit", 0)
    # Reused: the matching prefix's whole blocks (a block with an edited token is recomputed),
    # part of them pulled from D; the edit is inside D's window, so the sliding-window group's
    # blocks up to it are still held.
    assert on_p.get("external_kv_transfer", 0) > 0, on_p
    assert reused == matching // BLOCK * BLOCK, (on_p, matching)
    assert on_p.get("local_compute", 0) == len(expected.prompt_ids) - reused, on_p


@pytest.mark.e2e
@pytest.mark.parametrize("num_tokens", [383, 384])
def test_a_prompt_at_the_window_edge_is_pulled_exactly(servers, num_tokens):
    """383 tokens: the window for the prompt's last token starts one block earlier than the
    next token's, the block vLLM frees first. Pulled whole, vLLM's recompute of the last
    token read that (null) block: logprobs moved by up to 7e-4, where every other length
    gives exactly the single server's. The pull now stops one token short (D computes it)."""
    _, on_d = token_prompt_through_proxy(servers, num_tokens, LOGPROB_ATOL)
    logger.info("%d-token prompt: D %s", num_tokens, on_d)
    assert on_d.get("external_kv_transfer", 0) >= num_tokens - 1, on_d
