"""A state-space hybrid model (Mamba-2 and full-attention layers) keeps vLLM's hybrid KV-cache
manager with DuplexConnector, and a streamed chat through `kvduplex proxy` pulls P->D and D->P
on every turn with answers equal to a single server's.

The model is the tiny model's size in Granite-4.0-H's shape (`build_mamba_hybrid_chat_model`);
vLLM runs it with 256-token blocks in both KV-cache groups and its Mamba group in "align" mode.
A Mamba state is the state after exactly its turn's tokens: P stops its prefill one token short
(D computes the prompt's last token from the state before it), P pulls a decode turn's state
only when the new prompt continues the whole turn, and an edited history pulls nothing.

Three servers: the reference (no connector), P and D, stopped when the module ends; the file
name runs it right after test_chat_hybrid_e2e.py, before the session's shared servers start.
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
from kvduplex_testing.tiny_model import (
    MAMBA_HYBRID_SERVER_ARGS,
    build_mamba_hybrid_chat_model,
    sample_chat_text,
)

logger = logging.getLogger(__name__)

BLOCK = 256
TURNS = 4
MAX_TOKENS = 40
# As in the sliding-window hybrid test: a different number of tokens per step moves logprobs by
# a few 1e-6; a state one token off moves them by far more.
LOGPROB_ATOL = 5e-5
MAMBA_GROUP = "0"
LAYERS_PER_GROUP = 2
PAGE = 2 * BLOCK * 2 * 64 * 4  # an attention layer's block (K and V, 2 heads x 64, float32)
ATTENTION_GROUP = "1"


@pytest.fixture(scope="module")
def servers(pytestconfig: pytest.Config, server_log_dir: Path) -> Iterator[Servers]:
    model_dir = build_mamba_hybrid_chat_model(pytestconfig.cache.mkdir("kvduplex-mamba-chat-model"))
    with reference_and_pair(
        model_dir, "mamba", server_log_dir, MAMBA_HYBRID_SERVER_ARGS
    ) as servers:
        yield servers


@pytest.mark.e2e
def test_the_hybrid_kv_cache_manager_stays_on_with_a_mamba_model(servers):
    assert_hybrid_manager_kept(servers)
    assert kv_cache_groups_line(servers.reference) == f"({BLOCK}, {BLOCK})"


@pytest.mark.e2e
def test_streamed_mamba_chat_pulls_both_ways_on_every_turn(servers):
    messages = [{"role": "system", "content": sample_chat_text(600, seed=9)}]
    before = pulls_per_group(servers)
    for turn in chat_through_proxy(servers, messages, TURNS, MAX_TOKENS, 89, LOGPROB_ATOL):
        on_p, on_d, prompt = turn.on_p, turn.on_d, len(turn.expected.prompt_ids)
        # P -> D: P computed all but the last token; D pulled them and computes that one.
        assert on_d.get("external_kv_transfer", 0) > 0, (turn.number, on_d)
        assert on_d.get("local_compute", 0) == 1, (turn.number, on_d)
        if turn.previous is not None:
            # D -> P: D's whole turn (its state is after exactly those tokens) came back; P
            # computed only the rest, but its prompt's last token.
            held = len(turn.previous.prompt_ids) + len(turn.previous.token_ids) - 1
            assert on_p.get("external_kv_transfer", 0) > 0, (turn.number, on_p)
            assert on_p.get("local_compute", 0) == prompt - 1 - held, (turn.number, on_p)
    pulled = {key: delta(after, before[key]) for key, after in pulls_per_group(servers).items()}
    logger.info("pulled per KV-cache group: %s", pulled)
    for server in (servers.prefill, servers.decode):
        blocks = pulled[(server.name, "group_blocks")]
        # One state per pull in the Mamba group; every block of the pulled tokens in the other.
        pulls = TURNS if server is servers.decode else TURNS - 1
        assert blocks[MAMBA_GROUP] == pulls, (server.name, blocks)
        assert blocks[ATTENTION_GROUP] >= pulls, (server.name, blocks)
        # A block is read at the attention page's length (the Mamba state is shorter) in both
        # KV-cache tensors (each is shared by one Mamba and one attention layer).
        nbytes = pulled[(server.name, "group_bytes")]
        assert nbytes == {group: count * LAYERS_PER_GROUP * PAGE for group, count in blocks.items()}


@pytest.mark.e2e
def test_an_edited_mamba_history_pulls_no_state(servers):
    """A state after the edited tokens is not a state after the matching prefix: P computes
    from what its own cache has and pulls nothing back from D."""
    edited = edited_history_turn(servers, seed=10, max_tokens=MAX_TOKENS)
    expected, answer, on_p = edited.expected, edited.answer, edited.on_p
    logger.info("edited turn: %d prompt tokens; P %s", len(expected.prompt_ids), on_p)
    assert answer.token_ids == expected.token_ids
    assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL)
    assert on_p.get("external_kv_transfer", 0) == 0, on_p


@pytest.mark.e2e
@pytest.mark.parametrize("num_tokens", [256, 257, 300])
def test_a_prompt_is_pulled_one_token_short(servers, num_tokens):
    """P computes num_tokens - 1 tokens (257: exactly one block, whose state vLLM also caches);
    D pulls them and the state after them, and computes the last token."""
    on_p, on_d = token_prompt_through_proxy(servers, num_tokens, LOGPROB_ATOL)
    logger.info("%d-token prompt: P %s; D %s", num_tokens, on_p, on_d)
    assert sum(on_p.values()) == num_tokens - 1, on_p
    assert on_d.get("external_kv_transfer", 0) == num_tokens - 1, on_d
    assert on_d.get("local_compute", 0) == 1, on_d
