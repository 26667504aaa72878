"""What the demo reads from the servers' Prometheus `/metrics`: a vLLM server's prompt-token
sources, TTFT and DuplexConnector counters (`read_metrics`, diffed around a turn with
`MetricsSnapshot.minus`), and the proxy's conversation-store lookups. Shared with the benchmarks
and the end-to-end tests (`metric_samples` is the one reader of /metrics they all use).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..protocol import METRIC_PREFIX
from ..proxy.metrics import CONVERSATION_LOOKUPS
from .servers import ServerError

_METRICS_SETTLE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class MetricsSnapshot:
    """The counters of one vLLM server that the demo and the benchmark diff around a turn."""

    # vLLM's prompt-token sources: local_compute, local_cache_hit, external_kv_transfer.
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    finished_requests: float = 0.0
    preemptions: float = 0.0
    # DuplexConnector's counters (`vllm:kvduplex_<name>_total`) by name; empty for other servers.
    connector: dict[str, float] = field(default_factory=dict)
    # DuplexConnector's histograms' sums and counts (`vllm:kvduplex_<name>_{sum,count}`), by
    # `<name>_sum` / `<name>_count`, and their cumulative buckets by `<name>_bucket:<le>`.
    connector_histograms: dict[str, float] = field(default_factory=dict)

    def minus(self, before: MetricsSnapshot) -> MetricsSnapshot:
        def diff(after: Mapping[str, float], earlier: Mapping[str, float]) -> dict[str, float]:
            return {k: v - earlier.get(k, 0.0) for k, v in after.items()}

        return MetricsSnapshot(
            prompt_tokens=diff(self.prompt_tokens, before.prompt_tokens),
            ttft_sum_s=self.ttft_sum_s - before.ttft_sum_s,
            ttft_count=self.ttft_count - before.ttft_count,
            finished_requests=self.finished_requests - before.finished_requests,
            preemptions=self.preemptions - before.preemptions,
            connector=diff(self.connector, before.connector),
            connector_histograms=diff(self.connector_histograms, before.connector_histograms),
        )

    def buckets_of(self, histogram: str) -> dict[str, float]:
        """A DuplexConnector histogram's cumulative counts by bucket upper bound ("le")."""
        prefix = f"{histogram}_bucket:"
        return {
            k[len(prefix) :]: v for k, v in self.connector_histograms.items() if k.startswith(prefix)
        }

    def mean_of(self, histogram: str) -> float | None:
        """Mean of a DuplexConnector histogram (e.g. `lookup_seconds`), None without samples."""
        count = self.connector_histograms.get(f"{histogram}_count", 0.0)
        return self.connector_histograms.get(f"{histogram}_sum", 0.0) / count if count else None

    @property
    def computed_tokens(self) -> int:
        return int(self.prompt_tokens.get("local_compute", 0.0))

    @property
    def cache_hit_tokens(self) -> int:
        return int(self.prompt_tokens.get("local_cache_hit", 0.0))

    @property
    def transferred_tokens(self) -> int:
        return int(self.prompt_tokens.get("external_kv_transfer", 0.0))

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum_s / self.ttft_count if self.ttft_count else None


def read_metrics(base_url: str, timeout_s: float = 60.0) -> MetricsSnapshot:
    """One reading of a vLLM server's Prometheus `/metrics` (summed over engines and labels).

    The generous timeout is for servers starved of CPU (NixlConnector's busy threads on 2 cores
    have kept /metrics from answering for over 10 s).
    """
    prompt_tokens: dict[str, float] = {}
    connector: dict[str, float] = {}
    histograms: dict[str, float] = {}
    values = {"ttft_sum_s": 0.0, "ttft_count": 0.0, "finished_requests": 0.0, "preemptions": 0.0}
    for sample in metric_samples(base_url, timeout_s):
        name = sample.name
        if name == "vllm:prompt_tokens_by_source_total":
            source = sample.labels.get("source", "")
            prompt_tokens[source] = prompt_tokens.get(source, 0.0) + sample.value
        elif name == "vllm:time_to_first_token_seconds_sum":
            values["ttft_sum_s"] += sample.value
        elif name == "vllm:time_to_first_token_seconds_count":
            values["ttft_count"] += sample.value
        elif name == "vllm:request_success_total":
            values["finished_requests"] += sample.value
        elif name == "vllm:num_preemptions_total":
            values["preemptions"] += sample.value
        elif name.startswith(METRIC_PREFIX) and name.endswith("_total"):
            key = name[len(METRIC_PREFIX) : -len("_total")]
            connector[key] = connector.get(key, 0.0) + sample.value
        elif name.startswith(METRIC_PREFIX) and name.endswith(("_sum", "_count", "_bucket")):
            key = name[len(METRIC_PREFIX) :]
            if key.endswith("_bucket"):
                key = f"{key}:{sample.labels.get('le', '')}"
            histograms[key] = histograms.get(key, 0.0) + sample.value
    return MetricsSnapshot(
        prompt_tokens=prompt_tokens, connector=connector, connector_histograms=histograms, **values
    )


def read_metrics_after(
    base_url: str,
    before: MetricsSnapshot,
    finished: int,
    timeout_s: float = _METRICS_SETTLE_TIMEOUT_S,
) -> MetricsSnapshot:
    """Read `/metrics` once the server has counted `finished` more requests than in `before`.

    vLLM records a step's stats just after it hands the step's outputs to the HTTP handlers, so a
    reading taken right after a response can miss the last step.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = read_metrics(base_url)
        if snapshot.finished_requests >= before.finished_requests + finished:
            return snapshot
        if time.monotonic() > deadline:
            counted = snapshot.finished_requests - before.finished_requests
            raise ServerError(
                f"{base_url}/metrics counted {counted:.0f} finished requests after "
                f"{timeout_s:.0f} s, expected {finished}"
            )
        time.sleep(0.05)


def metric_samples(base_url: str, timeout_s: float = 10.0) -> list[Any]:
    """Every Prometheus sample on a server's /metrics (`prometheus_client`'s `Sample`: name,
    labels, value): the one reader of /metrics the demo, tests and benchmarks share."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def sample_sums(base_url: str, sample: str, label: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The values of the Prometheus samples named `sample` on a server's /metrics, summed by the
    value of their `label` (over every other label, e.g. engines)."""
    sums: dict[str, float] = {}
    for found in metric_samples(base_url, timeout_s):
        if found.name == sample:
            key = found.labels.get(label, "")
            sums[key] = sums.get(key, 0.0) + found.value
    return sums


def read_proxy_lookups(proxy_url: str) -> dict[str, float]:
    """The proxy's conversation-store lookups so far, by result (hit, miss, expired,
    decode_unavailable, local: `proxy.metrics`)."""
    return sample_sums(proxy_url, f"{CONVERSATION_LOOKUPS}_total", "result")


def lookup_result(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """What the proxy's store said for the one request between two readings."""
    grown = [result for result, count in after.items() if count > before.get(result, 0.0)]
    return ",".join(sorted(grown)) or "none"

