"""How a request reaches a server of a pool: the candidates in turn (the pinned one first, then
the pool's picks), each tried once, failing over on transport errors; an error status from the
first that answers ends the request (`UpstreamErrorResponse`), none left ends it with
`NoUpstream`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import Histogram

from .balancer import UpstreamPool
from .errors import (
    NoUpstream,
    ProxyError,
    ResponseTooLarge,
    UpstreamErrorResponse,
    UpstreamTransportError,
)
from .upstream import Upstream
from .upstream_http import UpstreamClient, UpstreamResponse


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a request's D (or P) is chosen: `pinned` (the D a remembered conversation entry
    names) if it answers, else rendezvous hashing on `route_key` over the live servers (with
    `slack`: while the one it picks has at most `slack` requests in flight more than the least
    busy; `UpstreamPool.pick`)."""

    pinned: Upstream | None
    route_key: bytes
    slack: int | None = None


def candidates(pool: UpstreamPool, choice: Choice | None = None) -> Iterator[Upstream]:
    """The upstreams to try in turn, each once: the remembered one first, then the pool's picks
    (by the routing key when there is one); ends when none is left."""
    pinned = choice.pinned if choice is not None else None
    key = choice.route_key if choice is not None else None
    tried: set[str] = set()
    while True:
        if pinned is not None and pinned.address not in tried:
            upstream: Upstream | None = pinned
        else:
            upstream = pool.pick(frozenset(tried), key, choice.slack if choice is not None else None)
        if upstream is None:
            return
        tried.add(upstream.address)
        yield upstream


@dataclasses.dataclass
class OpenStream:
    """A 200 answer whose body is still to be read: its upstream, the response, the upstream's
    outstanding count (held until `outstanding` closes) and when the request was sent."""

    upstream: Upstream
    response: UpstreamResponse
    outstanding: contextlib.ExitStack
    started: float


class Dispatcher:
    """Sends requests over the proxy's one client; answers are read up to `max_response_bytes`."""

    def __init__(self, client: UpstreamClient, max_response_bytes: int):
        self._client = client
        self._max_response_bytes = max_response_bytes

    async def post_buffered(
        self,
        pool: UpstreamPool,
        route: str,
        body: dict[str, Any],
        headers: dict[str, str],
        latency: Histogram,
        choice: Choice | None = None,
    ) -> tuple[Upstream, bytes]:
        """POST to the first upstream that answers, failing over on transport errors; returns
        that upstream and its size-limited 200 body. `latency` observes the time to answer.

        A decode leg is retried on another D even when the request may have reached the first
        one: P grants its prompt's blocks only against the reader's own tokens and only while
        its hold lasts (the first D's read ends it), so the second D reads the same intact
        blocks or is refused and computes the prompt; it never reads reused blocks."""
        for upstream in candidates(pool, choice):
            started = time.perf_counter()
            with pool.track(upstream):
                try:
                    status, raw = await self._client.fetch(
                        "POST",
                        upstream.base_url + route,
                        json=body,
                        headers=headers,
                        limit=self._max_response_bytes,
                    )
                except UpstreamTransportError as exc:
                    pool.mark_failed(upstream, str(exc))
                    continue
                except ResponseTooLarge as exc:
                    raise ProxyError(
                        502,
                        f"{pool.role} server {upstream.address}: {exc}",
                        error_type="upstream_error",
                        kind="upstream_status",
                    ) from None
            pool.mark_ok(upstream)
            latency.observe(time.perf_counter() - started)
            if status != 200:
                raise UpstreamErrorResponse(status, raw, upstream)
            return upstream, raw
        raise NoUpstream(pool.role)

    async def open_stream(
        self,
        pool: UpstreamPool,
        route: str,
        body: dict[str, Any],
        headers: dict[str, str],
        choice: Choice,
    ) -> OpenStream:
        """POST to the first upstream that answers, failing over on transport errors; its 200
        answer with the body unread (the caller owns it and the outstanding count)."""
        for upstream in candidates(pool, choice):
            with contextlib.ExitStack() as outstanding:
                outstanding.enter_context(pool.track(upstream))
                started = time.perf_counter()
                try:
                    response = await self._client.open(
                        "POST", upstream.base_url + route, json=body, headers=headers
                    )
                except UpstreamTransportError as exc:
                    pool.mark_failed(upstream, str(exc))
                    continue
                pool.mark_ok(upstream)
                if response.status != 200:
                    try:
                        raw = await response.read_limited(self._max_response_bytes)
                    except (UpstreamTransportError, ResponseTooLarge):
                        raw = b""
                    raise UpstreamErrorResponse(response.status, raw, upstream)
                return OpenStream(upstream, response, outstanding.pop_all(), started)
        raise NoUpstream(pool.role)
