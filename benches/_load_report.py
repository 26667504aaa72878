"""`benches/load.py`'s report: the systems it compares, the ratios between them, its text table
and its plot (TTFT and goodput against offered load)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from _bench_common import format_table, ms

logger = logging.getLogger("load")

IDEAL = "ideal"
BIDIRECTIONAL = "kvduplex-bidirectional"
ONE_WAY = "kvduplex-one-way"
SYSTEMS = (IDEAL, BIDIRECTIONAL, ONE_WAY)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(systems: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rate: bidirectional's TTFT (turns >= 2) over the ideal's and over one-way's, and
    its goodput and P's computed prompt tokens over one-way's."""

    def at(system: str, rate: float, key: str) -> float | None:
        points = systems.get(system, {}).get("points", [])
        return next((p[key] for p in points if p["rate"] == rate), None)

    rates = [p["rate"] for p in next(iter(systems.values()), {}).get("points", [])]
    out = []
    for rate in rates:
        row: dict[str, Any] = {"rate": rate}
        for q in ("p50", "p99"):
            key = f"ttft_{q}_s_turns_2_plus"
            if IDEAL in systems:
                row[f"{q} bidirectional/ideal"] = _ratio(
                    at(BIDIRECTIONAL, rate, key), at(IDEAL, rate, key)
                )
                row[f"{q} one-way/ideal"] = _ratio(at(ONE_WAY, rate, key), at(IDEAL, rate, key))
            row[f"{q} bidirectional/one-way"] = _ratio(
                at(BIDIRECTIONAL, rate, key), at(ONE_WAY, rate, key)
            )
        for key, name in (("goodput_tokens_per_s", "goodput"), ("prefill_computed_tokens", "P computed")):
            row[f"{name} bidirectional/one-way"] = _ratio(
                at(BIDIRECTIONAL, rate, key), at(ONE_WAY, rate, key)
            )
        out.append(row)
    return out


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


def _lookup_cell(point: dict[str, Any]) -> str:
    p50, p99 = point.get("lookup_wait_p50_s"), point.get("lookup_wait_p99_s")
    return "-" if p50 is None else f"{1e3 * p50:g}/{1e3 * p99:g}"


REPORT_COLUMNS = (
    ("system", 24), ("chats/s", 8), ("req/s", 6), ("goodput", 8), ("p50", 6), ("p90", 6),
    ("p99", 6), ("t1 p50", 7), ("preempt", 8), ("held", 5), ("evict", 6), ("hits", 5),
    ("D->P tok", 9), ("P->D tok", 9), ("lookup", 11), ("faults", 7), ("errors", 7),
    ("equal", 9), ("diverged", 9),
)


def format_report(report: dict[str, Any]) -> str:
    rows: list[tuple[Any, ...]] = []
    for system, result in report["systems"].items():
        if "error" in result:
            rows.append((system, f"failed: {result['error'][:200]}"))
        for p in result.get("points", []):
            answers = p.get("answers")
            if answers is None:
                equal, diverged = "ref", "-"
            else:
                compared = answers["matched"] + answers["mismatched"]
                equal, diverged = f"{answers['matched']}/{compared}", str(answers["diverged"])
            faults = p["connector_faults"]
            rows.append((
                system, f"{p['rate']:g}", f"{p['offered_requests_per_s']:g}",
                _n(p["goodput_tokens_per_s"]), ms(p["ttft_p50_s_turns_2_plus"]),
                ms(p["ttft_p90_s_turns_2_plus"]), ms(p["ttft_p99_s_turns_2_plus"]),
                ms(p["ttft_p50_s_turn_1"]), p["preemptions"], _n(p["turns_held"]),
                _n(p["evictions"]), _n(p["d_to_p_hits"]), _n(p["d_to_p_tokens"]),
                _n(p["p_to_d_tokens"]), _lookup_cell(p),
                _n(sum(faults.values()) if faults else None),
                p["errors"], equal, diverged,
            ))
    lines = [
        f"P/D behind {report.get('front', 'kvduplex proxy, 1 P x 1 D')}; "
        f"KV cache: {json.dumps(report['kv_plan'])}", "",
        *format_table(REPORT_COLUMNS, rows),
    ]
    lines += [
        "",
        "req/s: offered (chat arrivals x turns); goodput: answer tokens/s of completed requests "
        "over the point; p50/p90/p99: client TTFT ms on turns >= 2, t1: on turn 1; lookup: "
        "p50/p99 ms a request waited in P's scheduler for its lookup (bucket upper bounds);",
        "held: finished turns held for lookups; faults: failed transfers + fallbacks + refused "
        "grants + failed lookups; equal: answers equal to the reference's (the ideal's, one-way's "
        "behind vllm-router) of those compared; "
        "diverged: turns after a difference (not compared)",
        "",
    ]
    for row in report["ratios"]:
        lines.append("  ".join(f"{k} {_n(v)}" for k, v in row.items()))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        logger.error("no PNG: matplotlib is missing (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, goodput_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    for system, result in report["systems"].items():
        points = [p for p in result.get("points", []) if p["ttft_p50_s_turns_2_plus"] is not None]
        if not points:
            continue
        xs = [p["offered_requests_per_s"] for p in points]
        line, = ttft_ax.plot(xs, [1e3 * p["ttft_p50_s_turns_2_plus"] for p in points],
                             marker="o", label=f"{system} p50")
        ttft_ax.plot(xs, [1e3 * p["ttft_p99_s_turns_2_plus"] for p in points], marker="^",
                     linestyle="--", color=line.get_color(), label=f"{system} p99")
        goodput_ax.plot(xs, [p["goodput_tokens_per_s"] for p in points], marker="o",
                        color=line.get_color(), label=system)
    w = report["workload"]
    ttft_ax.set_yscale("log")
    ttft_ax.set_xlabel("offered load (requests/s: chat arrivals x turns)")
    ttft_ax.set_ylabel("client TTFT on turns >= 2 (ms)")
    ttft_ax.set_title(
        f"{w['conversations']} chats x {w['turns']} turns, KV cache "
        f"{report['kv_plan']['node_blocks']} blocks per P/D node, "
        f"{report['kv_plan']['ideal_servers']} ideal server(s)"
    )
    goodput_ax.set_xlabel(ttft_ax.get_xlabel())
    goodput_ax.set_ylabel("goodput (answer tokens/s)")
    for ax in (ttft_ax, goodput_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    logger.info("wrote %s", path)
