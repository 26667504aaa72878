"""`benches/_load_long_report.py`'s verdicts: the objective from the oracle, the sustainable
rate (a rate counts only when every lower rate met the objective too) and the goals."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parent.parent / "benches"
sys.path.insert(0, str(BENCHES))

import _load_long_report as r  # noqa: E402


def point(rate: float, p50: float | None, p99: float | None, errors: int = 0,
          not_sent: int = 0) -> dict:
    return {"rate": rate, r.P50: p50, r.P99: p99, "errors": errors, "not_sent": not_sent}


def test_objective_is_the_factor_times_the_oracles_p99_at_its_lowest_rate():
    oracle = [point(0.2, 0.9, 2.0), point(0.05, 0.4, 0.5), point(0.1, 0.6, 1.0)]
    assert r.objective_s(oracle) == r.OBJECTIVE_FACTOR * 0.5
    assert r.objective_s([]) is None
    assert r.objective_s([point(0.05, None, None)]) is None


def test_sustainable_rate_stops_at_the_first_rate_that_misses():
    points = [point(0.2, 0.3, 0.5), point(0.05, 0.3, 0.5), point(0.1, 0.5, 1.5)]
    # 0.1 misses (p99 1.5 > 1.0), so 0.2 does not count although its p99 fits.
    assert r.sustainable_rate(points, 1.0) == 0.05
    assert r.sustainable_rate(points, 2.0) == 0.2
    assert r.sustainable_rate(points, 0.4) is None
    assert r.sustainable_rate(points, None) is None


def test_an_error_or_an_unsent_turn_misses_the_objective_whatever_the_ttft():
    assert not r.within(point(0.05, 0.1, 0.1, errors=1), 1.0)
    assert not r.within(point(0.05, 0.1, 0.1, not_sent=2), 1.0)
    assert not r.within(point(0.05, None, None), 1.0)
    assert r.within(point(0.05, 0.1, 1.0), 1.0)


def test_goals_compare_rates_and_the_ttft_at_half_bidirectionals_rate():
    systems = {
        r.ORACLE: {"points": [point(0.05, 0.5, 0.5), point(0.1, 0.5, 0.7),
                              point(0.2, 0.6, 0.9)]},
        r.BIDIRECTIONAL: {"points": [point(0.05, 0.6, 0.8), point(0.1, 0.6, 0.9),
                                     point(0.2, 0.7, 1.0)]},
        r.ONE_WAY: {"points": [point(0.05, 0.9, 2.5)]},
        r.NIXL_BIDIRECTIONAL: {"error": "ServerError: stalled"},
    }
    v = r.verdicts({"systems": systems})
    assert v["objective_s"] == 1.0
    assert v["sustainable_rate_chats_per_min"][r.BIDIRECTIONAL] == 12.0
    assert v["sustainable_rate_chats_per_min"][r.ONE_WAY] is None
    goals = v["goals"]
    assert goals["half of bidirectional's rate (the point used)"] == 0.1
    assert goals["bidirectional / oracle TTFT p50 at half bidirectional's rate <= 1.25"] == 1.2
    assert goals["bidirectional / one-way sustainable rate >= 2"] is None
    assert goals["errors"] == 1
