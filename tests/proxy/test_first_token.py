"""The pure parts of a streamed answer's first token from P (`kvduplex.proxy.first_token`): which
requests may start with it, what P's answer must show, D's continuation request and the
rewriting of D's events. The flow through real servers is in tests/e2e (the chat tests compare
every streamed answer with a single server's, token ids, logprobs and usage)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvduplex.protocol import REMOTE_NUM_TOKENS
from kvduplex.proxy.first_token import (
    ContinuationRewriter,
    decode_body,
    first_chunk,
    first_token,
    ineligible_reason,
    prefill_fields,
)
from kvduplex.proxy.routes import CHAT_ROUTE, COMPLETIONS_ROUTE, RESPONSES_ROUTE

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "max_tokens": 8, "temperature": 0}
PROMPT_IDS = [5, 6, 7]


def chat_answer(**choice: Any) -> dict[str, Any]:
    base = {
        "index": 0,
        "message": {"role": "assistant", "content": " x", "tool_calls": [], "reasoning": None},
        "logprobs": {"content": [{"token": " x", "logprob": -0.5}]},
        "finish_reason": "length",
        "token_ids": [42],
    }
    base.update(choice)
    return {"id": "chatcmpl-p", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [base], "prompt_token_ids": PROMPT_IDS}


def completion_answer() -> dict[str, Any]:
    return {"id": "cmpl-p", "object": "text_completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "text": " x", "logprobs": None, "finish_reason": "length",
                         "prompt_token_ids": PROMPT_IDS, "token_ids": [42]}]}


PARAMS = {"do_remote_prefill": True, REMOTE_NUM_TOKENS: len(PROMPT_IDS)}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"stream": False}, "not_streamed"),
        ({"n": 2}, "several_choices"),
        ({"stop": ["\n"]}, "stop_strings"),
        ({"stop": []}, None),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, None),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "a+"}}, "structured_output"),
        ({"seed": 3, "temperature": 0.7}, "seeded_sampling"),
        ({"seed": 3, "temperature": None}, "seeded_sampling"),
        ({"seed": 3, "temperature": 0}, None),
        ({"temperature": 0.7}, None),
        ({"max_tokens": 1}, "one_token"),
        ({"max_completion_tokens": 1}, "one_token"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "echo"),
    ],
)
def test_only_requests_whose_answer_cannot_change_start_with_ps_token(change, reason):
    assert ineligible_reason(CHAT_ROUTE, {**CHAT, **change}) == reason


def test_routes_and_completion_prompts():
    completion = {"prompt": "hi", "stream": True, "max_tokens": 4}
    assert ineligible_reason(COMPLETIONS_ROUTE, completion) is None
    assert ineligible_reason(COMPLETIONS_ROUTE, {**completion, "prompt": [1, 2]}) is None
    assert ineligible_reason(COMPLETIONS_ROUTE, {**completion, "prompt": [[1, 2]]}) is None
    assert ineligible_reason(COMPLETIONS_ROUTE, {**completion, "prompt": ["a", "b"]}) == (
        "several_prompts"
    )
    assert ineligible_reason(RESPONSES_ROUTE, {"input": "hi", "stream": True}) == "route"


def test_p_is_asked_for_token_ids_and_keeps_the_first_tokens_min_tokens():
    assert prefill_fields(CHAT) == {"return_token_ids": True}
    assert prefill_fields({**CHAT, "min_tokens": 5}) == {"return_token_ids": True, "min_tokens": 1}


@pytest.mark.parametrize(
    ("answer", "params", "reason"),
    [
        (chat_answer(), PARAMS, None),
        (chat_answer(), None, "no_params"),
        (chat_answer(finish_reason="stop"), PARAMS, "answer_ended"),
        (chat_answer(token_ids=None), PARAMS, "no_token_ids"),
        (chat_answer(token_ids=[1, 2]), PARAMS, "no_token_ids"),
        # A state-space model's P computes all but the last prompt token.
        (chat_answer(), {**PARAMS, REMOTE_NUM_TOKENS: 2}, "prompt_not_computed"),
        (
            chat_answer(message={"role": "assistant", "content": None, "reasoning": "think"}),
            PARAMS,
            "not_plain_content",
        ),
        (
            chat_answer(message={"role": "assistant", "content": "", "tool_calls": [{"id": 1}]}),
            PARAMS,
            "not_plain_content",
        ),
        ({"choices": []}, PARAMS, "malformed"),
        ([], PARAMS, "malformed"),
    ],
)
def test_ps_token_is_used_only_when_p_computed_the_whole_prompt_and_the_answer_goes_on(
    answer, params, reason
):
    found, why = first_token(CHAT_ROUTE, answer, params)
    assert why == reason
    assert (found is None) == (reason is not None)


def test_d_continues_after_the_first_token_with_one_token_less():
    first, _ = first_token(CHAT_ROUTE, chat_answer(), PARAMS)
    body = {**CHAT, "max_completion_tokens": 8, "min_tokens": 8}
    before = copy.deepcopy(body)
    decode = decode_body(body, first, PARAMS, "kv_transfer_params")
    assert body == before
    assert decode["max_tokens"] == 7 and decode["max_completion_tokens"] == 7
    assert decode["min_tokens"] == 7
    assert decode["kv_transfer_params"] == {**PARAMS, "prompt_token_ids": [5, 6, 7, 42]}
    assert decode["messages"] == CHAT["messages"]

    first, _ = first_token(COMPLETIONS_ROUTE, completion_answer(), PARAMS)
    decode = decode_body({"prompt": "hi", "stream": True, "max_tokens": 4}, first, PARAMS, "kv")
    assert decode["prompt"] == [5, 6, 7, 42] and decode["max_tokens"] == 3
    assert decode["kv"] == PARAMS


def test_the_first_event_has_the_shape_of_the_servers():
    first, _ = first_token(CHAT_ROUTE, chat_answer(), PARAMS)
    event = first_chunk(first, {**CHAT, "return_token_ids": True})
    assert event["object"] == "chat.completion.chunk" and event["id"] == "chatcmpl-p"
    (choice,) = event["choices"]
    assert choice["delta"] == {"role": "assistant", "content": " x"}
    assert choice["token_ids"] == [42] and event["prompt_token_ids"] == PROMPT_IDS
    assert choice["logprobs"] == {"content": [{"token": " x", "logprob": -0.5}]}
    plain = first_chunk(first, CHAT)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    usage = first_chunk(
        first, {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    )["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

    first, _ = first_token(COMPLETIONS_ROUTE, completion_answer(), PARAMS)
    event = first_chunk(first, {"prompt": "hi", "return_token_ids": True})
    assert event["object"] == "text_completion"
    assert event["choices"][0]["text"] == " x"
    assert event["choices"][0]["prompt_token_ids"] == PROMPT_IDS


def test_ds_events_continue_the_first_one():
    first, _ = first_token(CHAT_ROUTE, chat_answer(), PARAMS)
    rewrite = ContinuationRewriter(first)
    role = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "prompt_token_ids": [5, 6, 7, 42],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]}
    assert rewrite(role) is None
    token = {"id": "chatcmpl-d", "choices": [{"index": 0, "delta": {"content": " y"},
                                              "logprobs": None, "finish_reason": None,
                                              "token_ids": [43]}]}
    assert rewrite(copy.deepcopy(token)) == {**token, "id": "chatcmpl-p"}
    usage = {"id": "chatcmpl-d", "choices": [],
             "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}
    assert rewrite(usage)["usage"] == {"prompt_tokens": 3, "completion_tokens": 8,
                                       "total_tokens": 11}
    last = {"id": "chatcmpl-d", "choices": [{"index": 0, "delta": {"content": ""},
                                             "logprobs": None, "finish_reason": "length"}]}
    assert rewrite(copy.deepcopy(last))["choices"] == last["choices"]

    first, _ = first_token(COMPLETIONS_ROUTE, completion_answer(), PARAMS)
    rewrite = ContinuationRewriter(first)
    chunk = {"id": "cmpl-d", "choices": [{"index": 0, "text": " y", "prompt_token_ids": [1],
                                          "logprobs": {"tokens": [" y"], "text_offset": [0]},
                                          "finish_reason": None}]}
    (choice,) = rewrite(chunk)["choices"]
    assert "prompt_token_ids" not in choice and choice["logprobs"]["text_offset"] == [2]


# ---- through the proxy, with fake engines over real HTTP (tests/proxy/conftest.py) ----------


def _stream(proxy, body: dict[str, Any]) -> tuple[bytes, list[dict[str, Any]]]:
    with proxy.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        raw = response.read()
    events = [
        json.loads(line[5:])
        for line in raw.decode().splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]
    return raw, events


def test_the_stream_starts_with_ps_token_and_d_continues_after_it(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    p.sampled_token, d.role_chunk = 99, True
    proxy = cluster.proxy([p], [d])
    body = {**CHAT, "return_token_ids": True, "stream_options": {"include_usage": True}}

    raw, events = _stream(proxy, body)

    assert raw.rstrip().endswith(b"data: [DONE]")
    first, *rest = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert first["choices"][0]["token_ids"] == [99] and first["prompt_token_ids"] == p.sampled_prompt
    # D's role chunk is gone; every event carries P's response id.
    assert all("role" not in (e["choices"][0].get("delta") or {}) for e in rest if e["choices"])
    assert {e["id"] for e in events} == {first["id"]}
    p_body, d_body = p.bodies()[-1], d.bodies()[-1]
    assert p_body["return_token_ids"] is True and p_body["max_tokens"] == 1
    assert d_body["max_tokens"] == CHAT["max_tokens"] - 1
    assert d_body["kv_transfer_params"]["prompt_token_ids"] == [*p.sampled_prompt, 99]
    assert proxy.metric("kvduplex_proxy_first_tokens_total", source="prefill", reason="") == 1

    # A P that answers without token ids (an older server): D's first token, as before.
    p.sampled_token = None
    _, events = _stream(proxy, body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" not in d.bodies()[-1]["kv_transfer_params"]
    assert proxy.metric(
        "kvduplex_proxy_first_tokens_total", source="decode", reason="no_token_ids"
    ) == 1


def test_a_decode_server_failing_after_the_first_token_ends_the_stream_with_an_error(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    p.sampled_token = 99
    d.fail_with = (503, {"error": {"message": "overloaded", "type": "x", "code": 503}})
    proxy = cluster.proxy([p], [d])

    raw, events = _stream(proxy, CHAT)

    assert events[0]["choices"][0]["delta"]["content"] == "x"
    assert events[-1]["error"]["code"] == 503 and "overloaded" in events[-1]["error"]["message"]
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert proxy.metric("kvduplex_proxy_errors_total", kind="upstream_status") == 1
