"""vLLM's cache resets on a decode node that holds turns: `POST /reset_prefix_cache` (a dev-mode
endpoint, `VLLM_SERVER_DEV_MODE=1` on D) plain, with `reset_external=true`, and with
`reset_running_requests=true&reset_external=true` (the reset of vLLM's sleep, its pause with
`clear_cache` and RL frameworks' weight updates) while a request runs. D holds a turn before
each; every reset answers, reports success and drops the hold; D stays healthy, and the
conversation's next turn, whose held history is gone, is computed and answers as one server.

It shares the session's P/D pair of its config (test_connector_e2e's, test_proxy_e2e's): every
pair runs in dev mode (conftest's `pd_pair`).
"""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from conftest import E2E_LOOKUP_TIMEOUT_MS
from kvduplex.demo import duplex_kv_transfer_config
from kvduplex.demo.servers import Completion, complete, describe_mismatch
from kvduplex_testing.servers import ServerPair, prompt_tokens_by_source
from test_connector_e2e import BLOCK, counter, token_prompt, tokenizer, wait_for_counter  # noqa: F401
from test_lookup_e2e import relay_streamed

logger = logging.getLogger(__name__)

RESET_CONFIG = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=64)
RESET_CONFIG["kv_connector_extra_config"]["lookup_timeout_ms"] = E2E_LOOKUP_TIMEOUT_MS
RESETS = [
    {},
    {"reset_external": "true"},
    {"reset_running_requests": "true", "reset_external": "true"},
]
HELD = "vllm:kvduplex_held_blocks"


@pytest.fixture(scope="module")
def pair(pd_pair) -> ServerPair:
    return pd_pair(RESET_CONFIG)


@pytest.mark.e2e
def test_every_cache_reset_on_a_decode_node_holding_turns_succeeds(
    pair,
    reference_server,
    tokenizer,  # noqa: F811
):
    d = pair.decode.base_url
    answers: list[tuple[int, str]] = []
    held_after: list[float] = []
    history: list[int] = []
    for seed, query in enumerate(RESETS):
        # D holds this conversation's turn.
        history = token_prompt(tokenizer, 2 * BLOCK + 100, seed=70 + seed)
        turn, _ = relay_streamed(pair, history, 40)
        history = history + turn.token_ids
        assert wait_for_counter(d, HELD, lambda n: n > 0) > 0, "D holds no turn"
        running: list[Completion] = []
        runner = None
        if query.get("reset_running_requests"):
            # A request D computes while the reset preempts it.
            prompt = token_prompt(tokenizer, 150, seed=90)
            runner = threading.Thread(
                target=lambda: running.append(complete(d, prompt, max_tokens=300))
            )
            runner.start()
            wait_for_counter(d, "vllm:num_requests_running", lambda n: n > 0)
        reset = httpx.post(f"{d}/reset_prefix_cache", params=query, timeout=120.0)
        answers.append((reset.status_code, reset.text))
        logger.info("reset %s answered %d %s", query, reset.status_code, reset.text)
        if runner is not None:
            runner.join(timeout=300.0)
            expected = complete(reference_server.base_url, prompt, max_tokens=300)
            assert running and describe_mismatch(expected, running[0]) is None
        if reset.status_code != 200:
            break
        held_after.append(wait_for_counter(d, HELD, lambda n: n == 0))
    assert [status for status, _ in answers] == [200] * len(RESETS), answers
    assert all(httpx.Response(200, text=text).json() == {"success": True} for _, text in answers)
    assert held_after == [0] * len(RESETS), "a reset kept D's hold"
    assert httpx.get(f"{d}/health", timeout=30.0).status_code == 200

    # The last turn's hold is gone: the next turn is computed, not pulled, and answers as one
    # server does.
    history = history + token_prompt(tokenizer, 60, seed=80)
    before = prompt_tokens_by_source(pair.prefill.base_url)
    answer, _ = relay_streamed(pair, history, 8)
    after = prompt_tokens_by_source(pair.prefill.base_url)
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
    expected = complete(reference_server.base_url, history, 8)
    assert describe_mismatch(expected, answer) is None
