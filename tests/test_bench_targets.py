"""The live benchmark's kvgate variants: their config sections, with the objective in wall-clock time."""

from __future__ import annotations

import pytest
from kvgate.config import Config

from kvgate_bench import report, targets, virtual
from kvgate_bench.workloads import BenchRequest


def test_the_slo_variant_carries_the_run_s_objective_scaled_to_the_simulators_time() -> None:
    extra = targets.variant("slo", report.Slo(2.0, 0.1), time_scale=4.0)
    assert extra["slo"]["objectives"] == [{"ttft_ms": 500.0, "itl_ms": 25.0}]
    assert extra["slo"]["sheddable_priority"] == 0  # every request of the benchmark may be shed
    assert extra["queue"] == targets.KVGATE_VARIANTS["queue"]["queue"]
    cfg = Config.from_mapping({**extra, "backends": [{"url": "http://127.0.0.1:1"}]})
    assert cfg.slo.objectives[0].ttft_s == 0.5
    assert "slo" not in targets.variant("queue", report.Slo(2.0, 0.1), time_scale=4.0)


def test_the_prediction_error_quantiles_read_a_histogram_as_prometheus_does() -> None:
    inf = float("inf")
    # 10 at or under 0.1, 10 more under 0.2, 10 more under 0.5, none past it.
    cumulative = {0.1: 10.0, 0.2: 20.0, 0.5: 30.0, 1.0: 30.0, inf: 30.0}
    assert targets.histogram_quantile(cumulative, 0.5) == 0.1 + 0.1 * 5 / 10
    assert abs((targets.histogram_quantile(cumulative, 0.9) or 0) - (0.2 + 0.3 * 7 / 10)) < 1e-12
    # Past the last finite bound: that bound.
    assert targets.histogram_quantile({0.1: 1.0, inf: 10.0}, 0.9) == 0.1
    assert targets.histogram_quantile({inf: 0.0}, 0.5) is None
    assert targets.prediction_error([]) == (0, None, None)


def test_a_pools_target_splits_the_backends_by_the_workload_s_prompt_lengths() -> None:
    reqs = [BenchRequest(i, 0.0, 8, i * 64, blocks=tuple(range(i))) for i in range(1, 41)]
    assert targets.pool_plan("kvgate:kvgate+queue", reqs, 4) == ({}, [])
    section, labels = targets.pool_plan("kvgate:kvgate+pools-queue", reqs, 4)
    assert labels == [{"pool": "long"}, {"pool": "short"}, {"pool": "short"}, {"pool": "short"}]
    backends = [{"url": f"http://127.0.0.1:{i + 1}", "labels": labels[i]} for i in range(4)]
    cfg = Config.from_mapping({**section, "backends": backends})
    short = cfg.pools.rules[0]
    assert short.pool == "short" and short.max_prompt_tokens is not None
    # The longest quarter of the prompts goes past the short pool's bound.
    est = sorted(f.est_tokens for f in virtual.features_for(reqs))
    assert sum(1 for t in est if t > short.max_prompt_tokens) == pytest.approx(len(est) / 4, abs=2)


def test_the_pressure_workload_takes_its_size_from_the_command_line() -> None:
    """A smaller fleet (a real one on CPU) gets fewer, shorter contexts at its own rate; every request
    starts with one of them."""
    import argparse

    from kvgate_bench.workloads import add_workload_args, build_workload

    p = argparse.ArgumentParser()
    add_workload_args(p)
    size = ["--pressure-tenants", "4", "--pressure-context", "50", "--pressure-rate", "100"]
    args = p.parse_args(["--workload", "pressure", "--limit", "300", *size])
    reqs = build_workload(args)
    assert len(reqs) == 300
    contexts = {r.messages[0]["content"] for r in reqs}
    assert len(contexts) == 4 and all(len(c.split()) == 50 for c in contexts)
    assert 1.5 < reqs[-1].arrival < 6.0  # 300 Poisson arrivals at 100/s
