"""How a proxied request fails: the errors that end it with an OpenAI-shaped response."""

from __future__ import annotations

import json
from typing import Any

from .upstream import Upstream


class ProxyError(Exception):
    """Ends a request with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, *, error_type: str, kind: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.kind = kind


class NoUpstream(ProxyError):
    """No server of a role took the request: none in rotation, or every one tried failed."""

    def __init__(self, role: str):
        super().__init__(
            503, f"no {role} server available", error_type="service_unavailable", kind="no_upstream"
        )


class PoolExhausted(ProxyError):
    """The proxy's own connections to its upstreams are all in use (`pool_timeout_s`)."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "too many requests in flight to the upstream servers",
            error_type="service_unavailable",
            kind="no_upstream",
        )


class UpstreamErrorResponse(Exception):
    """An upstream answered with an error status; relayed to the caller in OpenAI's shape."""

    def __init__(self, status: int, body: bytes, upstream: Upstream):
        super().__init__(f"{upstream.role} {upstream.address} answered HTTP {status}")
        self.status = status
        self.body = body
        self.upstream = upstream


class ResponseTooLarge(Exception):
    pass


class UpstreamTransportError(Exception):
    """An upstream could not be reached, or broke its answer off or fell silent
    (`upstream_http`); its message says how."""


def openai_error(status: int, message: str, error_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def error_body(exc: ProxyError | UpstreamErrorResponse) -> tuple[int, dict[str, Any]]:
    """The error's HTTP status and OpenAI-shaped body (an upstream's own such body as it sent
    it)."""
    if isinstance(exc, ProxyError):
        return exc.status, openai_error(exc.status, exc.message, exc.error_type)
    try:
        body = json.loads(exc.body)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return exc.status, body
    detail = body.get("detail") if isinstance(body, dict) else None
    text = str(detail) if detail is not None else exc.body[:500].decode(errors="replace")
    message = f"{exc.upstream.role} server {exc.upstream.address} answered HTTP {exc.status}"
    if text:
        message += f": {text}"
    error_type = "invalid_request_error" if 400 <= exc.status < 500 else "upstream_error"
    return exc.status, openai_error(exc.status, message, error_type)


def error_kind(exc: ProxyError | UpstreamErrorResponse) -> str:
    """The error's label in the proxy's error metric."""
    return exc.kind if isinstance(exc, ProxyError) else "upstream_status"


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bad_request(message: str) -> ProxyError:
    return ProxyError(400, message, error_type="invalid_request_error", kind="bad_request")
