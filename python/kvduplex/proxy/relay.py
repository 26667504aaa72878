"""D's SSE stream on its way to the caller: lines passed through as they come, D's params lifted
out (and handed on once the stream completed, to be remembered for the conversation's next turn:
before the caller has its `[DONE]`, at which a chat SDK ends the stream and may send the next
turn), events rewritten where the stream continues a first token sent before (`first_token`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from .balancer import UpstreamPool
from .dispatch import OpenStream
from .errors import UpstreamTransportError, openai_error
from .metrics import ProxyMetrics
from .routes import PARAMS_FIELD
from .upstream import Upstream
from .upstream_http import UpstreamResponse

_PARAMS_FIELD_JSON = json.dumps(PARAMS_FIELD).encode()
# Longest SSE line the stream relay parses for kv_transfer_params; longer lines pass unparsed.
_MAX_SCANNED_LINE_BYTES = 4 << 20


def sse_event(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_error(error: dict[str, Any]) -> bytes:
    """An OpenAI-shaped `error` event that ends a stream already under way (its HTTP status
    was sent)."""
    return b"\n\ndata: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


class SseParamsScanner:
    """Passes an SSE byte stream through line by line, lifting `kv_transfer_params` out of the
    data events that carry one (the last non-null one is kept in `params`). With `rewrite`,
    every JSON data event goes through it as well (None drops the event)."""

    def __init__(
        self,
        max_line_bytes: int = _MAX_SCANNED_LINE_BYTES,
        rewrite: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ):
        self.params: dict[str, Any] | None = None
        self.done = False
        """The stream's `data: [DONE]` has passed: a chat client's SDK ends its stream there."""
        self._rewrite = rewrite
        self._max_line_bytes = max_line_bytes
        self._partial = b""
        self._skipping_long_line = False

    def feed(self, chunk: bytes) -> bytes:
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = [self._line(line + b"\n") for line in lines]
        if len(self._partial) > self._max_line_bytes:
            out.append(self._partial)
            self._partial = b""
            self._skipping_long_line = True
        return b"".join(out)

    def finish(self) -> bytes:
        rest, self._partial = self._partial, b""
        return self._line(rest) if rest else b""

    def discard_partial(self) -> None:
        self._partial = b""

    def _line(self, line: bytes) -> bytes:
        if self._skipping_long_line:
            self._skipping_long_line = False
            return line
        if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
            self.done = True
            return line
        if not line.startswith(b"data:") or (
            self._rewrite is None and _PARAMS_FIELD_JSON not in line
        ):
            return line
        body = line[5:].strip()
        try:
            event = json.loads(body)
        except ValueError:
            return line
        if not isinstance(event, dict):
            return line
        # Chat and completions chunks carry the params at the top; a /v1/responses stream in
        # the `response` of its final event (response.completed).
        holder = event if PARAMS_FIELD in event else event.get("response")
        if isinstance(holder, dict) and PARAMS_FIELD in holder:
            params = holder.pop(PARAMS_FIELD)
            if isinstance(params, dict):
                self.params = params
        elif self._rewrite is None:
            return line
        if self._rewrite is not None:
            rewritten = self._rewrite(event)
            if rewritten is None:
                return b""
            event = rewritten
        ending = b"\r\n" if line.endswith(b"\r\n") else b"\n"
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + ending


class StreamRelay:
    """Relays D's SSE stream to the caller and, once it completed, hands D's params to
    `answered`. Owns the upstream response and the outstanding-request count until `close`;
    a transport failure takes D out of `pool`."""

    def __init__(
        self,
        opened: OpenStream,
        pool: UpstreamPool,
        metrics: ProxyMetrics,
        answered: Callable[[dict[str, Any] | None], Awaitable[None]],
        rewrite: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ):
        """`answered` runs once, when D answered the turn whole (before the caller sees the
        stream end, so that its next turn always finds what it records)."""
        self._response = opened.response
        self._upstream = opened.upstream
        self._outstanding = opened.outstanding
        self._started = opened.started
        self._pool = pool
        self._metrics = metrics
        self._answered = answered
        self._rewrite = rewrite
        self._closed = False

    @property
    def upstream(self) -> Upstream:
        return self._upstream

    @property
    def response(self) -> UpstreamResponse:
        return self._response

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await self._response.aclose()
            finally:
                self._outstanding.close()

    async def stream(self) -> AsyncIterator[bytes]:
        upstream = self._upstream
        scanner = SseParamsScanner(rewrite=self._rewrite)
        recorded = False
        try:
            first = True
            async for chunk in self._response.iter_bytes():
                if first:
                    first = False
                    self._metrics.decode_first_byte_seconds.observe(
                        time.perf_counter() - self._started
                    )
                out = scanner.feed(chunk)
                if scanner.done and not recorded:
                    # Before the caller has `[DONE]`: its SDK ends the stream there, and may
                    # send the next turn before D's response ends.
                    recorded = True
                    await self._answered(scanner.params)
                if out:
                    yield out
            tail = scanner.finish()
            if not recorded:
                recorded = True
                await self._answered(scanner.params)
            if tail:
                yield tail
        except UpstreamTransportError as exc:
            self._pool.mark_failed(upstream, str(exc))
            self._metrics.errors.labels("stream_aborted").inc()
            scanner.discard_partial()
            yield sse_error(
                openai_error(
                    502,
                    f"decode server {upstream.address} failed mid-stream: {exc}",
                    "upstream_error",
                )
            )
        finally:
            await self.close()


class RelayResponse(StreamingResponse):
    """A streaming response that releases its relay even when the body is never iterated (the
    caller disconnected before the first chunk)."""

    def __init__(self, relay: StreamRelay, **kwargs: Any):
        super().__init__(relay.stream(), **kwargs)
        self._relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._relay.close()
