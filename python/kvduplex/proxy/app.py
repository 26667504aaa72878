"""The OpenAI-compatible P/D proxy (completions, chat, responses): prefill on P, decode on D.

D is chosen per conversation: by rendezvous hashing on a key derived from the caller, the model
and the conversation's first messages (`routing`), so every turn of a conversation, streamed or
not, with or without a conversation id, reaches the same D on every proxy replica. A request
that names a conversation id also remembers D's returned `kv_transfer_params`; its next turn
goes to that D first and hands P the params, so P pulls the history's KV back from D."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import first_token
from .balancer import UpstreamPool, probe_all, run_health_checks
from .config import ProxyConfig
from .conversations import Conversations
from .dispatch import Choice, Dispatcher, candidates
from .errors import (
    NoUpstream,
    ProxyError,
    ResponseTooLarge,
    UpstreamErrorResponse,
    UpstreamTransportError,
    bad_request,
    describe,
    error_body,
    error_kind,
    openai_error,
)
from .intake import caller_of, check_stateless_response, conversation_id, digest, read_json
from .metrics import ProxyMetrics
from .relay import RelayResponse, StreamRelay, sse_error, sse_event
from .routes import PARAMS_FIELD, RESPONSES_ROUTE, prefill_body
from .routing import conversation_key
from .store import ConversationKey, ConversationStore, create_store
from .upstream import Upstream
from .upstream_http import UpstreamClient

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _DecodeLeg:
    """Where a request's decode leg goes: its route and forwarded headers, how its D is chosen,
    its conversation entry's key and the routing headers' values."""

    route: str
    headers: dict[str, str]
    choice: Choice
    key: ConversationKey | None
    routing: dict[str, str]


class DuplexProxy:
    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        store: ConversationStore,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.metrics = metrics
        backoff = {
            "backoff_initial_s": config.backoff_initial_s,
            "backoff_max_s": config.backoff_max_s,
            "clock": clock,
        }
        self.prefill = UpstreamPool("prefill", config.prefill, metrics, **backoff)
        self.decode = UpstreamPool("decode", config.decode, metrics, **backoff)
        self.client = UpstreamClient(
            max_connections=config.max_upstream_connections,
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.read_timeout_s,
            pool_timeout_s=config.pool_timeout_s,
            keepalive_expiry_s=config.keepalive_expiry_s,
        )
        self.dispatch = Dispatcher(self.client, config.max_upstream_response_bytes)
        self.conversations = Conversations(store, self.decode, metrics)
        self._warned_no_prefill_params: set[str] = set()

    @property
    def pools(self) -> list[UpstreamPool]:
        return [self.prefill, self.decode]

    async def check_health(self) -> None:
        """Probe every upstream that is in rotation or due for a retry, once."""
        await probe_all(self.pools, self.client, self.config.health_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---- the P/D flow ----------------------------------------------------------------------

    async def generate(self, request: Request, route: str) -> Response:
        body = await read_json(request, self.config.max_body_bytes)
        if PARAMS_FIELD in body:
            raise bad_request("'kv_transfer_params' is set by the proxy, not by callers")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean")
        if route == RESPONSES_ROUTE:
            check_stateless_response(body)
        conversation = conversation_id(request, body, self.config.max_conversation_id_length)
        caller = caller_of(request, self.config.tenant_header)
        key = (
            ConversationKey(caller, digest("conversation", conversation))
            if conversation is not None
            else None
        )
        route_key = conversation_key(caller, body)
        lookup, pinned, pull_params = await self.conversations.recall(key)
        forward_headers = {}
        if "authorization" in request.headers:
            forward_headers["authorization"] = request.headers["authorization"]

        first_reason = (
            first_token.ineligible_reason(route, body)
            if self.config.first_token_from_prefill
            else "disabled"
        )
        to_prefill = prefill_body(route, body, pull_params)
        if first_reason is None:
            to_prefill.update(first_token.prefill_fields(body))
        prefill_upstream, answer, decode_params = await self._prefill(
            route, to_prefill, forward_headers, route_key
        )
        first = None
        if first_reason is None:
            first, first_reason = first_token.first_token(route, answer, decode_params)
        if stream:
            self.metrics.first_tokens.labels(
                "prefill" if first else "decode", first_reason or ""
            ).inc()
        if first is not None:
            assert decode_params is not None
            decode_body = first_token.decode_body(body, first, decode_params, PARAMS_FIELD)
        else:
            decode_body = dict(body)
            if decode_params is not None:
                decode_body[PARAMS_FIELD] = decode_params
        leg = _DecodeLeg(
            route,
            forward_headers,
            Choice(pinned, route_key),
            key,
            {"prefill": prefill_upstream.address, "conversation": lookup},
        )
        if first is not None:
            return self._continue_stream(leg, first, body, decode_body)
        if stream:
            return await self._decode_stream(leg, decode_body)
        return await self._decode_json(leg, decode_body)

    async def _prefill(
        self, route: str, body: dict[str, Any], headers: dict[str, str], route_key: bytes
    ) -> tuple[Upstream, dict[str, Any], dict[str, Any] | None]:
        """P's answer: (P, its parsed response, its `kv_transfer_params` if it offered any).
        P is the conversation's (by `route_key`) unless it is busier than the least busy by
        more than `prefill_affinity_slack` (None: the least busy)."""
        slack = self.config.prefill_affinity_slack
        choice = None if slack is None else Choice(None, route_key, slack=slack)
        upstream, raw = await self.dispatch.post_buffered(
            self.prefill, route, body, headers, self.metrics.prefill_seconds, choice
        )
        hashed = choice is not None and upstream is self.prefill.pick(key=route_key)
        self.metrics.prefill_routes.labels("hash" if hashed else "least_busy").inc()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ProxyError(
                502,
                f"prefill server {upstream.address} answered with malformed JSON",
                error_type="upstream_error",
                kind="upstream_status",
            ) from None
        params = answer.get(PARAMS_FIELD)
        if not isinstance(params, dict):
            if upstream.address not in self._warned_no_prefill_params:
                self._warned_no_prefill_params.add(upstream.address)
                logger.warning(
                    "prefill server %s returned no kv_transfer_params (is it running with a "
                    "KV connector?); decode servers will recompute the prompt",
                    upstream.address,
                )
            params = None
        return upstream, answer, params

    def _accepted(self, leg: _DecodeLeg, decode: Upstream) -> None:
        """`decode` took the request: count what chose it."""
        rule = "remembered" if decode is leg.choice.pinned else "hash"
        self.metrics.decode_routes.labels(rule).inc()

    def _routing_headers(self, routing: dict[str, str], decode: Upstream) -> dict[str, str]:
        if not self.config.routing_headers:
            return {}
        return {
            "x-kvduplex-prefill": routing["prefill"],
            "x-kvduplex-decode": decode.address,
            "x-kvduplex-conversation": routing["conversation"],
        }

    async def _decode_json(self, leg: _DecodeLeg, body: dict[str, Any]) -> Response:
        upstream, raw = await self.dispatch.post_buffered(
            self.decode,
            leg.route,
            body,
            leg.headers,
            self.metrics.decode_first_byte_seconds,
            leg.choice,
        )
        self._accepted(leg, upstream)
        try:
            result = json.loads(raw)
        except ValueError:
            raise ProxyError(
                502,
                f"decode server {upstream.address} answered with malformed JSON",
                error_type="upstream_error",
                kind="upstream_status",
            ) from None
        if isinstance(result, dict) and PARAMS_FIELD in result:
            offered = result.pop(PARAMS_FIELD)
            await self.conversations.remember(leg.key, upstream, offered)
            # D's block ids and address stay inside the deployment.
            raw = json.dumps(result, ensure_ascii=False).encode()
        return Response(
            raw,
            media_type="application/json",
            headers=self._routing_headers(leg.routing, upstream),
        )

    async def _open_decode_stream(
        self,
        leg: _DecodeLeg,
        body: dict[str, Any],
        *,
        rewrite: first_token.ContinuationRewriter | None = None,
    ) -> StreamRelay:
        """D's streamed answer (status 200) from the first D that takes the request, as the relay
        that owns the response and its outstanding count (`rewrite`: its own)."""
        opened = await self.dispatch.open_stream(
            self.decode, leg.route, body, leg.headers, leg.choice
        )
        self._accepted(leg, opened.upstream)
        return StreamRelay(
            opened,
            self.decode,
            self.metrics,
            functools.partial(self._answered, leg, opened.upstream),
            rewrite=rewrite,
        )

    async def _answered(self, leg: _DecodeLeg, decode: Upstream, params: Any) -> None:
        """`decode` streamed the turn whole: with `params`, it holds the blocks for the next
        turn's readback."""
        await self.conversations.remember(leg.key, decode, params)

    async def _decode_stream(self, leg: _DecodeLeg, body: dict[str, Any]) -> Response:
        relay = await self._open_decode_stream(leg, body)
        return RelayResponse(
            relay,
            media_type=relay.response.headers.get("content-type", "text/event-stream"),
            headers=self._routing_headers(leg.routing, relay.upstream),
        )

    def _continue_stream(
        self,
        leg: _DecodeLeg,
        first: first_token.FirstToken,
        body: dict[str, Any],
        decode_body: dict[str, Any],
    ) -> Response:
        """The caller's stream starts with P's first token at once; D's continuation follows.
        D is reached after the response started, so its failures end the stream with an error
        event; the routing headers name the D chosen first."""

        async def events() -> AsyncIterator[bytes]:
            yield sse_event(first_token.first_chunk(first, body))
            try:
                relay = await self._open_decode_stream(
                    leg, decode_body, rewrite=first_token.ContinuationRewriter(first)
                )
            except (ProxyError, UpstreamErrorResponse) as exc:
                yield sse_error(self.error_body(exc)[1])
                return
            try:
                async for chunk in relay.stream():
                    yield chunk
            finally:
                await relay.close()

        first_pick = (
            next(iter(candidates(self.decode, leg.choice)), None)
            if self.config.routing_headers
            else None
        )
        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers=self._routing_headers(leg.routing, first_pick) if first_pick else {},
        )

    # ---- other routes ----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        headers = {}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        for pool in (self.decode, self.prefill):
            for upstream in candidates(pool):
                try:
                    status, raw = await self.client.fetch(
                        "GET",
                        upstream.base_url + "/v1/models",
                        headers=headers,
                        limit=self.config.max_upstream_response_bytes,
                    )
                except UpstreamTransportError as exc:
                    pool.mark_failed(upstream, str(exc))
                    continue
                except ResponseTooLarge as exc:
                    pool.mark_failed(upstream, describe(exc))
                    continue
                pool.mark_ok(upstream)
                if status != 200:
                    raise UpstreamErrorResponse(status, raw, upstream)
                return Response(raw, media_type="application/json")
        raise NoUpstream("upstream")

    def health(self) -> Response:
        ready = self.prefill.any_healthy() and self.decode.any_healthy()
        body = {
            "status": "ok" if ready else "unavailable",
            **{
                pool.role: [
                    {"address": u.address, "healthy": u.healthy, "outstanding": u.outstanding}
                    for u in pool.upstreams
                ]
                for pool in self.pools
            },
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    def error_response(self, exc: ProxyError | UpstreamErrorResponse) -> JSONResponse:
        status, body = self.error_body(exc)
        return JSONResponse(body, status_code=status)

    def error_body(self, exc: ProxyError | UpstreamErrorResponse) -> tuple[int, dict[str, Any]]:
        """The error's HTTP status and OpenAI-shaped body, counted in the error metrics."""
        self.metrics.errors.labels(error_kind(exc)).inc()
        return error_body(exc)

def create_app(
    config: ProxyConfig,
    *,
    store: ConversationStore | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The proxy as an ASGI app. `store` overrides the one `config.store` names (the caller then
    owns it); `clock` drives upstream backoff."""
    metrics = ProxyMetrics()
    owns_store = store is None
    if store is None:
        store = create_store(
            config.store,
            ttl_s=config.conversation_ttl_s,
            max_entries=config.max_conversations,
            max_entry_bytes=config.max_entry_bytes,
            max_total_bytes=config.max_store_bytes,
        )
    proxy = DuplexProxy(config, metrics, store, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        checks = None
        if config.health_interval_s > 0:
            checks = asyncio.create_task(
                run_health_checks(
                    proxy.pools, proxy.client, config.health_interval_s, config.health_timeout_s
                )
            )
        try:
            yield
        finally:
            if checks is not None:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks
            await proxy.aclose()
            if owns_store:
                await store.close()

    app = FastAPI(
        title="kvduplex proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.proxy = proxy

    def counted(route: str, response: Response) -> Response:
        metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    async def run(route: str, handler: Callable[[], Any]) -> Response:
        try:
            response = await handler()
        except (ProxyError, UpstreamErrorResponse) as exc:
            response = proxy.error_response(exc)
        return counted(route, response)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run("/v1/completions", lambda: proxy.generate(request, "/v1/completions"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(
            "/v1/chat/completions", lambda: proxy.generate(request, "/v1/chat/completions")
        )

    @app.post(RESPONSES_ROUTE)
    async def responses(request: Request) -> Response:
        return await run(RESPONSES_ROUTE, lambda: proxy.generate(request, RESPONSES_ROUTE))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await run("/v1/models", lambda: proxy.models(request))

    @app.get("/health")
    async def health() -> Response:
        return counted("/health", proxy.health())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"unknown route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        metrics.errors.labels("bad_request").inc()
        return counted(
            "unknown" if exc.status_code == 404 else request.url.path,
            JSONResponse(
                openai_error(exc.status_code, message, "invalid_request_error"),
                status_code=exc.status_code,
                headers=getattr(exc, "headers", None),
            ),
        )

    return app
