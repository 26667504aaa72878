"""The kvduplex proxy end to end: a multi-turn conversation through the real proxy and a real
prefill/decode pair with DuplexConnector (bidirectional), checked against a plain single server.

The pair is the session's shared one (same config as the connector's end-to-end tests), so this
adds no server start-up when both run.
"""

from __future__ import annotations

import pytest

from chat_stream import first_tokens_by_source
from conftest import E2E_LOOKUP_TIMEOUT_MS
from kvduplex.demo import (
    LOGPROB_ATOL,
    ProxyThread,
    duplex_kv_transfer_config,
    read_metrics,
    read_metrics_after,
    user_turns,
)
from kvduplex.demo.servers import complete, describe_mismatch
from kvduplex.proxy.config import CONVERSATION_HEADER
from kvduplex_testing.servers import complete_streamed

TURNS = 3
# Longer than kv_recompute_threshold (64): on every later turn P's own prefix cache lacks at
# least the previous answer, so the pull is always worth it and the test can demand it.
ANSWER_TOKENS = 80


@pytest.mark.e2e
def test_conversation_through_proxy_pulls_history_and_matches_single_server(
    pd_pair, reference_server, tiny_model_dir
):
    config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=64)
    config["kv_connector_extra_config"]["lookup_timeout_ms"] = E2E_LOOKUP_TIMEOUT_MS
    pair = pd_pair(config)
    prefill_url = pair.prefill.base_url
    messages = user_turns(tiny_model_dir, TURNS, first_words=150, user_words=30)
    history: list[int] = []
    with ProxyThread([prefill_url], [pair.decode.base_url]) as proxy:
        for turn, message in enumerate(messages):
            prompt = history + message
            before = read_metrics(prefill_url)
            # The last turn streams: its first token is P's, the rest D's continuation.
            send = complete_streamed if turn == len(messages) - 1 else complete
            answer = send(
                proxy.base_url,
                prompt,
                ANSWER_TOKENS,
                headers={CONVERSATION_HEADER: "test-proxy-e2e"},
            )
            prefill = read_metrics_after(prefill_url, before, 1).minus(before)
            expected = complete(reference_server.base_url, prompt, ANSWER_TOKENS)

            assert describe_mismatch(expected, answer, logprob_atol=LOGPROB_ATOL) is None, turn
            if turn == 0:
                assert prefill.transferred_tokens == 0
            else:
                # D holds the previous prompt and answer, except the answer's last token (never
                # fed through the model). P takes what its own prefix cache lacks of that from
                # D and computes only the new message plus that one token.
                held_by_decode = len(history) - 1
                assert prefill.transferred_tokens > 0, turn
                assert prefill.cache_hit_tokens + prefill.transferred_tokens == held_by_decode, (
                    turn,
                    prefill.prompt_tokens,
                )
                assert prefill.computed_tokens == len(message) + 1, (turn, prefill.prompt_tokens)
            history = prompt + answer.token_ids
        assert first_tokens_by_source(proxy.base_url) == {"prefill": 1}
