"""Settings of the multi-turn P/D proxy and parsing of upstream addresses."""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

# The proxy forgets a conversation's decode-side blocks this long after D reported them. It must
# stay below the lease D holds them under (DuplexConnector's decode lease, vLLM NixlConnector's
# `decoder_kv_blocks_ttl` of 480 s), so that P never starts a pull of blocks D already freed.
DEFAULT_CONVERSATION_TTL_S = 60.0
DEFAULT_MAX_CONVERSATIONS = 100_000
# Bound on what one conversation entry (D's kv_transfer_params as JSON) may occupy: block ids and
# per-block fingerprints of a 128k-token history fit several times over.
DEFAULT_MAX_ENTRY_BYTES = 1 << 20
DEFAULT_MAX_STORE_BYTES = 256 << 20
DEFAULT_MAX_BODY_BYTES = 32 << 20
DEFAULT_MAX_UPSTREAM_RESPONSE_BYTES = 64 << 20
DEFAULT_MAX_CONVERSATION_ID_LENGTH = 256
# A conversation's turns go to the P rendezvous hashing picks for it (its prefix cache holds
# the history) while that P has at most this many requests in flight more than the least busy.
DEFAULT_PREFILL_AFFINITY_SLACK = 2
# Where a client names its conversation: a request header, or a field of the request body.
CONVERSATION_HEADER = "x-conversation-id"
CONVERSATION_FIELD = "conversation_id"


class ConfigError(ValueError):
    """A proxy setting is invalid; the message names the setting and the bad value."""


@dataclasses.dataclass(frozen=True)
class UpstreamAddress:
    """One vLLM server: `address` ("host:port") names it in logs, metrics and the store."""

    scheme: str
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.address}"


def parse_upstream(text: str) -> UpstreamAddress:
    """Parse `HOST:PORT`, `[IPV6]:PORT` or `http(s)://HOST:PORT` (no path)."""
    raw = text.strip()
    if not raw:
        raise ConfigError("empty upstream address")
    url = raw if "://" in raw else f"http://{raw}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid upstream address {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"invalid upstream address {text!r}: scheme must be http or https")
    if not parts.hostname or port is None:
        raise ConfigError(f"invalid upstream address {text!r}: expected HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"invalid upstream address {text!r}: no path allowed")
    return UpstreamAddress(parts.scheme, parts.hostname, port)


def parse_upstream_list(text: str, role: str) -> tuple[UpstreamAddress, ...]:
    """Parse a comma-separated list of upstream addresses; duplicates are refused."""
    addresses = tuple(parse_upstream(item) for item in text.split(",") if item.strip())
    if not addresses:
        raise ConfigError(f"no {role} upstream given")
    names = [a.address for a in addresses]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{role} upstream listed twice: {', '.join(duplicates)}")
    return addresses


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[UpstreamAddress, ...]
    decode: tuple[UpstreamAddress, ...]
    # "memory" or a redis://, rediss:// or unix:// URL shared by proxy replicas.
    store: str = "memory"
    conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    # Total bound of the in-memory store; Redis enforces its own `maxmemory`.
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES
    # Header naming the caller, set by a trusted gateway in front of the proxy. Unset: the caller
    # is the bearer API key.
    tenant_header: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_upstream_response_bytes: int = DEFAULT_MAX_UPSTREAM_RESPONSE_BYTES
    max_conversation_id_length: int = DEFAULT_MAX_CONVERSATION_ID_LENGTH
    connect_timeout_s: float = 5.0
    # Longest silence from an upstream while a response is being produced.
    read_timeout_s: float = 600.0
    # How long a request waits for a free upstream connection before it gets 503.
    pool_timeout_s: float = 30.0
    max_upstream_connections: int = 512
    # An idle upstream connection is closed after this, before the upstream's own keep-alive
    # timeout (vLLM's uvicorn: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE) can close it just as a request
    # is sent on it: that request would fail ("Server disconnected without sending a
    # response") and take a healthy server out of rotation.
    keepalive_expiry_s: float = 2.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    # Adds x-kvduplex-* response headers naming the chosen P and D and the conversation lookup.
    routing_headers: bool = False
    # A streamed answer's first token is the one P sampled, sent as soon as P answered; D
    # continues after it (`first_token`). Off: D computes the first token again and streams it.
    first_token_from_prefill: bool = True
    # Which P prefills a request: the one rendezvous hashing on the conversation's routing key
    # picks (its prefix cache holds the history, and it knows which turn it handed to a D)
    # while that P has at most this many requests in flight more than the least busy P; else
    # the least busy. 0: the least busy, ties going to the conversation's P; None: the least
    # busy, ties round-robin (no affinity).
    prefill_affinity_slack: int | None = DEFAULT_PREFILL_AFFINITY_SLACK

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ConfigError("no prefill upstream given")
        if not self.decode:
            raise ConfigError("no decode upstream given")
        if self.store != "memory" and urlsplit(self.store).scheme not in (
            "redis",
            "rediss",
            "unix",
        ):
            raise ConfigError(f"store must be 'memory' or a redis:// URL, got {self.store!r}")
        positive = {
            "conversation_ttl_s": self.conversation_ttl_s,
            "max_conversations": self.max_conversations,
            "max_entry_bytes": self.max_entry_bytes,
            "max_store_bytes": self.max_store_bytes,
            "max_body_bytes": self.max_body_bytes,
            "max_upstream_response_bytes": self.max_upstream_response_bytes,
            "max_conversation_id_length": self.max_conversation_id_length,
            "connect_timeout_s": self.connect_timeout_s,
            "read_timeout_s": self.read_timeout_s,
            "pool_timeout_s": self.pool_timeout_s,
            "max_upstream_connections": self.max_upstream_connections,
            "health_timeout_s": self.health_timeout_s,
            "backoff_initial_s": self.backoff_initial_s,
            "backoff_max_s": self.backoff_max_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        if self.prefill_affinity_slack is not None and not (
            isinstance(self.prefill_affinity_slack, int) and self.prefill_affinity_slack >= 0
        ):
            raise ConfigError(
                "prefill_affinity_slack must be an integer >= 0 or None (off), got "
                f"{self.prefill_affinity_slack!r}"
            )
        if not self.keepalive_expiry_s > 0:
            raise ConfigError("keepalive_expiry_s must be > 0")
        if self.health_interval_s < 0:
            raise ConfigError("health_interval_s must be >= 0 (0 turns periodic probes off)")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError("backoff_max_s must be >= backoff_initial_s")
        if self.tenant_header is not None and not self.tenant_header.strip():
            raise ConfigError("tenant_header must not be empty")
