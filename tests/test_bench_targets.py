"""The live benchmark's kvgate variants: their config sections, with the objective in wall-clock time."""

from __future__ import annotations

from kvgate.config import Config

from kvgate_bench import report, targets


def test_the_slo_variant_carries_the_run_s_objective_scaled_to_the_simulators_time() -> None:
    extra = targets.variant("slo", report.Slo(2.0, 0.1), time_scale=4.0)
    assert extra["slo"]["objectives"] == [{"ttft_ms": 500.0, "itl_ms": 25.0}]
    assert extra["slo"]["sheddable_priority"] == 0  # every request of the benchmark may be shed
    assert extra["queue"] == targets.KVGATE_VARIANTS["queue"]["queue"]
    cfg = Config.from_mapping({**extra, "backends": [{"url": "http://127.0.0.1:1"}]})
    assert cfg.slo.objectives[0].ttft_s == 0.5
    assert "slo" not in targets.variant("queue", report.Slo(2.0, 0.1), time_scale=4.0)
