"""Prometheus metrics of one proxy instance, in their own registry (several proxies may share a
process, as in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Read by `kvduplex demo` (as `<name>_total`, with a `result` label).
CONVERSATION_LOOKUPS = "kvduplex_proxy_conversation_lookups"
# Its results beyond the store's own (`store.Lookup`).
LOOKUP_DECODE_UNAVAILABLE = "decode_unavailable"


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvduplex_proxy_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvduplex_proxy_errors",
            "Errors, by kind (bad_request, upstream_status, upstream_unreachable, no_upstream, "
            "stream_aborted, store).",
            ["kind"],
            registry=self.registry,
        )
        self.conversation_lookups = Counter(
            CONVERSATION_LOOKUPS,
            "Conversation-store lookups on requests naming a conversation: hit (P pulls from D), "
            "miss, expired, decode_unavailable (the D holding the blocks is down: recompute).",
            ["result"],
            registry=self.registry,
        )
        self.conversations_stored = Counter(
            "kvduplex_proxy_conversations_stored",
            "D params remembered for a conversation's next turn.",
            registry=self.registry,
        )
        self.conversation_evictions = Counter(
            "kvduplex_proxy_conversation_evictions",
            "Entries evicted by the store's size bound before they were used.",
            registry=self.registry,
        )
        self.decode_routes = Counter(
            "kvduplex_proxy_decode_routes",
            "Requests decoded, by what chose their D: remembered (the D a conversation entry "
            "names) or hash (rendezvous hashing on the conversation's routing key).",
            ["rule"],
            registry=self.registry,
        )
        self.prefill_routes = Counter(
            "kvduplex_proxy_prefill_routes",
            "Requests prefilled, by what chose their P: hash (rendezvous hashing on the "
            "conversation's routing key: its prefix cache holds the history) or least_busy (that "
            "P had more requests in flight than prefill_affinity_slack allows, or was down).",
            ["rule"],
            registry=self.registry,
        )
        self.first_tokens = Counter(
            "kvduplex_proxy_first_tokens",
            "Streamed answers by where their first token came from: prefill (sent as soon as P "
            "answered; D continues after it) or decode, with the reason (first_token.py).",
            ["source", "reason"],
            registry=self.registry,
        )
        self.upstream_outstanding = Gauge(
            "kvduplex_proxy_upstream_outstanding",
            "Requests in flight per upstream.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.upstream_healthy = Gauge(
            "kvduplex_proxy_upstream_healthy",
            "1 while the upstream is in rotation, 0 while it is taken out.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "kvduplex_proxy_upstream_failures",
            "Failed requests and health probes per upstream.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "kvduplex_proxy_prefill_seconds",
            "Time of the prefill step on P (request sent to response read).",
            registry=self.registry,
        )
        self.decode_first_byte_seconds = Histogram(
            "kvduplex_proxy_decode_first_byte_seconds",
            "Time from sending the request to D until the first bytes of its body arrived.",
            registry=self.registry,
        )
