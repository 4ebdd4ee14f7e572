"""Two tenants in virtual time: with the fair order a flooding tenant no longer makes the quiet one
wait behind its flood, as first come first served does; with backends kept clear of the flood's
waiting prefill (``queue.fair_reserve``) the quiet one no longer waits behind the flood's prefills
inside the engines either."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
from kvgate.public import PolicyName
from kvgate.queue import GatewayQueue

from kvgate_bench import fairness, report, virtual
from kvgate_bench.fairness import FLOOD, QUIET, queue_section, run, two_tenants
from kvgate_bench.workloads import DEFAULT_TRACE, BenchRequest
from vllm_sim.profiles import get_profile

TINY = "vllm_real/profiles/tiny-cpu.json"


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
    run against its value alone, per window and as a median and a worst (one window is one sample).
    A window given again runs again (on a real fleet, the spread of one window's runs); virtual time
    replays it exactly."""
    argv = ["--duration", "20", "--flood", "2", "--quick", "--start", "0", "600", "0", "--out", str(tmp_path)]
    assert fairness.main(argv) == 0
    data = json.loads((tmp_path / "fairness.json").read_text())
    assert [w["start"] for w in data["windows"]] == [0.0, 600.0, 0.0]
    assert data["windows"][2]["rows"] == data["windows"][0]["rows"]
    ratios = []
    for w in data["windows"]:
        alone, fair = w["rows"]
        assert (alone["order"], fair["order"]) == ("alone", "fair")
        assert FLOOD not in alone and fair[FLOOD]["served"] > 0
        ratios.append(fair[QUIET]["p90"] / alone[QUIET]["p90"])
    text = (tmp_path / "report.md").read_text()
    assert "## The window from 600 s" in text
    median, worst = statistics.median(ratios), max(ratios)
    assert f"over 3 windows: median {median:.2f}x, worst {worst:.2f}x" in text
    # Pooled: every alone run's TTFTs against every fair run's, each p90 of the three runs' requests.
    alone_all = [t for w in data["windows"] for t in w["rows"][0][QUIET]["ttfts"]]
    fair_all = [t for w in data["windows"] for t in w["rows"][1][QUIET]["ttfts"]]
    assert len(alone_all) == len(fair_all) == sum(w["rows"][0][QUIET]["served"] for w in data["windows"])
    pooled = report.pct(fair_all, 0.9) / report.pct(alone_all, 0.9)
    assert f"pooled {pooled:.2f}x ({report.pct(alone_all, 0.9):.3f} s alone" in text
    assert f"| 600 s | {data['windows'][1]['rows'][0][QUIET]['p90']:.3f} s |" in text


def tiny_quiet_p90(
    reqs: list[BenchRequest], tenants: list[str], both: bool, queue: dict[str, float]
) -> float:
    """The quiet tenant's p90 TTFT on two tiny-CPU profiles in the fair order (``queue``: settings
    over the benchmark's), alone or (``both``) beside the flood; each request under its tenant's key,
    its ``max_tokens`` read from its body as Nginx reads it."""
    picked = [i for i, t in enumerate(tenants) if both or t == QUIET]
    these = [dataclasses.replace(reqs[i], rid=n) for n, i in enumerate(picked)]
    whose = [tenants[i] for i in picked]
    feats = [
        dataclasses.replace(f, client_key=t) for f, t in zip(virtual.features_for(these), whose, strict=True)
    ]
    assert all(f.max_tokens for f in feats)
    extra = {"queue": {**queue_section("fair", None), **queue}}
    result = virtual.replay(these, feats, PolicyName.KVGATE, 2, get_profile(TINY), extra=extra)
    return report.pct(sorted(r.ttft for r in result.results if whose[r.rid] == QUIET), 0.9)


def test_a_flood_of_long_answers_is_past_its_share_and_the_quiet_tenant_keeps_its_ttft() -> None:
    """The flood sends half the quiet tenant's prompts but asks for answers eight times as long, on
    two tiny-CPU backends: its decodes fill the engines. Counted by prompt tokens alone the quiet
    tenant looked past its share and waited at the gateway for a reserve the flood's streams never
    left (its p90 in tens of seconds); with each output token counted at ``fair_output_weight`` the
    flood is the one past its share, and the quiet tenant's p90 stays near its value alone."""
    reqs, tenants = two_tenants(DEFAULT_TRACE, 30.0, 0.5, block=32, most=16384, flood_output=8.0)
    assert tenants.count(FLOOD) > 20
    assert sum(r.output_tokens for r, t in zip(reqs, tenants, strict=True) if t == FLOOD) > 2 * sum(
        r.output_tokens for r, t in zip(reqs, tenants, strict=True) if t == QUIET
    )

    def quiet_p90(both: bool, weight: float) -> float:
        return tiny_quiet_p90(reqs, tenants, both, {"fair_output_weight": weight})

    alone = quiet_p90(False, 2.0)
    assert quiet_p90(True, 0.0) > 10 * alone  # prompts alone: the quiet tenant held back
    assert quiet_p90(True, 2.0) < 1.5 * alone


def test_a_quiet_tenant_asking_a_generous_max_tokens_is_charged_what_it_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The quiet tenant's clients ask for 4,096 tokens and get what the trace says (a few hundred),
    against the usual flood at 3x, on two tiny-CPU backends. Charged for what it asked, the quiet
    tenant looked past its share, its waiting requests kept it so, and it waited at the gateway for
    a reserve the flood took (its p90 in tens of seconds); charged at each end for what it wrote,
    and when routed for the share its requests write, it keeps its TTFT."""
    reqs, tenants = two_tenants(DEFAULT_TRACE, 30.0, 3.0, block=32, most=16384, quiet_asks=4096)
    quiet = [r for r, t in zip(reqs, tenants, strict=True) if t == QUIET]
    assert all(r.asks == 4096 and r.body()["max_tokens"] == 4096 for r in quiet)
    assert sum(r.output_tokens for r in quiet) < len(quiet) * 4096 / 4

    def quiet_p90(both: bool) -> float:
        return tiny_quiet_p90(reqs, tenants, both, {})

    alone, fair = quiet_p90(False), quiet_p90(True)
    monkeypatch.setattr(GatewayQueue, "settle", lambda self, o: None)  # charged what it asked, for good
    asked = quiet_p90(True)
    print(f"quiet p90: alone {alone:.3f} s, charged what it wrote {fair:.3f} s, what it asked {asked:.3f} s")
    assert fair < 1.5 * alone
    assert asked > 10 * alone
