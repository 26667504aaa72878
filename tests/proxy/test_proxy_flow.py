"""The proxy's P/D flow and conversation memory, against fake engines over real HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx

from kvduplex.protocol import (
    REMOTE_BLOCK_FINGERPRINTS,
    REMOTE_ENGINE_ID,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
    prefill_request_params,
)
from kvduplex.proxy.store import InMemoryConversationStore


def post(
    handle: Any,
    path: str = "/v1/completions",
    *,
    conversation: str | None = None,
    api_key: str | None = None,
    headers: dict[str, str] | None = None,
    **body: Any,
) -> httpx.Response:
    body.setdefault("model", "tiny")
    if path.endswith("/completions") and "chat" not in path:
        body.setdefault("prompt", "hello")
    all_headers = dict(headers or {})
    if conversation is not None:
        all_headers["X-Conversation-Id"] = conversation
    if api_key is not None:
        all_headers["Authorization"] = f"Bearer {api_key}"
    return handle.client.post(path, json=body, headers=all_headers)


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


def test_non_streaming_turns_replay_decode_params_exactly_once(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])

    first = post(proxy, conversation="c1", prompt="turn one", max_tokens=7, min_tokens=2, n=1)
    assert first.status_code == 200, first.text
    assert "kv_transfer_params" not in first.json()
    assert first.json()["choices"][0]["text"].startswith("d says")

    p_body, d_body = p.bodies()[-1], d.bodies()[-1]
    assert p_body["kv_transfer_params"] == prefill_request_params()
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "min_tokens" not in p_body and "n" not in p_body
    assert "conversation_id" not in p_body
    # D gets the caller's request unchanged plus P's params, passed through untouched.
    assert d_body == {
        "model": "tiny",
        "prompt": "turn one",
        "max_tokens": 7,
        "min_tokens": 2,
        "n": 1,
        "kv_transfer_params": p.returned_params[-1],
    }

    # Turn 2: P gets D's turn-1 params, connector-defined keys included, so it pulls from D.
    assert post(proxy, conversation="c1", prompt="turn two").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[0]
    assert d.returned_params[0][REMOTE_BLOCK_FINGERPRINTS]

    # Turn 3 pulls what turn 2's decode left, not turn 1's blocks again.
    d.return_decode_params = False
    assert post(proxy, conversation="c1", prompt="turn three").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[1]
    # Turn 3's decode kept nothing, so turn 4 has nothing to pull.
    assert post(proxy, conversation="c1", prompt="turn four").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()

    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="hit") == 2
    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="miss") == 2
    assert proxy.metric("kvduplex_proxy_conversations_stored_total") == 2


def test_streaming_chat_relays_sse_and_captures_params_from_the_last_chunk(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])
    messages = [{"role": "user", "content": "hi"}]

    with proxy.client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 5,
            "conversation_id": "chat-1",
        },
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read()
    events = sse_events(raw)
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert "".join(e["choices"][0]["delta"]["content"] for e in events).startswith("d says")
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    assert all("kv_transfer_params" not in e for e in events)

    p_body = p.bodies("/v1/chat/completions")[-1]
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
    d_body = d.bodies("/v1/chat/completions")[-1]
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert d_body["max_completion_tokens"] == 5 and "conversation_id" not in d_body

    # The next turn (history grown, conversation named in the body) pulls what D streamed last.
    messages += [{"role": "assistant", "content": "d says"}, {"role": "user", "content": "more"}]
    d.stream_params = False
    with proxy.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "stream": True, "conversation_id": "chat-1"},
    ) as response:
        response.read()
    assert p.bodies()[-1]["kv_transfer_params"][REMOTE_REQUEST_ID] == "d-1"
    # A stream without params (vLLM 0.32 streams carry none) leaves nothing to pull.
    post(proxy, "/v1/chat/completions", conversation="chat-1", messages=messages)
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()


def test_conversation_decodes_on_the_decode_server_holding_its_blocks(cluster):
    p = cluster.engine("p")
    d0, d1 = cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1])
    holder = {"conv-0": d0, "conv-1": d1, "conv-2": d0, "conv-3": d1}

    for c, engine in holder.items():
        response = post(proxy, conversation=c, prompt=proxy.prompt_routed_to(engine, c))
        assert response.headers["x-kvduplex-decode"] == engine.address
        assert response.headers["x-kvduplex-conversation"] == "miss"

    # Later turns' prompts hash to the other D (short prompts change key), but the remembered
    # D, which holds the conversation's blocks, comes first.
    for turn in range(2):
        for c in reversed(holder):
            other = d1 if holder[c] is d0 else d0
            prompt = proxy.prompt_routed_to(other, f"{c} turn {turn}")
            response = post(proxy, conversation=c, prompt=prompt)
            assert response.headers["x-kvduplex-decode"] == holder[c].address
            assert response.headers["x-kvduplex-conversation"] == "hit"
            pulled = p.bodies()[-1]["kv_transfer_params"]
            assert pulled[REMOTE_ENGINE_ID] == holder[c].name
            assert pulled[REMOTE_PORT] == holder[c].port
    assert proxy.metric("kvduplex_proxy_decode_routes_total", rule="hash") == 4
    assert proxy.metric("kvduplex_proxy_decode_routes_total", rule="remembered") == 8


def test_callers_never_use_each_others_conversations(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])

    assert post(proxy, conversation="shared", api_key="key-a").status_code == 200
    # Caller B knows the id but not A's key: its prefill pulls nothing, A's entry stays.
    assert post(proxy, conversation="shared", api_key="key-b").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    # Nor do callers without a key.
    assert post(proxy, conversation="shared").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    # B cannot smuggle params in either.
    forged = dict(d.decode_params("forged"))
    before = len(p.requests)
    response = post(proxy, conversation="shared", api_key="key-b", kv_transfer_params=forged)
    assert response.status_code == 400
    assert "kv_transfer_params" in response.json()["error"]["message"]
    assert len(p.requests) == before

    assert post(proxy, conversation="shared", api_key="key-a").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"][REMOTE_REQUEST_ID] == "d-1"
    # The API key reaches the upstreams, which may check it themselves.
    assert p.requests[-1]["headers"]["authorization"] == "Bearer key-a"
    assert d.requests[-1]["headers"]["authorization"] == "Bearer key-a"


def test_tenant_header_scopes_conversations_when_configured(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], tenant_header="X-Tenant")

    post(proxy, conversation="c", api_key="k1", headers={"X-Tenant": "acme"})
    post(proxy, conversation="c", api_key="k1", headers={"X-Tenant": "other"})
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    # The tenant, not the key, names the caller.
    post(proxy, conversation="c", api_key="k2", headers={"X-Tenant": "acme"})
    assert p.bodies()[-1]["kv_transfer_params"][REMOTE_REQUEST_ID] == "d-1"


def test_entries_expire_after_the_conversation_ttl(cluster, clock):
    p, d = cluster.engine("p"), cluster.engine("d")
    store = InMemoryConversationStore(
        ttl_s=30, max_entries=100, max_entry_bytes=1 << 20, max_total_bytes=1 << 30, clock=clock
    )
    proxy = cluster.proxy([p], [d], store=store)

    post(proxy, conversation="fresh")
    post(proxy, conversation="stale")
    clock.advance(29.9)
    post(proxy, conversation="fresh")
    assert p.bodies()[-1]["kv_transfer_params"][REMOTE_REQUEST_ID] == "d-1"
    clock.advance(0.1)
    response = post(proxy, conversation="stale")
    assert response.headers["x-kvduplex-conversation"] == "expired"
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="expired") == 1


def test_store_size_bound_evicts_least_recently_written(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], max_conversations=2)

    for c in ("c1", "c2", "c3"):
        post(proxy, conversation=c)
    assert proxy.metric("kvduplex_proxy_conversation_evictions_total") == 1
    post(proxy, conversation="c2")
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[1]
    post(proxy, conversation="c3")
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[2]
    post(proxy, conversation="c1")
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["type"], str)
    return error["message"]


def test_bad_requests_get_openai_shaped_4xx_without_reaching_upstreams(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], max_body_bytes=1000, max_conversation_id_length=8)
    client = proxy.client

    json_headers = {"content-type": "application/json"}
    assert "not valid JSON" in _error(
        client.post("/v1/completions", content=b"{nope", headers=json_headers), 400
    )
    assert "JSON object" in _error(client.post("/v1/completions", json=[1, 2]), 400)
    # JSON's parser takes these; no server could be sent them.
    nan = b'{"model": "tiny", "prompt": "a", "temperature": NaN}'
    assert "NaN is not a JSON number" in _error(
        client.post("/v1/completions", content=nan, headers=json_headers), 400
    )
    huge = b'{"model": "tiny", "prompt": "a", "temperature": -1e999}'
    assert "out of a JSON number's range" in _error(
        client.post("/v1/completions", content=huge, headers=json_headers), 400
    )
    lone = b'{"model": "tiny", "prompt": "a \\ud800 b"}'
    assert "surrogate" in _error(
        client.post("/v1/completions", content=lone, headers=json_headers), 400
    )
    assert "'stream'" in _error(post(proxy, stream="yes"), 400)
    assert "conversation_id" in _error(post(proxy, conversation_id=7), 400)
    assert "differ" in _error(post(proxy, conversation="a", conversation_id="b"), 400)
    assert "1 to 8" in _error(post(proxy, conversation="x" * 9), 400)
    assert "exceeds 1000" in _error(post(proxy, prompt="x" * 2000), 413)
    chunked = (part for part in [b'{"prompt": "', b"x" * 2000, b'"}'])
    assert "exceeds 1000" in _error(client.post("/v1/completions", content=chunked), 413)
    assert "unknown route" in _error(client.post("/v1/embeddings", json={}), 404)
    assert "unknown route" in _error(client.get("/nope"), 404)
    assert "not allowed" in _error(client.get("/v1/completions"), 405)

    assert p.requests == [] and d.requests == []
    assert proxy.metric("kvduplex_proxy_errors_total", kind="bad_request") == 14

    # A surrogate pair is one character, sent on as such.
    pair = b'{"model": "tiny", "prompt": "\\ud83d\\ude00"}'
    response = client.post("/v1/completions", content=pair, headers=json_headers)
    assert response.status_code == 200, response.text
    assert p.bodies()[-1]["prompt"] == "\U0001f600"


def test_upstream_error_statuses_are_relayed_in_openai_shape(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])

    vllm_error = {
        "error": {
            "message": "prompt too long",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    p.fail_with = (400, vllm_error)
    response = post(proxy)
    assert response.status_code == 400 and response.json() == vllm_error
    assert d.requests == []

    p.fail_with = None
    d.fail_with = (500, "engine exploded")
    message = _error(post(proxy), 500)
    assert "decode server" in message and "engine exploded" in message
    message = _error(post(proxy, stream=True), 500)
    assert "engine exploded" in message
    # An answered error is not a dead server: both stay in rotation.
    assert (
        proxy.metric(
            "kvduplex_proxy_upstream_healthy", role="decode", upstream=f"127.0.0.1:{d.port}"
        )
        == 1
    )
    assert proxy.metric("kvduplex_proxy_errors_total", kind="upstream_status") == 3


def test_models_health_and_metrics(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])

    models = proxy.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"

    health = proxy.client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert health.json()["decode"] == [
        {"address": f"127.0.0.1:{d.port}", "healthy": True, "outstanding": 0}
    ]

    post(proxy, conversation="m")
    post(proxy, conversation="m")
    metrics = proxy.client.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    assert 'kvduplex_proxy_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert 'kvduplex_proxy_conversation_lookups_total{result="hit"} 1.0' in text
    assert 'kvduplex_proxy_conversation_lookups_total{result="miss"} 1.0' in text
    assert (
        f'kvduplex_proxy_upstream_outstanding{{role="prefill",upstream="127.0.0.1:{p.port}"}} 0.0'
        in text
    )
    assert "kvduplex_proxy_prefill_seconds_count 2.0" in text


def test_responses_api_turns_prefill_one_token_and_replay_decode_params(cluster):
    """`/v1/responses`: P's leg generates one token (`max_output_tokens`) and stores nothing;
    D's params come back in the response (top level when not streamed, inside the final
    `response.completed` event's response when streamed), are kept from the client and handed
    to P on the conversation's next turn."""
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])
    first = post(proxy, "/v1/responses", conversation="r1", input="turn one",
                 max_output_tokens=7, store=True)
    assert first.status_code == 200, first.text
    assert "kv_transfer_params" not in first.json()
    p_body = p.bodies("/v1/responses")[-1]
    assert p_body["max_output_tokens"] == 1 and p_body["stream"] is False
    assert p_body["store"] is False and "max_tokens" not in p_body
    assert p_body["kv_transfer_params"] == prefill_request_params()
    d_body = d.bodies("/v1/responses")[-1]
    assert d_body["max_output_tokens"] == 7 and d_body["store"] is True

    streamed = post(proxy, "/v1/responses", conversation="r1", input="turn two", stream=True)
    assert streamed.status_code == 200, streamed.text
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[0]
    events = sse_events(streamed.content)
    assert [e["type"] for e in events][-1] == "response.completed"
    assert "kv_transfer_params" not in events[-1]["response"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"].startswith("d says")

    # The streamed turn's params (from its response.completed event) serve the third turn.
    assert post(proxy, "/v1/responses", conversation="r1", input="turn three").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[1]


def test_responses_api_state_kept_on_one_server_is_refused_with_the_reason(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])
    for field, value in (("previous_response_id", "resp_1"), ("background", True)):
        answer = post(proxy, "/v1/responses", input="hi", **{field: value})
        assert answer.status_code == 400, answer.text
        assert field in answer.json()["error"]["message"]
    assert p.bodies() == [] and d.bodies() == []
