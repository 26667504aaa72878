"""`benches/load_long.py`'s verdicts, text tables and plot: the objective, the highest rate each
system sustains within it, the acceptance goals of issue 37 and TTFT against offered load.

Pure functions of the report dict (no servers), so `tests/bench/test_load_long_report.py` can
check the sustainable-rate rule on its own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from _bench_common import format_table, ms

logger = logging.getLogger("load_long")

REFERENCE = "reference"
ORACLE = "pd-oracle"
BIDIRECTIONAL = "kvduplex-bidirectional"
ONE_WAY = "kvduplex-one-way"
NIXL_BIDIRECTIONAL = "nixl-bidirectional"
NIXL_ONE_WAY = "nixl-one-way"
# The order they run in: the oracle first (it sets the objective), the reference next (its
# answers are the expected ones).
SYSTEMS = (ORACLE, REFERENCE, BIDIRECTIONAL, ONE_WAY, NIXL_BIDIRECTIONAL, NIXL_ONE_WAY)
# The objective on p99 TTFT of turns >= 2: this many times the oracle's p99 at the lowest rate.
# Not its p50: turns add 300 to 3,000 tokens by design, so the p50 is one kind of turn and the p99
# the slowest kind (the last 3,000-token tool output on a 5k history); at low load the oracle's
# p99 is that turn with no queue, and 2x lets a turn wait about one such turn.
OBJECTIVE_FACTOR = 2.0
P99 = "ttft_p99_s_turns_2_plus"
P50 = "ttft_p50_s_turns_2_plus"


def objective_s(oracle_points: list[dict[str, Any]]) -> float | None:
    """OBJECTIVE_FACTOR x the oracle's TTFT p99 (turns >= 2) at its lowest rate; None when the
    oracle has no such point."""
    measured = [p for p in oracle_points if p.get(P99) is not None]
    if not measured:
        return None
    return OBJECTIVE_FACTOR * min(measured, key=lambda p: p["rate"])[P99]


def within(point: dict[str, Any], objective: float) -> bool:
    """A point meets the objective: every turn sent and answered (no error, none left unsent)
    and p99 TTFT on turns >= 2 at most `objective`."""
    return (
        point.get("errors", 1) == 0
        and point.get("not_sent", 1) == 0
        and point.get(P99) is not None
        and point[P99] <= objective
    )


def sustainable_rate(points: list[dict[str, Any]], objective: float | None) -> float | None:
    """The highest rate r such that the system met the objective at r and at every lower rate
    it ran (a rate above a failed one does not count, even if its few chats happened to fit);
    None when it met it at no rate."""
    if objective is None:
        return None
    best = None
    for point in sorted(points, key=lambda p: p["rate"]):
        if not within(point, objective):
            break
        best = point["rate"]
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _at(points: list[dict[str, Any]], rate: float | None) -> dict[str, Any] | None:
    """The point at `rate`, or the highest one below it (None without one)."""
    if rate is None:
        return None
    below = [p for p in points if p["rate"] <= rate + 1e-12]
    return max(below, key=lambda p: p["rate"]) if below else None


def verdicts(report: dict[str, Any]) -> dict[str, Any]:
    """The objective, each system's sustainable rate and issue 37's goals (items 1-3)."""
    systems = report["systems"]
    points = {name: result.get("points", []) for name, result in systems.items()}
    objective = objective_s(points.get(ORACLE, []))
    rates = {name: sustainable_rate(p, objective) for name, p in points.items()}
    bi = rates.get(BIDIRECTIONAL)
    half = _at(points.get(BIDIRECTIONAL, []), bi / 2 if bi else None)
    oracle_half = _at(points.get(ORACLE, []), half["rate"]) if half else None
    all_points = [p for ps in points.values() for p in ps]
    goals = {
        "bidirectional / one-way sustainable rate >= 2": _ratio(bi, rates.get(ONE_WAY)),
        "bidirectional / NIXL bidirectional sustainable rate >= 1.5": _ratio(
            bi, rates.get(NIXL_BIDIRECTIONAL)
        ),
        "bidirectional / oracle TTFT p50 at half bidirectional's rate <= 1.25": (
            _ratio(half[P50], oracle_half[P50]) if half and oracle_half else None
        ),
        "half of bidirectional's rate (the point used)": half["rate"] if half else None,
        "answers differing": sum(p.get("answers", {}).get("mismatched", 0) for p in all_points),
        "errors": sum(p.get("errors", 0) for p in all_points)
        + sum(1 for r in systems.values() if "error" in r),
    }
    return {"objective_s": objective, "objective": f"p99 TTFT on turns >= 2 <= "
            f"{OBJECTIVE_FACTOR:g} x the oracle's p99 at its lowest rate",
            "sustainable_rate_chats_per_min": {k: None if v is None else round(60 * v, 3)
                                               for k, v in rates.items()},
            "goals": goals}


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


COLUMNS = (
    ("system", 24), ("chats/min", 10), ("goodput", 8), ("p50", 7), ("p99", 7), ("TPOT", 6),
    ("preempt", 8), ("P computed", 11), ("pulled D->P", 12), ("D held max", 11),
    ("D used max", 11), ("errors", 7), ("equal", 8),
)


def format_report(report: dict[str, Any]) -> str:
    rows: list[tuple[Any, ...]] = []
    for system, result in report["systems"].items():
        if "error" in result:
            rows.append((system, f"failed: {result['error'][:300]}"))
        for p in result.get("points", []):
            answers = p.get("answers")
            equal = ("-" if answers is None else
                     f"{answers['matched']}/{answers['matched'] + answers['mismatched']}")
            estimated = "*" if p.get("ttft_estimated") else ""
            rows.append((
                system, f"{60 * p['rate']:g}", _n(p["goodput_tokens_per_s"]),
                ms(p[P50]) + estimated, ms(p[P99]) + estimated, ms(p["tpot_p50_s"]),
                p.get("preemptions", "-"), _n(p.get("prefill_computed_tokens")),
                _n(p.get("d_to_p_tokens")), _n(p.get("d_held_blocks_max")),
                _n(p.get("d_used_blocks_max")), f"{p['errors']}+{p['not_sent']}", equal,
            ))
        if result.get("skipped_rates"):
            rows.append((system, f"not run at {result['skipped_rates']} chats/s: "
                                 f"{result['skip_reason']}"))
    v = report["verdicts"]
    lines = [*format_table(COLUMNS, rows), "",
             "p50/p99: client TTFT ms on turns >= 2 (* estimated: non-streamed, e2e minus D's "
             "mean inter-token time x tokens); TPOT ms p50; goodput: answer tokens/s;",
             "P computed: prompt tokens P (the reference: its server) computed; D held/used max: "
             "D's blocks held for readers / in use, sampled each second; errors: failed + "
             "unsent turns; equal: answers equal to the reference's", "",
             f"objective: {v['objective']} = {ms(v['objective_s'])} ms", ""]
    lines += format_table((("system", 24), ("sustains (chats/min)", 21)),
                          [(k, _n(r)) for k, r in v["sustainable_rate_chats_per_min"].items()])
    lines += ["", *(f"{k}: {_n(g)}" for k, g in v["goals"].items())]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        logger.error("no PNG: matplotlib is missing (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for system, result in report["systems"].items():
        points = [p for p in result.get("points", []) if p[P99] is not None]
        if not points:
            continue
        xs = [60 * p["rate"] for p in points]
        line, = ax.plot(xs, [1e3 * p[P50] for p in points], marker="o", label=f"{system} p50")
        ax.plot(xs, [1e3 * p[P99] for p in points], marker="^", linestyle="--",
                color=line.get_color(), label=f"{system} p99")
    objective = report["verdicts"]["objective_s"]
    if objective:
        ax.axhline(1e3 * objective, color="black", linewidth=0.8, linestyle=":",
                   label="objective (p99)")
    w = report["workload"]
    ax.set_yscale("log")
    ax.set_xlabel("chat arrivals per minute (Poisson)")
    ax.set_ylabel("client TTFT on turns >= 2 (ms)")
    ax.set_title(f"{w['conversations']} chats x {w['turns']} turns, histories "
                 f"{report['kv_plan']['first_history_tokens']} -> "
                 f"{report['kv_plan']['longest_request_tokens']} tokens")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    logger.info("wrote %s", path)
