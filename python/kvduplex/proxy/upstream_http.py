"""The proxy's one HTTP client to its upstreams (aiohttp).

Every request to a P or D server holds one of `max_upstream_connections` slots from the moment
it is sent until its response is read or released; a request that finds none free within
`pool_timeout_s` fails with `PoolExhausted` (503). An idle connection is closed after
`keepalive_expiry_s` (`ProxyConfig`). Whatever keeps an upstream from answering, or breaks its
answer off (refused or failed connect, reset, disconnect, `read_timeout_s` of silence), is an
`UpstreamTransportError`; an answer with an error status is a response like any other.

aiohttp rather than httpx: on an idle P/D pair on 2 cores a later chat turn's first token came
2.8 and 6.1 ms sooner through the proxy with aiohttp in two runs (p50), as soon as straight
from P (a probe recorded in `benches/results/HISTORY.md`; under load the difference was within
the runs' spread).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from .errors import PoolExhausted, ResponseTooLarge, UpstreamTransportError, describe

# aiohttp's own failures, and the OS's and the timeouts' beneath it.
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class UpstreamResponse:
    """An upstream's answer, its body not read yet. Holds its connection slot until `aclose`
    (or until `read_limited` has read it)."""

    def __init__(self, response: aiohttp.ClientResponse, release_slot: Callable[[], None]):
        self._response = response
        self._release_slot: Callable[[], None] | None = release_slot

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise UpstreamTransportError(describe(exc)) from exc

    async def read_limited(self, limit: int) -> bytes:
        """The whole body (at most `limit` bytes, else `ResponseTooLarge`), then `aclose`."""
        chunks, size = [], 0
        try:
            async for chunk in self.iter_bytes():
                size += len(chunk)
                if size > limit:
                    raise ResponseTooLarge(f"response exceeds {limit} bytes")
                chunks.append(chunk)
        finally:
            await self.aclose()
        return b"".join(chunks)

    async def aclose(self) -> None:
        """Gives the connection back (closed if its body was not read whole) and the slot.
        Safe to call twice."""
        release, self._release_slot = self._release_slot, None
        if release is not None:
            try:
                self._response.release()
            finally:
                release()


class UpstreamClient:
    """The connection pool to every upstream; `aclose` at the proxy's shutdown."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        pool_timeout_s: float,
        keepalive_expiry_s: float,
    ):
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout_s = pool_timeout_s
        self._keepalive_expiry_s = keepalive_expiry_s
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        # Made in the event loop that serves the proxy, at its first request.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                # Slots bound the connections (`_slots`); upstreams are addressed directly, so
                # HTTP(S)_PROXY variables must not reroute them (aiohttp's default).
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_expiry_s),
                timeout=self._timeout,
                trust_env=False,
            )
        return self._session

    async def open(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Sends the request and returns once the response's head arrived; `timeout_s` bounds
        the wait for a slot and the whole exchange (health probes). Raises `PoolExhausted` or
        `UpstreamTransportError`."""
        if self._slots.locked():
            slot_wait_s = self._pool_timeout_s
            if timeout_s is not None:
                slot_wait_s = min(slot_wait_s, timeout_s)
            try:
                await asyncio.wait_for(self._slots.acquire(), slot_wait_s)
            except asyncio.TimeoutError:
                raise PoolExhausted() from None
        else:
            await self._slots.acquire()
        try:
            response = await self._open_session().request(
                method,
                url,
                json=json,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s) if timeout_s else self._timeout,
            )
        except BaseException as exc:
            self._slots.release()
            if isinstance(exc, _TRANSPORT_ERRORS):
                raise UpstreamTransportError(describe(exc)) from exc
            raise
        return UpstreamResponse(response, self._slots.release)

    async def fetch(
        self, method: str, url: str, *, limit: int, **request: Any
    ) -> tuple[int, bytes]:
        """`open`, then the whole body (at most `limit` bytes, else `ResponseTooLarge`): the
        answer's status and body."""
        response = await self.open(method, url, **request)
        return response.status, await response.read_limited(limit)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
