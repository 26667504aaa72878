"""Local continuations (`kvduplex.proxy.continuation`): the ledger of served chat histories on its
own, with a fake clock, and the proxy sending a short continuation to the D that served its
history, against fake engines over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from conftest import FakeClock
from kvduplex.protocol import DO_REMOTE_DECODE, KEEP_TURN, PROTOCOL_KEY, PROTOCOL_VERSION
from kvduplex.proxy.config import ConfigError, ProxyConfig, parse_upstream
from kvduplex.proxy.continuation import TurnLedger, chat_turn, why_not_local
from kvduplex.proxy.routes import CHAT_ROUTE, COMPLETIONS_ROUTE
from test_proxy_flow import sse_events

USER_1 = {"role": "user", "content": "tell me about block pools"}
ANSWER_1 = {"role": "assistant", "content": "a block pool hands out fixed-size blocks"}
USER_2 = {"role": "user", "content": "and who frees them?"}


def size(*messages: dict[str, Any]) -> int:
    """What messages add to a history, as the ledger counts it: their text and other fields."""
    return sum(
        len(m["content"]) + len(json.dumps({"role": m["role"]}).replace(" ", "")) for m in messages
    )


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": list(messages), **fields}


def ledger(clock: FakeClock, max_chars: int = 100, max_entries: int = 10) -> TurnLedger:
    return TurnLedger(max_chars=max_chars, ttl_s=60.0, max_entries=max_entries, clock=clock)


def turn(body: dict[str, Any], caller: str = "anonymous", route: str = CHAT_ROUTE) -> Any:
    found = chat_turn(caller, route, body)
    assert found is not None
    return found


def test_a_turn_continues_the_history_its_d_served_when_what_it_adds_is_short():
    clock = FakeClock()
    turns = ledger(clock)
    turns.served(turn(chat(USER_1)), "d1:1", 0)

    found = turns.continuation(turn(chat(USER_1, ANSWER_1, USER_2)))
    assert found is not None and (found.decode, found.epoch) == ("d1:1", 0)
    assert found.added_chars == size(ANSWER_1, USER_2)

    # Added more than the limit: P prefills it (and pulls the history back from D).
    long_turn = turn(chat(USER_1, ANSWER_1, {"role": "user", "content": "x" * 100}))
    assert turns.continuation(long_turn) is None
    # The first turn itself continues nothing; neither does another conversation.
    assert turns.continuation(turn(chat(USER_1))) is None
    other = {"role": "user", "content": "something else"}
    assert turns.continuation(turn(chat(other, ANSWER_1, USER_2))) is None


def test_the_longest_served_history_wins_and_each_turn_is_recorded():
    clock = FakeClock()
    turns = ledger(clock, max_chars=1000)
    turns.served(turn(chat(USER_1)), "d1:1", 0)
    turns.served(turn(chat(USER_1, ANSWER_1, USER_2)), "d2:2", 0)
    answer_2 = {"role": "assistant", "content": "the hold's owner"}
    user_3 = {"role": "user", "content": "thanks"}

    found = turns.continuation(turn(chat(USER_1, ANSWER_1, USER_2, answer_2, user_3)))
    assert found is not None and found.decode == "d2:2"
    assert found.added_chars == size(answer_2, user_3)


def test_what_shapes_the_prompt_and_who_asks_are_part_of_the_history():
    clock = FakeClock()
    turns = ledger(clock)
    turns.served(turn(chat(USER_1), caller="alice"), "d1:1", 0)
    continued = chat(USER_1, ANSWER_1, USER_2)

    assert turns.continuation(turn(continued, caller="alice")) is not None
    assert turns.continuation(turn(continued, caller="mallory")) is None
    other_template = chat(USER_1, ANSWER_1, USER_2, chat_template_kwargs={"x": 1})
    assert turns.continuation(turn(other_template, caller="alice")) is None
    # An edited earlier message is another history; an answer other than the one D computed
    # is part of what the turn adds (D's cache has the history up to it).
    edited_user = {"role": "user", "content": "tell me about block tables"}
    assert turns.continuation(turn(chat(edited_user, ANSWER_1, USER_2), caller="alice")) is None
    edited = {"role": "assistant", "content": "something D never said"}
    found = turns.continuation(turn(chat(USER_1, edited, USER_2), caller="alice"))
    assert found is not None
    assert found.added_chars == size(edited, USER_2)


def test_served_histories_expire_after_the_ttl_and_the_ledger_is_bounded():
    clock = FakeClock()
    turns = ledger(clock, max_entries=2)
    turns.served(turn(chat(USER_1)), "d1:1", 0)
    clock.advance(59.0)
    assert turns.continuation(turn(chat(USER_1, ANSWER_1, USER_2))) is not None
    clock.advance(1.0)
    assert turns.continuation(turn(chat(USER_1, ANSWER_1, USER_2))) is None
    assert len(turns) == 0  # the expired entry went when it was found

    for i in range(3):
        turns.served(turn(chat({"role": "user", "content": f"chat {i}"})), "d1:1", 0)
    assert len(turns) == 2
    first = chat({"role": "user", "content": "chat 0"}, ANSWER_1, USER_2)
    last = chat({"role": "user", "content": "chat 2"}, ANSWER_1, USER_2)
    assert turns.continuation(turn(first)) is None  # least recently recorded, gone
    assert turns.continuation(turn(last)) is not None


@pytest.mark.parametrize(
    "route, body",
    [
        (COMPLETIONS_ROUTE, {"model": "tiny", "prompt": "hello"}),
        (CHAT_ROUTE, chat(USER_1, n=2)),
        (CHAT_ROUTE, chat({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})),
        (CHAT_ROUTE, chat("not a message")),  # type: ignore[arg-type]
        (CHAT_ROUTE, {"model": "tiny", "messages": []}),
    ],
)
def test_only_single_choice_text_chats_are_continued_locally(route, body):
    assert chat_turn("anonymous", route, body) is None


def test_the_search_looks_back_no_further_than_the_limit():
    """However long the conversation, the search stops once the messages it passed carry more
    than the limit: an expired record further back is not even reached (reaching it removes
    it)."""
    clock = FakeClock()
    turns = ledger(clock, max_chars=45)
    assert size(ANSWER_1, USER_2) > 45
    turns.served(turn(chat(USER_1)), "d1:1", 0)
    clock.advance(60.0)
    assert turns.continuation(turn(chat(USER_1, ANSWER_1, USER_2))) is None
    assert len(turns) == 1
    # Within the limit, the search reaches it and drops it.
    short = {"role": "assistant", "content": "ok"}
    assert turns.continuation(turn(chat(USER_1, short, {"role": "user", "content": "?"}))) is None
    assert len(turns) == 0
    text_parts = {"role": "user", "content": [{"type": "text", "text": "ab"}]}
    assert turn(chat(text_parts)).chars[0] == 2 + len('{"role":"user"}')


def test_a_negative_limit_is_refused():
    with pytest.raises(ConfigError, match="local_continuation_max_chars"):
        ProxyConfig(
            prefill=(parse_upstream("127.0.0.1:1"),),
            decode=(parse_upstream("127.0.0.1:2"),),
            local_continuation_max_chars=-1,
        )


@pytest.mark.parametrize(
    ("when", "prefill_in_flight", "decode_computing_alone", "reason"),
    [
        ("always", 0, 3, None),
        ("prefill_busy", None, 3, None),  # no P in rotation: D it is
        ("prefill_busy", 0, 0, "prefill_idle"),
        ("prefill_busy", 1, 0, None),
        ("prefill_busy", 2, 1, "decode_busy"),
    ],
)
def test_when_a_continuation_goes_to_its_d(when, prefill_in_flight, decode_computing_alone, reason):
    assert why_not_local(when, prefill_in_flight, decode_computing_alone) == reason


def test_an_unknown_when_is_refused():
    with pytest.raises(ConfigError, match="local_continuation_when"):
        ProxyConfig(
            prefill=(parse_upstream("127.0.0.1:1"),),
            decode=(parse_upstream("127.0.0.1:2"),),
            local_continuation_when="sometimes",
        )


def post_chat(handle: Any, body: dict[str, Any]) -> Any:
    response = handle.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def test_a_short_continuation_goes_to_the_d_that_served_its_history_alone(cluster):
    p, d1, d2 = cluster.engine("p"), cluster.engine("d1"), cluster.engine("d2")
    proxy = cluster.proxy(
        [p], [d1, d2], local_continuation_max_chars=200, local_continuation_when="always"
    )

    first = post_chat(proxy, chat(USER_1, stream=True))
    served_by = first.headers["x-kvduplex-decode"]
    holder = d1 if served_by == d1.address else d2
    assert len(p.bodies()) == 1

    second = post_chat(proxy, chat(USER_1, ANSWER_1, USER_2, stream=True))
    assert len(p.bodies()) == 1, "P must not see a local continuation"
    assert second.headers["x-kvduplex-decode"] == holder.address
    assert second.headers["x-kvduplex-prefill"] == "none"
    local = holder.bodies()[-1]
    assert local["kv_transfer_params"] == {KEEP_TURN: True, PROTOCOL_KEY: PROTOCOL_VERSION}
    assert local["messages"] == [USER_1, ANSWER_1, USER_2] and local["stream"] is True
    assert "".join(
        e["choices"][0]["delta"].get("content") or "" for e in sse_events(second.content)
    ).startswith(f"{holder.name} says")
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="local") == 1
    assert proxy.metric("kvduplex_proxy_decode_routes_total", rule="local") == 1

    assert proxy.metric("kvduplex_proxy_first_tokens_total", source="decode", reason="local") == 1

    # The local turn is served too: the next one continues it, not streamed this time; D's
    # answer offers the turn it kept, so that one is recorded as well.
    answer_2 = {"role": "assistant", "content": "its owner"}
    history_3 = [USER_1, ANSWER_1, USER_2, answer_2, USER_2]
    third = post_chat(proxy, chat(*history_3))
    assert len(p.bodies()) == 1 and "kv_transfer_params" not in third.json()
    answer_3 = {"role": "assistant", "content": "the scheduler"}
    post_chat(proxy, chat(*history_3, answer_3, USER_1))
    assert len(p.bodies()) == 1
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="local") == 3

    # A long addition goes through P.
    long_user = {"role": "user", "content": "y" * 300}
    post_chat(proxy, chat(*history_3, answer_3, long_user))
    assert len(p.bodies()) == 2
    assert proxy.proxy.decode.get(holder.address).computing_alone == 0


def test_a_turn_sent_the_moment_its_stream_says_done_continues_it(cluster):
    """A chat client's SDK ends a stream at `data: [DONE]` and may send its next turn before D's
    response has ended: the proxy records the turn before it passes `[DONE]` on."""
    p, d = cluster.engine("p"), cluster.engine("d")
    d.stream_end_delay_s = 1.0
    proxy = cluster.proxy([p], [d], local_continuation_max_chars=200, local_continuation_when="always")
    request = proxy.client.build_request(
        "POST", "/v1/chat/completions", json=chat(USER_1, stream=True)
    )
    first = proxy.client.send(request, stream=True)
    try:
        lines = first.iter_lines()
        while next(lines).strip() != "data: [DONE]":
            pass
        second = post_chat(proxy, chat(USER_1, ANSWER_1, USER_2, stream=True))
    finally:
        first.close()
    assert second.headers["x-kvduplex-prefill"] == "none"
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="local") == 1
    assert len(p.bodies()) == 1


def test_when_prefill_busy_a_continuation_goes_to_its_d_only_while_p_has_a_prefill_in_flight(
    cluster,
):
    """`local_continuation_when="prefill_busy"` (the default): an idle P prefills the turn; while
    P has a prefill in flight the turn is computed on its D, unless that D computes another
    turn alone that has not answered (its first chunk, streamed) yet."""
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], local_continuation_max_chars=200)
    post_chat(proxy, chat(USER_1, stream=True))
    post_chat(proxy, chat(USER_1, ANSWER_1, USER_2, stream=True))
    assert len(p.bodies()) == 2, "an idle P prefills the continuation"
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="prefill_idle") == 1

    # A first turn of another chat keeps P busy until its gate opens.
    p.answer_gate, d.answer_gate = threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def send(name: str, body: dict[str, Any]) -> threading.Thread:
        def run() -> None:
            try:
                results[name] = post_chat(proxy, body)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                results[name] = exc

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    holder = proxy.proxy.decode.get(d.address)
    threads = [send("busy", chat(USER_2, stream=True))]
    try:
        wait_until(lambda: proxy.proxy.prefill.upstreams[0].outstanding == 1)
        # P busy, D free: the continuation goes to D alone, and D computes it until it answers.
        threads.append(send("local", chat(USER_1, ANSWER_1, USER_2, stream=True)))
        wait_until(lambda: holder.computing_alone == 1)
        # The proxy counts before the fake engines have read the bodies: wait for them too.
        wait_until(lambda: len(p.bodies()) == 3 and len(d.bodies()) == 3)
        # D computing a turn alone: the next continuation goes through P.
        threads.append(send("through_p", chat(USER_1, ANSWER_1, USER_2)))
        wait_until(lambda: len(p.bodies()) == 4)
        assert proxy.metric("kvduplex_proxy_local_continuations_total", result="decode_busy") == 1
        d.answer_gate.set()
        threads[1].join()
        assert holder.computing_alone == 0
    finally:
        d.answer_gate.set()
        p.answer_gate.set()
        for thread in threads:
            thread.join()
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    assert results["local"].headers["x-kvduplex-prefill"] == "none"
    assert results["through_p"].headers["x-kvduplex-prefill"] == p.address
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="local") == 1
    assert holder.computing_alone == 0

    # A client that leaves before D's first chunk: the relay's close releases D.
    d.answer_gate = threading.Event()
    p.answer_gate = threading.Event()
    threads = [send("busy_2", chat(USER_2, stream=True))]
    try:
        wait_until(lambda: proxy.proxy.prefill.upstreams[0].outstanding == 1)
        with httpx.Client(base_url=proxy.url, timeout=0.5) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post(
                    "/v1/chat/completions", json=chat(USER_1, ANSWER_1, USER_2, stream=True)
                )
        assert holder.computing_alone == 1
        d.answer_gate.set()
        wait_until(lambda: holder.computing_alone == 0)
    finally:
        d.answer_gate.set()
        p.answer_gate.set()
        for thread in threads:
            thread.join()


def wait_until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_non_streamed_turn_whose_d_offers_no_held_turn_is_not_continued_locally(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy(
        [p], [d], local_continuation_max_chars=200, local_continuation_when="always"
    )
    d.return_decode_params = False  # a D that keeps no turns (one-way)
    post_chat(proxy, chat(USER_1))
    post_chat(proxy, chat(USER_1, ANSWER_1, USER_2))
    assert len(p.bodies()) == 2
    assert len(proxy.proxy.turns) == 0


def test_a_conversation_id_keeps_its_entry_across_local_turns(cluster):
    """With a conversation id, D's params from a local turn are remembered like any other, and
    the turn after a long one (through P) hands P the params of the last local turn."""
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy(
        [p], [d], local_continuation_max_chars=200, local_continuation_when="always"
    )
    headers = {"X-Conversation-Id": "c1"}

    def send(*messages: dict[str, Any]) -> None:
        response = proxy.client.post("/v1/chat/completions", json=chat(*messages), headers=headers)
        assert response.status_code == 200, response.text
        assert "kv_transfer_params" not in response.json()

    send(USER_1)
    send(USER_1, ANSWER_1, USER_2)  # local: the entry of turn 1 is taken, D's new one stored
    assert len(p.bodies()) == 1
    local_params = d.returned_params[-1]
    assert local_params is not None
    long_user = {"role": "user", "content": "y" * 300}
    send(USER_1, ANSWER_1, USER_2, ANSWER_1, long_user)
    assert len(p.bodies()) == 2
    pulled = p.bodies()[-1]["kv_transfer_params"]
    assert pulled[DO_REMOTE_DECODE] is True
    assert pulled["remote_request_id"] == local_params["remote_request_id"]
    # Turn 2 found turn 1's entry but pulled nothing (local); turn 3 pulled turn 2's.
    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="local") == 1
    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="hit") == 1


def test_a_local_turn_that_d_fails_returns_its_error_and_is_counted_once(cluster):
    """D answers a local turn with an error: the caller gets it (as on the P/D path), the turn
    counts as decode_error, and the conversation entry it took counts once, as local."""
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy(
        [p], [d], local_continuation_max_chars=200, local_continuation_when="always"
    )
    headers = {"X-Conversation-Id": "c1"}
    first = proxy.client.post("/v1/chat/completions", json=chat(USER_1), headers=headers)
    assert first.status_code == 200, first.text
    d.fail_with = (500, {"error": {"message": "engine dead", "type": "InternalServerError"}})
    second = proxy.client.post(
        "/v1/chat/completions", json=chat(USER_1, ANSWER_1, USER_2), headers=headers
    )
    assert second.status_code == 500
    assert len(p.bodies()) == 1, "not prefilled on P after D answered"
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="decode_error") == 1
    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="miss") == 1
    assert proxy.metric("kvduplex_proxy_conversation_lookups_total", result="local") == 1
    assert proxy.proxy.decode.get(d.address).computing_alone == 0


def test_a_continuation_whose_d_is_gone_is_prefilled_on_p_and_never_on_another_d(cluster):
    p, d1, d2 = cluster.engine("p"), cluster.engine("d1"), cluster.engine("d2")
    clock = FakeClock()
    proxy = cluster.proxy(
        [p],
        [d1, d2],
        clock=clock,
        local_continuation_max_chars=200,
        local_continuation_when="always",
    )
    first = post_chat(proxy, chat(USER_1))
    holder, other = (d1, d2) if first.headers["x-kvduplex-decode"] == d1.address else (d2, d1)
    cluster.stop_engine(holder)
    before_other = len(other.bodies())

    # The request to the stopped D fails to connect: P prefills, another D decodes.
    second = post_chat(proxy, chat(USER_1, ANSWER_1, USER_2))
    assert second.headers["x-kvduplex-decode"] == other.address
    assert len(p.bodies()) == 2
    assert all(KEEP_TURN not in (b.get("kv_transfer_params") or {}) for b in other.bodies())
    assert len(other.bodies()) == before_other + 1
    assert proxy.metric("kvduplex_proxy_local_continuations_total", result="decode_failed") == 1
    assert proxy.proxy.decode.get(holder.address).computing_alone == 0

    # Out of rotation now: not even tried.
    post_chat(proxy, chat(USER_1, ANSWER_1, USER_2))
    assert (
        proxy.metric("kvduplex_proxy_local_continuations_total", result="decode_unavailable") == 1
    )

    # Back in rotation, it may have restarted without the history: it is not continued there.
    cluster.restart_engine(holder)
    clock.advance(2.0)
    proxy.check_health()
    assert proxy.proxy.decode.get(holder.address).healthy
    post_chat(proxy, chat(USER_1, ANSWER_1, USER_2))
    assert all(KEEP_TURN not in (b.get("kv_transfer_params") or {}) for b in holder.bodies())
    assert len(p.bodies()) == 4, "prefilled on P"
    assert (
        proxy.metric("kvduplex_proxy_local_continuations_total", result="decode_unavailable") == 2
    )


def test_without_the_setting_every_turn_goes_through_p(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d])
    post_chat(proxy, chat(USER_1))
    post_chat(proxy, chat(USER_1, ANSWER_1, USER_2))
    assert len(p.bodies()) == 2
    assert len(proxy.proxy.turns) == 0
