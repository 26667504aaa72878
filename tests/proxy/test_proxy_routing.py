"""Conversation routing without conversation ids: a stable hash of the caller, the model and the
conversation's first messages picks D by rendezvous hashing, the same on every proxy replica;
streams pass through chunk by chunk."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
from typing import Any

import pytest

from conftest import FakeClock
from kvduplex.proxy.balancer import UpstreamPool
from kvduplex.proxy.config import ConfigError, ProxyConfig, parse_upstream
from kvduplex.proxy.metrics import ProxyMetrics
from kvduplex.proxy.routing import COMPLETION_PREFIX_CHARS, conversation_key
from test_proxy_flow import post, sse_events


def chat_body(conversation: int, turns: int, **extra: Any) -> dict[str, Any]:
    """Conversation number `conversation` after `turns` user turns (history included)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are assistant number {conversation % 3}."},
        {"role": "user", "content": f"Conversation {conversation} starts here."},
    ]
    for turn in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"answer {turn}"},
            {"role": "user", "content": f"question {turn} of conversation {conversation}"},
        ]
    return {"model": "tiny", "messages": messages, **extra}


def send(proxy, body: dict[str, Any], **kwargs: Any) -> str:
    """Send a chat turn; the D that decoded it."""
    response = post(proxy, "/v1/chat/completions", **body, **kwargs)
    assert response.status_code == 200, response.text
    return response.headers["x-kvduplex-decode"]


def pool_of(*ports: int) -> UpstreamPool:
    targets = tuple(parse_upstream(f"10.0.0.{port % 250}:{port}") for port in ports)
    return UpstreamPool(
        "decode", targets, ProxyMetrics(), backoff_initial_s=1, backoff_max_s=1, clock=FakeClock()
    )


def keys(n: int) -> list[bytes]:
    return [conversation_key("anonymous", chat_body(c, 1)) for c in range(n)]


# ---- the routing key --------------------------------------------------------------------------


def test_chat_key_is_the_caller_model_and_first_messages_only():
    first = chat_body(7, 1)
    key = conversation_key("caller", first)
    # Later turns (history grown, other sampling settings, streamed) keep the key.
    assert conversation_key("caller", chat_body(7, 5, stream=True, max_tokens=3)) == key
    # Key order inside a message does not matter (the key is JSON with sorted keys).
    reordered = {
        "messages": [{k: m[k] for k in reversed(list(m))} for m in first["messages"]],
        "model": "tiny",
    }
    assert conversation_key("caller", reordered) == key
    # Who asks, which model and how the conversation began all do.
    assert conversation_key("other caller", first) != key
    assert conversation_key("caller", {**first, "model": "other"}) != key
    assert conversation_key("caller", chat_body(8, 1)) != key
    other_system = [{"role": "system", "content": "be brief"}, *first["messages"][1:]]
    assert conversation_key("caller", {**first, "messages": other_system}) != key
    # A system message after the first user message is history, not the start.
    later_system = [*first["messages"], {"role": "system", "content": "now be brief"}]
    assert conversation_key("caller", {**first, "messages": later_system}) == key


def test_completion_key_is_the_prompt_start():
    start = "x" * COMPLETION_PREFIX_CHARS
    key = conversation_key("caller", {"model": "tiny", "prompt": start})
    assert conversation_key("caller", {"model": "tiny", "prompt": start + " and more"}) == key
    assert conversation_key("caller", {"model": "tiny", "prompt": "y" + start}) != key
    # Shorter prompts are hashed whole, so they differ while they grow.
    assert conversation_key("caller", {"model": "tiny", "prompt": "hi"}) != conversation_key(
        "caller", {"model": "tiny", "prompt": "hi there"}
    )
    ids = list(range(1000))
    id_key = conversation_key("caller", {"model": "tiny", "prompt": ids})
    assert conversation_key("caller", {"model": "tiny", "prompt": ids + [5, 6]}) == id_key
    assert conversation_key("caller", {"model": "tiny", "prompt": [ids]}) == id_key
    # Nonsense still gets a key (the upstream rejects the request itself).
    assert len(conversation_key("caller", {"prompt": {"odd": 1}, "messages": 3})) == 16


# ---- rendezvous hashing over the pool ---------------------------------------------------------


def test_rendezvous_spreads_conversations_and_ignores_list_order():
    pool = pool_of(8001, 8002)
    choices = [pool.pick(key=k).address for k in keys(40)]
    counts = collections.Counter(choices)
    assert len(counts) == 2 and min(counts.values()) >= 10, counts
    # Another proxy listing the same D in another order picks the same for every key.
    reversed_pool = pool_of(8002, 8001)
    assert [reversed_pool.pick(key=k).address for k in keys(40)] == choices
    # The choice is a pure function of key and addresses: blake2b, keyed by the routing key.
    for k, choice in zip(keys(40), choices, strict=True):
        scores = {
            u.address: hashlib.blake2b(u.address.encode(), digest_size=8, key=k).digest()
            for u in pool.upstreams
        }
        assert choice == max(scores, key=scores.__getitem__)


def test_removing_a_decode_moves_only_its_conversations():
    ports = (8001, 8002, 8003, 8004)
    before = [pool_of(*ports).pick(key=k).address for k in keys(200)]
    removed = pool_of(8003).upstreams[0].address
    after = [pool_of(8001, 8002, 8004).pick(key=k).address for k in keys(200)]
    for was, now in zip(before, after, strict=True):
        assert now == was or was == removed
    moved = collections.Counter(now for was, now in zip(before, after, strict=True) if was != now)
    # The removed D's conversations spread over all the others.
    assert sum(moved.values()) == before.count(removed) and len(moved) == 3
    # A D taken out of rotation counts as removed; it gets its conversations back on recovery.
    pool = pool_of(*ports)
    down = pool.get(removed)
    pool.mark_failed(down, "test")
    assert [pool.pick(key=k).address for k in keys(200)] == after
    pool.mark_ok(down)
    assert [pool.pick(key=k).address for k in keys(200)] == before


def test_the_conversations_prefill_is_passed_over_only_when_busier_than_the_slack():
    pool = pool_of(8001, 8002, 8003)
    key = keys(1)[0]
    ranked = pool.pick(key=key)
    others = [u for u in pool.upstreams if u is not ranked]
    with contextlib.ExitStack() as busy:
        for _ in range(2):
            busy.enter_context(pool.track(ranked))
        # Two more in flight than the least busy: within a slack of 2, not of 1 or 0.
        assert pool.pick(key=key, slack=2) is ranked
        assert pool.pick(key=key, slack=1) in others
        for other in others:
            busy.enter_context(pool.track(other))
        # Now one more than the least busy.
        assert pool.pick(key=key, slack=1) is ranked
        assert pool.pick(key=key, slack=0) in others
        # The least busy among the others, whichever key.
        busy.enter_context(pool.track(others[0]))
        assert pool.pick(key=key, slack=0) is others[1]
    targets = tuple(u.target for u in pool.upstreams)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ConfigError, match="prefill_affinity_slack"):
            ProxyConfig(prefill=targets, decode=targets, prefill_affinity_slack=bad)
    # Idle: ties go to the conversation's, and without slack it is pure rendezvous hashing.
    assert pool.pick(key=key, slack=0) is ranked
    with pool.track(ranked), pool.track(ranked), pool.track(ranked):
        assert pool.pick(key=key) is ranked


# ---- through the proxy ------------------------------------------------------------------------


def test_turns_stay_on_one_prefill_across_turns_and_replicas(cluster):
    p0, p1 = cluster.engine("p0"), cluster.engine("p1")
    d = cluster.engine("d")
    replica_a = cluster.proxy([p0, p1], [d])
    replica_b = cluster.proxy([p1, p0], [d])

    def prefill_of(replica, body):
        response = post(replica, "/v1/chat/completions", **body)
        assert response.status_code == 200, response.text
        return response.headers["x-kvduplex-prefill"]

    first = {c: prefill_of(replica_a, chat_body(c, 1)) for c in range(30)}
    assert set(first.values()) == {p0.address, p1.address}
    for turn in (2, 3):
        for c in range(30):
            replica = replica_a if (c + turn) % 2 else replica_b
            assert prefill_of(replica, chat_body(c, turn, stream=c % 2 == 0)) == first[c]
    assert replica_a.metric("kvduplex_proxy_prefill_routes_total", rule="hash") == 60
    assert replica_a.metric("kvduplex_proxy_prefill_routes_total", rule="least_busy") == 0
    # Off: the least busy, ties round-robin, whatever the conversation.
    unbound = cluster.proxy([p0, p1], [d], prefill_affinity_slack=None)
    assert {prefill_of(unbound, chat_body(0, turn)) for turn in (1, 2, 3, 4)} == {
        p0.address,
        p1.address,
    }
    assert unbound.metric("kvduplex_proxy_prefill_routes_total", rule="least_busy") == 4


def test_turns_stay_on_one_decode_across_turns_replicas_and_streaming(cluster):
    p = cluster.engine("p")
    d0, d1 = cluster.engine("d0"), cluster.engine("d1")
    replica_a = cluster.proxy([p], [d0, d1])
    replica_b = cluster.proxy([p], [d1, d0])

    first_decode = {c: send(replica_a, chat_body(c, 1)) for c in range(40)}
    assert set(first_decode.values()) == {d0.address, d1.address}
    for turn in range(2, 4):
        for c in range(40):
            replica = replica_a if (c + turn) % 2 else replica_b
            body = chat_body(c, turn, stream=bool(c % 3 == 0))
            assert send(replica, body) == first_decode[c], (c, turn)
    for c in range(40):
        assert replica_a.upstream_by_hash(chat_body(c, 1)) == first_decode[c]
    # No conversation id: nothing was looked up or remembered.
    for replica in (replica_a, replica_b):
        assert replica.metric("kvduplex_proxy_conversation_lookups_total", result="miss") == 0
        assert replica.metric("kvduplex_proxy_conversations_stored_total") == 0
    assert replica_a.metric("kvduplex_proxy_decode_routes_total", rule="hash") == 80


def test_completion_prompts_stay_on_one_decode_once_past_the_hashed_prefix(cluster):
    p = cluster.engine("p")
    d0, d1 = cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1])

    for c in range(6):
        prompt = f"Conversation {c}. " + "Some long preamble. " * 30
        assert len(prompt) > COMPLETION_PREFIX_CHARS
        decode = post(proxy, prompt=prompt).headers["x-kvduplex-decode"]
        for turn in range(3):
            prompt += f" answer {turn}. question {turn + 1}?"
            stream = turn % 2 == 0
            assert post(proxy, prompt=prompt, stream=stream).headers["x-kvduplex-decode"] == decode


def test_removing_a_decode_through_the_proxy(cluster):
    p = cluster.engine("p")
    d = [cluster.engine(f"d{i}") for i in range(3)]
    proxy = cluster.proxy([p], d, backoff_initial_s=30)
    before = {c: send(proxy, chat_body(c, 1)) for c in range(30)}
    assert set(before.values()) == {e.address for e in d}

    cluster.stop_engine(d[2])
    proxy.check_health()
    after = {c: send(proxy, chat_body(c, 2)) for c in range(30)}
    for c in range(30):
        assert after[c] == before[c] or before[c] == d[2].address
        assert after[c] != d[2].address
    # A replica configured without that D agrees.
    smaller = cluster.proxy([p], d[:2])
    assert {c: send(smaller, chat_body(c, 3)) for c in range(30)} == after


def test_streams_pass_through_chunk_by_chunk_and_unchanged(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])
    # vLLM 0.32's streams carry no kv_transfer_params: the proxy changes nothing.
    d.stream_params = False
    d.stream_gate = threading.Semaphore(0)

    def stream(body: dict[str, Any]) -> bytes:
        """Read the stream, letting D send its next chunk only once the last one arrived here:
        a proxy that held chunks back would leave D waiting for its gate in vain."""
        received = b""
        with proxy.client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            released = 0
            for chunk in response.iter_raw():
                received += chunk
                while received.count(b"\n\n") > released:
                    released += 1
                    d.stream_gate.release()
        return received

    sent_before = len(d.sent_chunks)
    received = stream(chat_body(1, 2, stream=True))
    assert d.gate_timeouts == 0
    assert len(d.sent_chunks) - sent_before == 4
    assert received == b"".join(d.sent_chunks[sent_before:])

    # D's params (for a conversation id's memory) are lifted out of their event; nothing else
    # changes, and the chunks still flow one by one.
    d.stream_params = True
    sent_before = len(d.sent_chunks)
    received = stream(chat_body(2, 1, stream=True, conversation_id="c"))
    assert d.gate_timeouts == 0
    sent_events = sse_events(b"".join(d.sent_chunks[sent_before:]))
    assert sent_events[-1].pop("kv_transfer_params") == d.returned_params[-1]
    assert sse_events(received) == sent_events
    assert received.endswith(b"data: [DONE]\n\n")
    assert proxy.metric("kvduplex_proxy_conversations_stored_total") == 1


def test_conversation_id_prefers_the_remembered_decode_then_falls_back_to_the_hash(
    cluster, clock
):
    p = cluster.engine("p")
    d0, d1 = cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1], clock=clock, backoff_initial_s=10)
    hashed = d0 if proxy.upstream_by_hash(chat_body(5, 1)) == d0.address else d1
    other = d1 if hashed is d0 else d0

    # The hashed D dies unnoticed: the first turn fails over and is remembered on the other D.
    cluster.stop_engine(hashed)
    assert send(proxy, chat_body(5, 1), conversation="c") == other.address
    cluster.restart_engine(hashed)
    clock.advance(10)
    proxy.check_health()

    # The hashed D is back, but the remembered D holds the conversation's blocks.
    other.return_decode_params = False
    response = post(proxy, "/v1/chat/completions", conversation="c", **chat_body(5, 2))
    assert response.headers["x-kvduplex-decode"] == other.address
    assert response.headers["x-kvduplex-conversation"] == "hit"
    assert p.bodies()[-1]["kv_transfer_params"] == other.returned_params[0]
    # That turn left nothing to remember: the conversation goes back to its hashed D.
    response = post(proxy, "/v1/chat/completions", conversation="c", **chat_body(5, 3))
    assert response.headers["x-kvduplex-decode"] == hashed.address
    assert response.headers["x-kvduplex-conversation"] == "miss"
    assert proxy.metric("kvduplex_proxy_decode_routes_total", rule="remembered") == 1
    assert proxy.metric("kvduplex_proxy_decode_routes_total", rule="hash") == 2


def test_callers_route_by_their_own_key(cluster):
    p = cluster.engine("p")
    d0, d1 = cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1], tenant_header="X-Tenant")

    body = chat_body(3, 1)
    for headers in ({"X-Tenant": "acme"}, {}, {"Authorization": "Bearer k"}):
        chosen = {send(proxy, chat_body(3, turn), headers=headers) for turn in (1, 2, 3)}
        assert len(chosen) == 1
    # Same conversation text from two callers: two keys (so not one D for everybody's
    # identical openings), each stable.
    assert proxy.upstream_by_hash(body, "a") == proxy.upstream_by_hash(chat_body(3, 4), "a")
    assert conversation_key("a", body) != conversation_key("b", body)


def test_a_responses_conversation_keeps_its_key_as_its_input_grows():
    first = {"model": "tiny", "instructions": "be brief", "input": [{"role": "user", "content": "a"}]}
    later = {
        **first,
        "input": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"type": "message", "role": "user", "content": "c"},
        ],
        "stream": True,
    }
    key = conversation_key("caller", first)
    assert conversation_key("caller", later) == key
    assert conversation_key("caller", {**first, "instructions": "be long"}) != key
    assert conversation_key("caller", {**first, "input": [{"role": "user", "content": "z"}]}) != key
    # A text input is hashed as a completions prompt's start, within the same budget.
    text = {"model": "tiny", "input": "x" * COMPLETION_PREFIX_CHARS}
    assert conversation_key("caller", {**text, "input": text["input"] + "more"}) == (
        conversation_key("caller", text)
    )
