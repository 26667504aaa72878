"""DuplexConnector's statistics, reported through vLLM's KV-connector stats hook.

Workers record reads and lease outcomes, the scheduler records pull decisions; vLLM aggregates
both every step, ships the plain `data` dict to the API server, logs `reduce()` as
"KV Transfer metrics: ..." and feeds `DuplexPromMetrics` for /metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvduplex import protocol

COUNTERS: dict[str, str] = {
    "transfers": "Block reads completed",
    "blocks": "KV blocks read from peers",
    "bytes": "Bytes read from peers",
    "tokens_pulled": "Prompt tokens whose KV was pulled from a peer instead of computed",
    "tokens_recomputed": "Tokens a peer held with matching ids that were computed locally "
    "instead (below threshold or after a failure)",
    "tokens_mismatched": "Tokens a peer held whose ids differ from the request's",
    "pulls_declined": "Pulls skipped because the gain was under kv_recompute_threshold",
    "claims_yielded": "Granted pulls whose request vLLM could not admit within ALLOCATION_WAIT_S while only "
    "holds that readers claimed would free its blocks: the claim went back to the owner and the "
    "prompt was computed",
    "failed_transfers": "Handshakes or reads that failed or ran out of lease time",
    "fallbacks": "Requests that asked for a pull and recomputed instead after an error, "
    "malformed params or a token mismatch",
    "lease_expiries": "Held block sets freed because their lease expired",
    "leases_released": "Held block sets freed because the reader released them",
    "leases_renewed": "Renewals of a prompt's lease by a decode node with its request queued",
    "grants_refused": "Pulls the owner named in params did not grant (other tokens, read by "
    "another engine already, expired, or unreachable); the prompt was computed instead",
    "evictions": "Held finished turns freed early to make room for new ones "
    "(decode_kv_hold_max_fraction)",
    "pressure_evictions": "Holds (finished turns or prompts) given up early because the "
    "engine's free blocks fell below what its running and waiting requests need",
    "turns_offered": "Finished turns held and offered to other engines' lookups",
    "lookups_hit": "Lookups of a prompt's blocks that found a held turn on a peer",
    "lookups_missed": "Lookups that found no held turn (or had no peer to ask)",
    "lookup_failures": "Peers that failed or timed out answering a lookup",
    "lookups_skipped": "Requests whose possible gain was under kv_recompute_threshold, not looked up",
    "lookups_indexed": "Lookups that left out decode nodes whose announcements say they hold none "
    "of the prompt",
    "lookups_awaited": "Lookup asks this decode node answered \"not yet\": the turn their prompt "
    "continues was still computed here (the prefill node asks again)",
    "lookups_ruled_out": "Requests not looked up because no decode node announced enough more "
    "of the prompt than the prefill node has to reach the lookup's threshold (prefilled in the "
    "step they arrived)",
}
SAMPLES = ("transfer_s", "transfer_tokens", "lookup_s", "lookup_wait_s", "lookup_wait_steps")
# Values at the end of the interval (-1: not reported in it).
GAUGES: dict[str, str] = {
    "held_blocks": "KV blocks kept allocated by holds (prompts and finished turns for readers)",
    "claims": "Readers' claims alive on this engine's held blocks",
}
# Per KV-cache transfer group (index = group's position among the transfer groups).
PER_GROUP: dict[str, str] = {
    "group_blocks": "KV blocks read from peers, per KV-cache group",
    "group_bytes": "Bytes read from peers, per KV-cache group",
}


@dataclass
class DuplexConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            for key in COUNTERS:
                self.data.setdefault(key, 0)
            for key in (*SAMPLES, *PER_GROUP):
                self.data.setdefault(key, [])
            for key in GAUGES:
                self.data.setdefault(key, -1)

    def reset(self) -> None:
        self.data = {key: 0 for key in COUNTERS}
        for key in (*SAMPLES, *PER_GROUP):
            self.data[key] = []
        for key in GAUGES:
            self.data[key] = -1

    def add(self, key: str, amount: int = 1) -> None:
        self.data[key] += amount

    def set_gauge(self, key: str, value: int) -> None:
        self.data[key] = value

    def record_transfer(
        self, seconds: float, blocks_per_group: tuple[int, ...], nbytes: int, tokens: int
    ) -> None:
        """One finished read: `blocks_per_group` blocks of each transfer group, `nbytes` in
        all (every block is read across the same tensors, so each is the same size)."""
        num_blocks = sum(blocks_per_group)
        self.data["transfers"] += 1
        self.data["blocks"] += num_blocks
        self.data["bytes"] += nbytes
        for index, group_blocks in enumerate(blocks_per_group):
            group_bytes = nbytes * group_blocks // num_blocks if num_blocks else 0
            _add_at(self.data["group_blocks"], index, group_blocks)
            _add_at(self.data["group_bytes"], index, group_bytes)
        self.data["tokens_pulled"] += tokens
        self.data["transfer_s"].append(seconds)
        self.data["transfer_tokens"].append(tokens)

    def record_lookup(self, seconds: float, hit: bool) -> None:
        self.data["lookups_hit" if hit else "lookups_missed"] += 1
        self.data["lookup_s"].append(seconds)

    def is_empty(self) -> bool:
        return (
            not any(self.data[key] for key in COUNTERS)
            and not any(self.data[key] for key in (*SAMPLES, *PER_GROUP))
            and all(self.data[key] < 0 for key in GAUGES)
        )

    def aggregate(self, other: KVConnectorStats) -> DuplexConnectorStats:
        if not other.is_empty():
            for key in COUNTERS:
                self.data[key] += other.data.get(key, 0)
            for key in GAUGES:
                # The later report of the same engine's value wins.
                if other.data.get(key, -1) >= 0:
                    self.data[key] = other.data[key]
            for key in SAMPLES:
                self.data[key].extend(other.data.get(key, []))
            for key in PER_GROUP:
                for index, amount in enumerate(other.data.get(key, [])):
                    _add_at(self.data[key], index, amount)
        return self

    def take(self) -> DuplexConnectorStats | None:
        """This interval's stats (None if nothing happened); starts a new interval."""
        if self.is_empty():
            return None
        snapshot = DuplexConnectorStats(data=self.data)
        self.reset()
        return snapshot

    def reduce(self) -> dict[str, int | float]:
        durations = sorted(self.data["transfer_s"])
        total_s = sum(durations)
        out: dict[str, int | float] = {key: self.data[key] for key in COUNTERS if key != "bytes"}
        out["MB"] = round(self.data["bytes"] / 1e6, 3)
        if len(self.data["group_blocks"]) > 1:
            for index, (blocks, nbytes) in enumerate(
                zip(self.data["group_blocks"], self.data["group_bytes"])
            ):
                out[f"group{index}_blocks"] = blocks
                out[f"group{index}_MB"] = round(nbytes / 1e6, 3)
        if durations:
            p99 = durations[max(0, math.ceil(0.99 * len(durations)) - 1)]
            out["mean_transfer_ms"] = round(1e3 * total_s / len(durations), 3)
            out["p99_transfer_ms"] = round(1e3 * p99, 3)
        for key in GAUGES:
            if self.data[key] >= 0:
                out[key] = self.data[key]
        for key, name, scale in (
            ("lookup_s", "lookup_ms", 1e3),
            ("lookup_wait_s", "lookup_wait_ms", 1e3),
            ("lookup_wait_steps", "lookup_wait_steps", 1),
        ):
            values = sorted(self.data[key])
            if values:
                out[f"p50_{name}"] = round(scale * _quantile(values, 0.5), 3)
                out[f"p99_{name}"] = round(scale * _quantile(values, 0.99), 3)
        if total_s > 0:
            out["throughput_MBps"] = round(self.data["bytes"] / total_s / 1e6, 1)
        return out


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted `values`."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


def _add_at(values: list[int], index: int, amount: int) -> None:
    values.extend([0] * (index + 1 - len(values)))
    values[index] += amount


class DuplexPromMetrics(KVConnectorPromMetrics):
    """Counters `vllm:kvduplex_<name>_total` (per KV-cache group: `vllm:kvduplex_group_blocks`
    and `_group_bytes` with a `kv_cache_group` label), gauges `vllm:kvduplex_<name>` and
    transfer/lookup-time histograms, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._engine_labelvalues = per_engine_labelvalues
        self._per_group = {
            key: self._counter_cls(
                name=f"{protocol.METRIC_PREFIX}{key}",
                documentation=text,
                labelnames=[*labelnames, "kv_cache_group"],
            )
            for key, text in PER_GROUP.items()
        }
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"{protocol.METRIC_PREFIX}{key}", documentation=text, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for key, text in COUNTERS.items()
        }
        self._transfer_time = create_metric_per_engine(
            self._histogram_cls(
                name=f"{protocol.METRIC_PREFIX}transfer_seconds",
                documentation="Duration of one batched block read, post to last byte",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._gauges = {
            key: create_metric_per_engine(
                self._gauge_cls(
                    name=f"vllm:kvduplex_{key}",
                    documentation=text,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for key, text in GAUGES.items()
        }
        self._lookup_wait = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvduplex_lookup_wait_seconds",
                documentation="Time a request waited in the scheduler for its grant or lookup "
                "answer, from the first ask to the answer taken",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self._lookup_time = create_metric_per_engine(
            self._histogram_cls(
                name=f"{protocol.METRIC_PREFIX}lookup_seconds",
                documentation="Duration of one lookup of a prompt's blocks on the known peers",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1],
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            amount = transfer_stats_data.get(key, 0)
            if amount:
                per_engine[engine_idx].inc(amount)
        for seconds in transfer_stats_data.get("transfer_s", []):
            self._transfer_time[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("lookup_s", []):
            self._lookup_time[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("lookup_wait_s", []):
            self._lookup_wait[engine_idx].observe(seconds)
        for key, per_engine in self._gauges.items():
            value = transfer_stats_data.get(key, -1)
            if value >= 0:
                per_engine[engine_idx].set(value)
        for key, metric in self._per_group.items():
            for index, amount in enumerate(transfer_stats_data.get(key, [])):
                if amount:
                    metric.labels(*self._engine_labelvalues[engine_idx], str(index)).inc(amount)
