"""How a proxied request fails: the errors that end it with an OpenAI-shaped response."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .balancer import Upstream


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


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bad_request(message: str) -> ProxyError:
    return ProxyError(400, message, error_type="invalid_request_error", kind="bad_request")
