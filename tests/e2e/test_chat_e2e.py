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
import os
import random
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from chat_stream import Answer, PullWatch, first_tokens_by_source, pulled, respond, stream_chat
from conftest import E2E_LOOKUP_TIMEOUT_MS, E2E_PEER_HEARTBEAT_S
from kvduplex.connector.token_fingerprint import block_fingerprints, request_salt
from kvduplex.demo import ProxyThread, duplex_kv_transfer_config
from kvduplex.demo.servers import complete, describe_mismatch
from kvduplex.demo.tiny_model import SERVED_MODEL_NAME, SERVER_ARGS, VOCAB_SIZE
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import (
    VllmServer,
    ports_outside_ephemeral_range,
    prompt_tokens_by_source,
    start_many,
)
from kvduplex_testing.tiny_model import (
    CHAT_ALLOWED_TOKEN_IDS,
    CHAT_FIRST_WORD_ID,
    build_tiny_chat_model,
    sample_chat_text,
)
from test_connector_e2e import counter, wait_for_counter

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
    d1_side_channel, d2_side_channel = ports_outside_ephemeral_range(2)

    def server(name: str, kv: bool, **extra_config: object) -> VllmServer:
        config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=THRESHOLD)
        config["kv_connector_extra_config"]["lookup_timeout_ms"] = E2E_LOOKUP_TIMEOUT_MS
        config["kv_connector_extra_config"]["peer_heartbeat_s"] = E2E_PEER_HEARTBEAT_S
        config["kv_connector_extra_config"].update(extra_config)
        extra = [*SERVER_ARGS, "--kv-transfer-config", json.dumps(config)] if kv else SERVER_ARGS
        return VllmServer(model_dir, name=name, extra_args=extra, log_dir=server_log_dir)

    # P pulls D's turns layer by layer within its forward pass (`layerwise_load`); D2, when it
    # serves as a second prefill node, pulls asynchronously: both paths run here.
    group = [server("chat-reference", False), server("chat-prefill", True, layerwise_load=True)]
    d1 = server("chat-decode-1", True, side_channel_port=d1_side_channel)
    # D2 also serves as a second prefill node (below); it knows D1 from its config.
    d2 = server(
        "chat-decode-2",
        True,
        side_channel_port=d2_side_channel,
        decode_peers=[f"127.0.0.1:{d1_side_channel}"],
    )
    with start_many([*group, d1, d2]) as (reference, prefill, d1, d2):
        yield Servers(reference, prefill, [d1, d2])


def relay(
    servers: Servers, decode: VllmServer, prefill: VllmServer | None = None
) -> Callable[[list[dict]], Answer]:
    """The smallest standard P/D router: P prefills with `do_remote_decode`, D streams."""
    prefill = prefill or servers.prefill
    p_params = prefill_request_params()

    def send(messages: list[dict]) -> Answer:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0,
            "allowed_token_ids": list(CHAT_ALLOWED_TOKEN_IDS),
            "kv_transfer_params": p_params,
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
        # Each answer's first token is P's, streamed as soon as P answered; D continued after it.
        assert first_tokens_by_source(proxy.base_url) == {"prefill": TURNS}
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


# --------------------------------------------------------------- every read granted by its owner


def word_prompt(num_tokens: int, seed: int) -> list[int]:
    """Token ids of the chat model's words, a fresh draw per seed (no prefix cache has them)."""
    rng = random.Random(seed)
    words = range(CHAT_FIRST_WORD_ID, VOCAB_SIZE)
    return [rng.choice(words) for _ in range(num_tokens)]


@pytest.mark.e2e
def test_a_second_reader_of_the_same_params_is_granted_nothing_and_answers_right(servers):
    """D1 decodes a prompt with P's params; P serves other requests; D2 then gets the same
    params (what a proxy's retry or any client that reaches a D can send): P's prompt was read
    by D1 already, so P grants D2 nothing, D2 computes the prompt and answers as one server."""
    d1, d2 = servers.decodes
    prompt = word_prompt(3 * BLOCK + 50, seed=41)
    expected = complete(servers.reference.base_url, prompt, 16)
    p_params = complete(
        servers.prefill.base_url, prompt, 1, kv_transfer_params=prefill_request_params()
    ).kv_transfer_params
    before = prompt_tokens_by_source(d1.base_url)
    first = complete(d1.base_url, prompt, 16, kv_transfer_params=p_params)
    assert describe_mismatch(expected, first) is None
    assert pulled(d1, before) == len(prompt)
    # P steps on: its worker takes D1's release and ends the prompt's hold.
    for seed in range(3):
        complete(servers.prefill.base_url, word_prompt(200, seed=400 + seed), 1)
    refused_before = counter(d2.base_url, "vllm:kvduplex_grants_refused_total")
    before = prompt_tokens_by_source(d2.base_url)
    second = complete(d2.base_url, prompt, 16, kv_transfer_params=p_params)
    assert describe_mismatch(expected, second) is None
    assert pulled(d2, before) == 0
    assert counter(d2.base_url, "vllm:kvduplex_grants_refused_total") == refused_before + 1


@pytest.mark.e2e
def test_params_forged_with_another_prompts_fingerprints_are_refused_and_logged(servers):
    """A client that reaches D takes P's params for prompt A, replaces their fingerprints with
    those of its own prompt B (as the connector computes them) and sends B: D asks P for a grant
    with B's own tokens, P refuses (A's blocks carry other tokens), D computes B. A's hold is
    untouched: an honest reader of A's params is still granted them."""
    d1, d2 = servers.decodes
    prompt_a = word_prompt(2 * BLOCK + 60, seed=51)
    prompt_b = word_prompt(2 * BLOCK + 60, seed=52)
    p_params = complete(
        servers.prefill.base_url, prompt_a, 1, kv_transfer_params=prefill_request_params()
    ).kv_transfer_params
    forged = dict(
        p_params,
        remote_block_fingerprints=block_fingerprints(
            prompt_b, BLOCK, request_salt(None, None, None)
        ),
    )
    expected_b = complete(servers.reference.base_url, prompt_b, 16)
    before = prompt_tokens_by_source(d1.base_url)
    answer_b = complete(d1.base_url, prompt_b, 16, kv_transfer_params=forged)
    assert describe_mismatch(expected_b, answer_b) is None
    assert pulled(d1, before) == 0
    assert "did not grant the blocks of its request" in d1.log_tail(400)
    assert "refused" in servers.prefill.log_tail(400)

    expected_a = complete(servers.reference.base_url, prompt_a, 16)
    before = prompt_tokens_by_source(d2.base_url)
    answer_a = complete(d2.base_url, prompt_a, 16, kv_transfer_params=p_params)
    assert describe_mismatch(expected_a, answer_a) is None
    assert pulled(d2, before) == len(prompt_a)


@pytest.mark.e2e
def test_a_chat_whose_requests_carry_stop_strings_pulls_every_later_turn(servers):
    """Each answer ends on a stop string (a word of the answer the single server gives without
    one). vLLM's frontend finishes such a request by aborting it in the engine; D holds the
    turn all the same, as far as the answer its client saw (not the tokens the engine computed
    past the stop string, whose number is a matter of timing), and P pulls it back on the next
    turn, the held turn's partial last block included: no held token differs from P's prompt."""
    prefill = servers.prefill.base_url
    mismatched = counter(prefill, "vllm:kvduplex_tokens_mismatched_total")
    transfers = counter(prefill, "vllm:kvduplex_transfers_total")
    messages = [{"role": "system", "content": sample_chat_text(300, seed=6)}]
    with ProxyThread([servers.prefill.base_url], [d.base_url for d in servers.decodes]) as proxy:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": sample_chat_text(40, seed=60 + turn)})
            free = stream_chat(servers.reference.base_url, messages, MAX_TOKENS)
            words = free.text.split()
            stop = [f" {words[len(words) // 2]}"]
            expected = stream_chat(servers.reference.base_url, messages, MAX_TOKENS, stop=stop)
            assert len(expected.token_ids) < len(free.token_ids), f"turn {turn}: {stop} no stop"
            watch = PullWatch(servers.prefill, servers.decodes)
            answer = stream_chat(proxy.base_url, messages, MAX_TOKENS, stop=stop)
            assert answer.token_ids == expected.token_ids, f"turn {turn}: tokens differ"
            assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL), turn
            assert answer.text == expected.text
            if turn > 0:
                assert watch.pulled() > 0, f"turn {turn}: nothing pulled; {watch.report()}"
            messages.append({"role": "assistant", "content": answer.text})
    done = wait_for_counter(
        prefill, "vllm:kvduplex_transfers_total", lambda n: n - transfers >= TURNS - 1
    )
    assert done - transfers >= TURNS - 1
    assert counter(prefill, "vllm:kvduplex_tokens_mismatched_total") == mismatched


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_responses_api_chat_through_kvduplex_proxy_pulls_every_later_turn(servers, stream):
    """`/v1/responses` through `kvduplex proxy`, as the official SDK sends it: the whole
    conversation in `input` every turn, with a conversation id (the proxy keeps D's params from
    the final response, streamed or not, and hands them to P) and without one (P finds the
    history by its content). Every answer equals the single server's; P pulls every later
    turn's history from D."""
    for conversation_id in (f"responses-{stream}", None):
        seed = 80 + 2 * stream + (conversation_id is None)
        messages = [{"role": "system", "content": sample_chat_text(300, seed=seed)}]
        with ProxyThread([servers.prefill.base_url], [d.base_url for d in servers.decodes]) as proxy:
            for turn in range(3):
                messages.append(
                    {"role": "user", "content": sample_chat_text(40, seed=seed * 10 + turn)}
                )
                expected = respond(servers.reference.base_url, messages, MAX_TOKENS, stream=False)
                watch = PullWatch(servers.prefill, servers.decodes)
                answer = respond(
                    proxy.base_url, messages, MAX_TOKENS, stream=stream,
                    conversation_id=conversation_id,
                )
                assert answer == expected, f"{conversation_id} turn {turn}: answers differ"
                if turn > 0:
                    assert watch.pulled() > 0, f"{conversation_id} turn {turn}: {watch.report()}"
                messages.append({"role": "assistant", "content": answer})


@pytest.mark.e2e
def test_the_conversation_goes_on_when_its_decode_node_dies_after_its_pull(servers):
    """Through `kvduplex proxy`: the D that served turn 1 (and pulled P's prompt for it) is
    killed; the proxy sends the next turns to the other D, P finds their history there, and
    every answer equals the single server's. Runs last: it kills a server of the module."""
    messages = [{"role": "system", "content": sample_chat_text(300, seed=7)}]
    alive = list(servers.decodes)
    with ProxyThread([servers.prefill.base_url], [d.base_url for d in servers.decodes]) as proxy:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": sample_chat_text(40, seed=70 + turn)})
            expected = stream_chat(servers.reference.base_url, messages, MAX_TOKENS)
            before = {d.name: prompt_tokens_by_source(d.base_url) for d in alive}
            p_before = prompt_tokens_by_source(servers.prefill.base_url)
            answer = stream_chat(proxy.base_url, messages, MAX_TOKENS)
            assert answer.token_ids == expected.token_ids, f"turn {turn}: tokens differ"
            assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL), turn
            (served,) = [d for d in alive if pulled(d, before[d.name]) > 0]
            if turn == 0:
                logger.info("turn 1 was decoded by %s: killing it", served.name)
                os.killpg(served.pid, signal.SIGKILL)
                alive.remove(served)
            elif turn > 1:
                assert pulled(servers.prefill, p_before) > 0, f"turn {turn}: nothing pulled"
            messages.append({"role": "assistant", "content": answer.text})
