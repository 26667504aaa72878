"""Dead and sick upstreams: taken out, failed over, retried with backoff; a conversation whose D is
gone recomputes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from conftest import STREAM_GATE_TIMEOUT_S, FakeClock
from kvduplex.protocol import prefill_request_params
from kvduplex.proxy.balancer import UpstreamPool
from kvduplex.proxy.config import parse_upstream
from kvduplex.proxy.metrics import ProxyMetrics
from test_proxy_flow import post, sse_events


def healthy(proxy, role: str, engine) -> float:
    return proxy.metric(
        "kvduplex_proxy_upstream_healthy", role=role, upstream=f"127.0.0.1:{engine.port}"
    )


def test_pool_picks_least_outstanding_and_backs_off_exponentially():
    clock = FakeClock()
    targets = tuple(parse_upstream(f"127.0.0.1:{port}") for port in (1001, 1002, 1003))
    pool = UpstreamPool(
        "decode", targets, ProxyMetrics(), backoff_initial_s=1, backoff_max_s=3, clock=clock
    )
    a, b, c = pool.upstreams

    with pool.track(a), pool.track(b), pool.track(b):
        assert pool.pick() is c
        with pool.track(c), pool.track(c), pool.track(c):
            assert pool.pick() is a
    assert {pool.pick().address for _ in range(3)} == {a.address, b.address, c.address}

    for expected_backoff in (1, 2, 3, 3):
        pool.mark_failed(a, "test")
        assert a.retry_at == clock.now + expected_backoff
    pool.mark_failed(b, "test")
    pool.mark_failed(c, "test")
    assert pool.pick() is None and not pool.any_healthy()
    clock.advance(1)
    # Backoff over: b and c get a trial; a (longer backoff) does not yet.
    assert {pool.pick().address for _ in range(4)} == {b.address, c.address}
    pool.mark_ok(b)
    assert pool.pick() is b and pool.pick(frozenset({b.address})) is c
    assert [u.address for u in pool.due_for_probe()] == [b.address, c.address]


def test_dead_prefill_is_taken_out_and_retried_after_backoff(cluster, clock):
    p0, p1, d = cluster.engine("p0"), cluster.engine("p1"), cluster.engine("d")
    proxy = cluster.proxy([p0, p1], [d], clock=clock, backoff_initial_s=10)

    # A conversation whose own P is p0 (prefill affinity): p0 is tried first, found dead.
    prompt = proxy.prompt_routed_to(p0, role="prefill")
    cluster.stop_engine(p0)
    for _ in range(4):
        response = post(proxy, prompt=prompt)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvduplex-prefill"] == f"127.0.0.1:{p1.port}"
    assert healthy(proxy, "prefill", p0) == 0
    assert (
        proxy.metric(
            "kvduplex_proxy_upstream_failures_total",
            role="prefill",
            upstream=f"127.0.0.1:{p0.port}",
        )
        == 1
    )

    cluster.restart_engine(p0)
    # Still in backoff: no probe, no traffic.
    proxy.check_health()
    assert healthy(proxy, "prefill", p0) == 0
    clock.advance(10)
    proxy.check_health()
    assert healthy(proxy, "prefill", p0) == 1
    # Back in rotation: it prefills its own conversations again.
    assert post(proxy, prompt=prompt).headers["x-kvduplex-prefill"] == f"127.0.0.1:{p0.port}"


def test_no_live_prefill_gives_503(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], backoff_initial_s=30)
    cluster.stop_engine(p)

    for _ in range(2):
        response = post(proxy)
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "no prefill server available"
    assert proxy.client.get("/health").status_code == 503
    assert d.requests == []


def test_dead_decode_fails_over_before_the_response_starts(cluster):
    p, d0, d1 = cluster.engine("p"), cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1], backoff_initial_s=30)
    prompt = proxy.prompt_routed_to(d0)
    cluster.stop_engine(d0)

    for stream in (False, True, False, True):
        response = post(proxy, stream=stream, prompt=prompt)
        assert response.status_code == 200
        assert response.headers["x-kvduplex-decode"] == d1.address
    assert sse_events(response.content)[-1]["choices"][0]["finish_reason"] == "length"
    assert healthy(proxy, "decode", d0) == 0


def test_conversation_whose_decode_server_is_gone_recomputes(cluster):
    p, d0, d1 = cluster.engine("p"), cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1], backoff_initial_s=30)
    prompt = proxy.prompt_routed_to(d0)
    assert post(proxy, conversation="c", prompt=prompt).headers["x-kvduplex-decode"] == d0.address

    cluster.stop_engine(d0)
    proxy.check_health()
    assert healthy(proxy, "decode", d0) == 0
    response = post(proxy, conversation="c", prompt=prompt)
    assert response.status_code == 200
    assert response.headers["x-kvduplex-conversation"] == "decode_unavailable"
    assert response.headers["x-kvduplex-decode"] == d1.address
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    # The recomputed turn lives on d1 now: the next turn pulls from there.
    post(proxy, conversation="c", prompt=prompt)
    assert p.bodies()[-1]["kv_transfer_params"] == d1.returned_params[-2]


def test_decode_dying_unnoticed_fails_over_and_the_conversation_moves(cluster):
    p, d0, d1 = cluster.engine("p"), cluster.engine("d0"), cluster.engine("d1")
    proxy = cluster.proxy([p], [d0, d1], backoff_initial_s=30)
    prompt = proxy.prompt_routed_to(d0)
    assert post(proxy, conversation="c", prompt=prompt).headers["x-kvduplex-decode"] == d0.address

    cluster.stop_engine(d0)
    response = post(proxy, conversation="c", prompt=prompt)
    # The proxy still believed d0 alive: P was told to pull from it (the connector falls back to
    # recomputing when the pull fails), and decoding moved to d1.
    assert response.status_code == 200
    assert response.headers["x-kvduplex-conversation"] == "hit"
    assert response.headers["x-kvduplex-decode"] == d1.address
    assert p.bodies()[-1]["kv_transfer_params"] == d0.returned_params[0]
    post(proxy, conversation="c", prompt=prompt)
    assert p.bodies()[-1]["kv_transfer_params"] == d1.returned_params[0]


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], backoff_initial_s=30)
    d.abort_stream_after = 1

    response = post(proxy, conversation="c", stream=True)
    assert response.status_code == 200
    events = sse_events(response.content)
    assert events[0]["choices"][0]["text"] == "d"
    assert "failed mid-stream" in events[-1]["error"]["message"]
    assert healthy(proxy, "decode", d) == 0
    assert proxy.metric("kvduplex_proxy_errors_total", kind="stream_aborted") == 1
    assert proxy.metric("kvduplex_proxy_conversations_stored_total") == 0
    assert (
        proxy.metric(
            "kvduplex_proxy_upstream_outstanding", role="decode", upstream=f"127.0.0.1:{d.port}"
        )
        == 0
    )


def test_periodic_probes_take_out_and_bring_back_a_sick_server(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], health_interval_s=0.02, backoff_initial_s=0.05)

    def wait_for_health_status(status: int) -> None:
        deadline = time.monotonic() + 20
        while proxy.client.get("/health").status_code != status:
            assert time.monotonic() < deadline, f"proxy /health never answered {status}"
            time.sleep(0.01)

    d.healthy = False
    wait_for_health_status(503)
    d.healthy = True
    wait_for_health_status(200)
    assert post(proxy).status_code == 200


class OneRequestPerConnection:
    """An HTTP upstream that answers the first request on each connection (keeping it open) and
    closes a connection as soon as a second request arrives on it: what a client sees when it
    reuses a connection that the server's keep-alive timeout is closing just then (uvicorn's
    "Server disconnected without sending a response"), made deterministic."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.answered = 0
        self.cut = 0
        """Requests that came on a connection already used, closed unanswered."""
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # `close` may close it under a recv
            for request in range(2):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                if request == 1:
                    self.cut += 1
                    return
                # Counted before the answer goes out: the test reads the count once it has it.
                self.answered += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

    def close(self) -> None:
        self._listener.close()
        for conn in self._connections:
            conn.close()


@pytest.mark.parametrize("keepalive_expiry_s, reused", [(0.2, False), (30.0, True)])
def test_an_idle_upstream_connection_is_dropped_before_the_upstream_can_close_it_under_a_request(
    cluster, keepalive_expiry_s, reused
):
    upstream = OneRequestPerConnection()
    try:
        # A generous probe timeout: on a loaded host a probe must fail only by the race.
        proxy = cluster.proxy(
            [upstream],
            [cluster.engine("d")],
            keepalive_expiry_s=keepalive_expiry_s,
            health_timeout_s=10.0,
        )
        proxy.check_health()
        time.sleep(0.4)
        proxy.check_health()
        # Dropped after 0.2 s idle, the second probe opens a new connection and is answered;
        # kept for 30 s, it reuses the first connection, which is closed under it as in the real
        # race (a probe is a GET, which the client sends again on a new connection; a
        # completion's POST would fail and take the upstream out of rotation).
        assert upstream.cut == (1 if reused else 0)
        assert upstream.answered == 2
        assert healthy(proxy, "prefill", upstream) == 1
    finally:
        upstream.close()


@contextlib.contextmanager
def a_prefill_holding_the_only_slot(proxy, p) -> Iterator[list[int]]:
    """A request in flight whose prefill P holds (its answer gate) on the proxy's only
    connection slot; yields the list its status joins once P lets it go (at the block's end)."""
    p.answer_gate = threading.Event()
    answers: list[int] = []
    first = threading.Thread(target=lambda: answers.append(post(proxy).status_code))
    first.start()
    try:
        deadline = time.monotonic() + 10
        while not p.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.requests, "the first request did not reach P"
        yield answers
        assert first.is_alive(), "P let the prefill go before the block's end"
    finally:
        p.answer_gate.set()
        first.join(timeout=30)


def test_a_request_that_finds_every_upstream_connection_busy_gets_503_and_the_slot_comes_back(
    cluster,
):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], max_upstream_connections=1, pool_timeout_s=0.3)
    with a_prefill_holding_the_only_slot(proxy, p) as answers:
        # The next request waits 0.3 s for a slot.
        busy = post(proxy)
        assert busy.status_code == 503
        assert "too many requests in flight" in busy.json()["error"]["message"]
        assert len(p.requests) == 1 and healthy(proxy, "prefill", p) == 1
    assert answers == [200]
    # Both of the first request's legs gave their slot back.
    assert post(proxy).status_code == 200


def test_a_health_probe_waits_for_a_connection_slot_no_longer_than_its_timeout(cluster):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy(
        [p], [d], max_upstream_connections=1, pool_timeout_s=30.0, health_timeout_s=0.3
    )
    with a_prefill_holding_the_only_slot(proxy, p):
        started = time.monotonic()
        proxy.check_health()  # every probe finds the only slot taken
        # The probes gave up after their 0.3 s; waiting for the slot as a request would (30 s),
        # they would have returned only when P let the prefill go (after 5 s).
        assert time.monotonic() - started < STREAM_GATE_TIMEOUT_S / 2
        # A busy proxy is not a failed upstream: both stay in rotation.
        assert healthy(proxy, "prefill", p) == 1 and healthy(proxy, "decode", d) == 1
