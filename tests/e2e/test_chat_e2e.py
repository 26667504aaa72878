"""A streamed multi-turn chat, no conversation id, through P and two D's: P finds each turn's
history on the D that holds it, by the prompt alone, and every answer equals a single server's.

The official `openai` SDK sends `/v1/chat/completions` with `stream=True` and keeps only text,
like a chat UI: the next turn's history carries the previous answer as its streamed text. The
word-level tiny chat model round-trips that text to the same token ids (checked here on the
single server: turn N+1's prompt starts with turn N's prompt and answer ids), so reuse is
possible at all; `allowed_token_ids` keeps the random model from sampling special tokens.

Two routers:
- `kvduplex proxy` (conversation routed to one D by a stable hash, stream passed through);
- a router that relays only vLLM's standard P/D params (P gets `do_remote_decode` and
  `max_tokens=1`, D gets P's params and the client's request). Its turns alternate between the
  two D's, so P must find the D that decoded the previous turn among the D's it knows.

This module runs first in tests/e2e and stops its four servers (reference, P, D1, D2) when done.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from chat_stream import Answer, stream_chat
from conftest import E2E_LOOKUP_TIMEOUT_MS

from kvduplex.demo import ProxyThread, duplex_kv_transfer_config
from kvduplex.protocol import prefill_request_params
from kvduplex.servers import (
    VllmServer,
    ports_outside_ephemeral_range,
    prompt_tokens_by_source,
    start_many,
)
from kvduplex.tiny_model import (
    CHAT_ALLOWED_TOKEN_IDS,
    SERVED_MODEL_NAME,
    SERVER_ARGS,
    build_tiny_chat_model,
    sample_chat_text,
)

logger = logging.getLogger(__name__)

BLOCK = 128
TURNS = 4
MAX_TOKENS = 60
LOGPROB_ATOL = 1e-3
THRESHOLD = 16




@dataclass
class Servers:
    reference: VllmServer
    prefill: VllmServer
    decodes: list[VllmServer]


@pytest.fixture(scope="module")
def servers(pytestconfig: pytest.Config, server_log_dir: Path) -> Iterator[Servers]:
    model_dir = build_tiny_chat_model(pytestconfig.cache.mkdir("kvduplex-tiny-chat-model"))
    (d1_side_channel,) = ports_outside_ephemeral_range(1)

    def server(name: str, kv: bool, **extra_config: object) -> VllmServer:
        config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=THRESHOLD)
        config["kv_connector_extra_config"]["lookup_timeout_ms"] = E2E_LOOKUP_TIMEOUT_MS
        config["kv_connector_extra_config"].update(extra_config)
        extra = [*SERVER_ARGS, "--kv-transfer-config", json.dumps(config)] if kv else SERVER_ARGS
        return VllmServer(model_dir, name=name, extra_args=extra, log_dir=server_log_dir)

    # P pulls D's turns layer by layer within its forward pass (`layerwise_load`); D2, when it
    # serves as a second prefill node, pulls asynchronously: both paths run here.
    group = [server("chat-reference", False), server("chat-prefill", True, layerwise_load=True)]
    group.append(server("chat-decode-1", True, side_channel_port=d1_side_channel))
    # D2 also serves as a second prefill node (below); it knows D1 from its config.
    group.append(server("chat-decode-2", True, decode_peers=[f"127.0.0.1:{d1_side_channel}"]))
    with start_many(group) as (reference, prefill, d1, d2):
        yield Servers(reference, prefill, [d1, d2])



def relay(
    servers: Servers, decode: VllmServer, prefill: VllmServer | None = None
) -> Callable[[list[dict]], Answer]:
    """The smallest standard P/D router: P prefills with `do_remote_decode`, D streams."""
    prefill = prefill or servers.prefill

    def send(messages: list[dict]) -> Answer:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "allowed_token_ids": list(CHAT_ALLOWED_TOKEN_IDS),
            "kv_transfer_params": prefill_request_params(),
        }
        response = httpx.post(f"{prefill.base_url}/v1/chat/completions", json=body, timeout=300)
        response.raise_for_status()
        params = response.json().get("kv_transfer_params")
        assert params is not None, "P offered no KV blocks"
        return stream_chat(decode.base_url, messages, MAX_TOKENS, params)

    return send


def run_chat(
    servers: Servers, send_turn: Callable[[int], Callable[[list[dict]], Answer]], seed: int
) -> list[tuple[Answer, dict[str, float]]]:
    """Four turns; each is compared with the single server. Returns (answer, P's prompt
    tokens by source for the turn) per turn."""
    messages = [{"role": "system", "content": sample_chat_text(300, seed=seed)}]
    turns = []
    previous: list[int] | None = None
    for turn in range(TURNS):
        messages.append({"role": "user", "content": sample_chat_text(40, seed=seed * 10 + turn)})
        expected = stream_chat(servers.reference.base_url, messages, MAX_TOKENS)
        # The reference's own prompt ids show the history round-trips through text.
        if previous is not None:
            assert expected.prompt_ids[: len(previous)] == previous, f"turn {turn}: no round trip"
        before = prompt_tokens_by_source(servers.prefill.base_url)
        answer = send_turn(turn)(messages)
        after = prompt_tokens_by_source(servers.prefill.base_url)
        on_p = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        assert answer.token_ids == expected.token_ids, f"turn {turn}: tokens differ"
        assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL), turn
        assert answer.text == expected.text
        logger.info(
            "turn %d: %d prompt tokens, P %s", turn + 1, len(expected.prompt_ids), on_p
        )
        turns.append((expected, on_p))
        previous = expected.prompt_ids + expected.token_ids
        messages.append({"role": "assistant", "content": answer.text})
    return turns


def check_reuse(turns: list[tuple[Answer, dict[str, float]]]) -> None:
    """On turns >= 2, P computes only the new tokens (and the previous answer's last token,
    whose KV the decode node never computed); the rest is its own cache or pulled from D."""
    for turn in range(1, len(turns)):
        previous, _ = turns[turn - 1]
        answer, on_p = turns[turn]
        held = len(previous.prompt_ids) + len(previous.token_ids) - 1
        new = len(answer.prompt_ids) - held
        assert on_p.get("external_kv_transfer", 0) > 0, (turn, on_p)
        assert on_p.get("local_compute", 0) == new, (turn, on_p, new)


@pytest.mark.e2e
def test_streamed_chat_through_kvduplex_proxy_pulls_every_later_turn(servers):
    with ProxyThread(
        [servers.prefill.base_url], [d.base_url for d in servers.decodes]
    ) as proxy:
        turns = run_chat(servers, lambda turn: lambda m: stream_chat(proxy.base_url, m, MAX_TOKENS), seed=1)
    check_reuse(turns)


@pytest.mark.e2e
def test_streamed_chat_through_a_standard_router_finds_the_d_that_holds_each_turn(servers):
    # Turns alternate D1, D2, D1, D2: P's history for turn k is on the other D than turn k's.
    turns = run_chat(servers, lambda turn: relay(servers, servers.decodes[turn % 2]), seed=2)
    check_reuse(turns)


@pytest.mark.e2e
def test_a_conversation_sharing_a_long_first_message_pulls_it_from_the_d_that_holds_it(servers):
    """Conversation A's first turn is held on D1. Conversation B starts with the same long
    system message on a prefill node that has never seen it (D2, serving as a second P): it
    finds the shared prefix in A's held turn on D1 and pulls it instead of computing it."""
    system = {"role": "system", "content": sample_chat_text(300, seed=3)}
    first_a = [system, {"role": "user", "content": sample_chat_text(40, seed=31)}]
    answer_a = relay(servers, servers.decodes[0])(first_a)
    assert answer_a.token_ids == stream_chat(servers.reference.base_url, first_a, MAX_TOKENS).token_ids

    first_b = [system, {"role": "user", "content": sample_chat_text(40, seed=32)}]
    expected = stream_chat(servers.reference.base_url, first_b, MAX_TOKENS)
    second_prefill = servers.decodes[1]
    before = prompt_tokens_by_source(second_prefill.base_url)
    answer_b = relay(servers, servers.decodes[0], prefill=second_prefill)(first_b)
    after = prompt_tokens_by_source(second_prefill.base_url)
    on_p2 = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    logger.info("conversation B's first turn (%d tokens) on P2: %s", len(expected.prompt_ids), on_p2)
    assert answer_b.token_ids == expected.token_ids
    assert answer_b.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL)
    # B shares A's first 303 tokens (bos, "system:", 300 words, "user:"): 2 full blocks.
    assert on_p2.get("external_kv_transfer", 0) == 2 * BLOCK, on_p2
    assert on_p2.get("local_compute", 0) == len(expected.prompt_ids) - 2 * BLOCK, on_p2
