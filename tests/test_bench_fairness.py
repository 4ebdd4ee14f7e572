"""Two tenants in virtual time: with the fair order a flooding tenant no longer makes the quiet one
wait behind its flood, as first come first served does; with backends kept clear of the flood's
waiting prefill (``queue.fair_reserve``) the quiet one no longer waits behind the flood's prefills
inside the engines either."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvgate_bench import fairness
from kvgate_bench.fairness import FLOOD, QUIET, run, two_tenants
from kvgate_bench.workloads import DEFAULT_TRACE, BenchRequest


def test_the_fair_order_shields_the_quiet_tenant_from_the_flood() -> None:
    reqs, tenants = two_tenants(DEFAULT_TRACE, 30.0, 3.0)
    assert tenants.count(FLOOD) > 2 * tenants.count(QUIET)
    fcfs = run(reqs, tenants, "fcfs", 4, "llama3-8b-h100")
    fair = run(reqs, tenants, "fair", 4, "llama3-8b-h100", reserve=0)
    kept = run(reqs, tenants, "fair", 4, "llama3-8b-h100")  # one backend kept clear (the default)
    assert fcfs[QUIET]["served"] == fair[QUIET]["served"] == kept[QUIET]["served"] == tenants.count(QUIET)
    assert fair[QUIET]["p90"] < fcfs[QUIET]["p90"] / 3, (fair[QUIET], fcfs[QUIET])
    assert kept[QUIET]["p90"] < 0.75 * fair[QUIET]["p90"], (kept[QUIET], fair[QUIET])
    for row in (fair, kept):
        assert row[FLOOD]["p90"] > row[QUIET]["p90"]  # the flood pays for its own excess


def test_a_window_can_start_anywhere_in_the_trace() -> None:
    """``--start`` / ``--gap``: the quiet tenant's window from ``start``, the flood's ``gap`` after
    it (the flood at 1x here, so its window is as long as the quiet one's)."""

    def lengths(reqs: list[BenchRequest], tenants: list[str], tenant: str) -> list[int]:
        return [r.prompt_tokens for r, t in zip(reqs, tenants, strict=True) if t == tenant]

    reqs, tenants = two_tenants(DEFAULT_TRACE, 60.0, 1.0, gap=600.0)
    later, later_tenants = two_tenants(DEFAULT_TRACE, 60.0, 1.0, gap=-600.0, start=600.0)
    assert lengths(later, later_tenants, QUIET) == lengths(reqs, tenants, FLOOD)
    assert lengths(later, later_tenants, FLOOD) == lengths(reqs, tenants, QUIET)
    assert lengths(reqs, tenants, QUIET) != lengths(reqs, tenants, FLOOD)


def test_several_windows_report_the_goal_figure_per_window_its_median_and_worst(tmp_path: Path) -> None:
    """``--start`` with several windows: each window's runs, then the quiet tenant's p90 in the fair
    run against its value alone, per window and as a median and a worst (one window is one sample)."""
    argv = ["--duration", "20", "--flood", "2", "--quick", "--start", "0", "600", "--out", str(tmp_path)]
    assert fairness.main(argv) == 0
    data = json.loads((tmp_path / "fairness.json").read_text())
    assert [w["start"] for w in data["windows"]] == [0.0, 600.0]
    ratios = []
    for w in data["windows"]:
        alone, fair = w["rows"]
        assert (alone["order"], fair["order"]) == ("alone", "fair")
        assert FLOOD not in alone and fair[FLOOD]["served"] > 0
        ratios.append(fair[QUIET]["p90"] / alone[QUIET]["p90"])
    text = (tmp_path / "report.md").read_text()
    assert "## The window from 600 s" in text
    median, worst = statistics.median(ratios), max(ratios)
    assert f"over 2 windows: median {median:.2f}x, worst {worst:.2f}x" in text
    assert f"| 600 s | {data['windows'][1]['rows'][0][QUIET]['p90']:.3f} s |" in text
