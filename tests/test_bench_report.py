"""The benchmark's summaries: goodput at an SLO and the shed rate, beside the latency figures."""

import argparse

import pytest

from kvgate_bench.live import summarize_live
from kvgate_bench.report import DEFAULT_SLO, Sample, Slo, add_slo_args, http_error, markdown_table, summarize
from kvgate_bench.stream_client import COUNTERS, LiveRun


def sample(ttft: float, itl: float | None, ok: bool = True, error: str = "") -> Sample:
    return Sample(ttft, itl, ttft + 1.0, 10, ok, "b0", 100, 0, error)


def test_goodput_counts_requests_within_both_objectives_and_shed_ones_as_misses() -> None:
    samples = [
        sample(0.5, 0.05),  # meets both
        sample(0.5, None),  # one token: no gap to miss
        sample(1.5, 0.05),  # first token too late
        sample(0.5, 0.2),  # too slow after it
        sample(0.1, None, ok=False, error=http_error(429, "queue full")),  # shed by the gateway
        sample(0.1, None, ok=False, error=http_error(502, "bad gateway")),  # failed
    ]
    s = summarize("t", samples, 10.0, 0.0, {"b0": 1.0}, DEFAULT_SLO, shed_apart=2)
    assert s.goodput_rps == pytest.approx(2 / 10.0)
    assert s.slo_met == pytest.approx(2 / 8) and s.shed_rate == pytest.approx(3 / 8)
    strict = summarize("t", samples, 10.0, 0.0, {"b0": 1.0}, Slo(ttft_s=0.4, itl_s=0.1))
    assert strict.goodput_rps == 0.0 and strict.shed_rate == pytest.approx(1 / 6)
    table = markdown_table([s])
    assert "| goodput req/s | SLO met | shed |" in table and "| 0.20 | 25.0% | 37.5% |" in table


def test_the_objectives_come_from_the_command_line_in_ms() -> None:
    p = argparse.ArgumentParser()
    add_slo_args(p)
    assert Slo.from_args(p.parse_args([])) == DEFAULT_SLO == Slo(1.0, 0.1)
    assert Slo.from_args(p.parse_args(["--slo-ttft-ms", "250", "--slo-itl-ms", "40"])) == Slo(0.25, 0.04)


def test_a_live_run_keeps_its_shed_requests_through_the_time_scale() -> None:
    """Live samples are scaled to simulated seconds; their errors (what says shed) come along."""
    samples = [sample(0.2, 0.02), sample(0.05, None, ok=False, error=http_error(429, "queue full"))]
    run = LiveRun(samples, 5.0, 0.0, {"b0": dict.fromkeys(COUNTERS, 0.0)})
    s = summarize_live("t", run, time_scale=4.0, speedup=1.0)
    assert s.shed_rate == 0.5 and s.ttft_mean == pytest.approx(0.8) and s.slo_met == 0.5
