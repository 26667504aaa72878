"""`benches/load.py --vllm-router POLICY`: its P/D systems as 2 P x 2 D behind vLLM's production
router (`vllm-router --vllm-pd-disaggregation --policy POLICY`, `kvduplex_testing.router`)
instead of 1 P x 1 D behind the kvduplex proxy; one-way runs first and its answers are the
expected ones (no ideal). What the router does with P's and D's params: docs/connector.md,
"Behind vllm-router".

The router decides which P and which D serve a turn, so the point's counts are read once the P's
together and the D's together have finished every completed turn (`read_fleet_after`), and
reported summed over the P's and over the D's (`merged`), each server's prompt tokens beside.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from _load_report import BIDIRECTIONAL, ONE_WAY
from kvduplex.demo import MetricsSnapshot, read_metrics
from kvduplex.demo.servers import ServerError
from kvduplex_testing.servers import VllmServer

# One-way first: its answers are the expected ones.
ROUTER_SYSTEMS = (ONE_WAY, BIDIRECTIONAL)
ROUTER_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
FLEET_PAIRS = 2
SETTLE_TIMEOUT_S = 60.0


def prefill_roles(servers: Mapping[str, VllmServer]) -> list[str]:
    return [role for role in servers if role.startswith("P")]


def decode_roles(servers: Mapping[str, VllmServer]) -> list[str]:
    return [role for role in servers if role.startswith("D")]


def merged(snapshots: Sequence[MetricsSnapshot]) -> MetricsSnapshot:
    """The sum of several servers' readings (or of their differences)."""

    def add(dicts: Sequence[Mapping[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in dicts:
            for key, value in d.items():
                out[key] = out.get(key, 0.0) + value
        return out

    return MetricsSnapshot(
        prompt_tokens=add([s.prompt_tokens for s in snapshots]),
        ttft_sum_s=sum(s.ttft_sum_s for s in snapshots),
        ttft_count=sum(s.ttft_count for s in snapshots),
        finished_requests=sum(s.finished_requests for s in snapshots),
        preemptions=sum(s.preemptions for s in snapshots),
        connector=add([s.connector for s in snapshots]),
        connector_histograms=add([s.connector_histograms for s in snapshots]),
    )


def read_fleet_after(
    servers: Mapping[str, VllmServer], before: Mapping[str, MetricsSnapshot], completed: int
) -> tuple[dict[str, MetricsSnapshot], dict[str, MetricsSnapshot]]:
    """Once the P's together and the D's together counted `completed` more finished requests
    than in `before`: the P's and the D's differences summed (by role "P" and "D"), and each
    server's. Raises `ServerError` after SETTLE_TIMEOUT_S."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        each = {role: read_metrics(s.base_url).minus(before[role]) for role, s in servers.items()}
        sums = {
            side: merged([each[role] for role in roles])
            for side, roles in (("P", prefill_roles(servers)), ("D", decode_roles(servers)))
        }
        if all(s.finished_requests >= completed for s in sums.values()):
            return sums, each
        if time.monotonic() > deadline:
            counted = {side: int(s.finished_requests) for side, s in sums.items()}
            raise ServerError(f"the fleet counted {counted} finished requests, expected {completed}")
        time.sleep(0.1)


def per_server(each: Mapping[str, MetricsSnapshot]) -> dict[str, dict[str, int]]:
    """Each server's finished requests and prompt tokens computed / from its cache / pulled."""
    return {
        role: {
            "finished": int(r.finished_requests),
            "computed": r.computed_tokens,
            "cache_hit": r.cache_hit_tokens,
            "pulled": r.transferred_tokens,
        }
        for role, r in each.items()
    }
