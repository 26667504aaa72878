"""What a caller sent the proxy: its JSON body (bounded, and only what can be sent on), its
conversation id, and who it is (as a digest)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from fastapi import Request

from .config import CONVERSATION_FIELD, CONVERSATION_HEADER
from .errors import ProxyError, bad_request

# A JSON escape of a UTF-16 surrogate: a pair is one character, a lone one cannot be sent on.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_constant(name: str) -> float:
    """NaN and Infinity are not JSON, and cannot be sent on to the servers."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A number past a double's range would be read as infinity, which cannot be sent on."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:32]} is out of a JSON number's range")
    return value


def digest(label: str, value: str) -> str:
    return hashlib.sha256(f"{label}\0{value}".encode()).hexdigest()[:32]


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request's body, a JSON object of at most `limit` bytes (413 past it, 400 if not)."""
    too_large = ProxyError(
        413,
        f"request body exceeds {limit} bytes",
        error_type="invalid_request_error",
        kind="bad_request",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        raw = b"".join(chunks)
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
        if _ESCAPED_SURROGATE.search(raw):
            # A lone surrogate is no text an upstream can encode or tokenize: refused here.
            json.dumps(body, ensure_ascii=False).encode()
    except (ValueError, UnicodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def conversation_id(request: Request, body: dict[str, Any], max_length: int) -> str | None:
    """The conversation id from the header or the body field (taken out of `body`)."""
    from_header = request.headers.get(CONVERSATION_HEADER)
    from_body = body.pop(CONVERSATION_FIELD, None)
    if from_body is not None and not isinstance(from_body, str):
        raise bad_request(f"'{CONVERSATION_FIELD}' must be a string")
    if from_header is not None and from_body is not None and from_header != from_body:
        raise bad_request(
            f"the {CONVERSATION_HEADER} header and the '{CONVERSATION_FIELD}' field differ"
        )
    conversation = from_header if from_header is not None else from_body
    if conversation is None:
        return None
    if not conversation or len(conversation) > max_length:
        raise bad_request(f"conversation id must have 1 to {max_length} characters")
    return conversation


def caller_of(request: Request, tenant_header: str | None) -> str:
    """Who the caller is: the configured tenant header if present, else the bearer API key.
    Only digests are kept; callers without either share one anonymous namespace."""
    if tenant_header:
        value = request.headers.get(tenant_header)
        if value:
            return digest("tenant", value)
    authorization = request.headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        credential = token.strip() if scheme.lower() == "bearer" else authorization
        return digest("api-key", credential)
    return "anonymous"


def check_stateless_response(body: dict[str, Any]) -> None:
    """P and D each see the whole conversation in every request: a response stored on one
    server (`previous_response_id`, `background`) cannot be continued through both."""
    for field in ("previous_response_id", "background", "conversation"):
        if body.get(field):
            raise bad_request(
                f"'{field}' is not supported through the P/D proxy: send the whole "
                "conversation in 'input' (the prefill and decode servers do not share stored "
                "responses)"
            )
