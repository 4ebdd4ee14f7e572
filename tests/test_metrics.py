"""The sidecar's metrics: one registry per sidecar, so two in one process never collide."""

from kvgate.metrics import SidecarMetrics
from prometheus_client import generate_latest


def test_two_sidecars_in_one_process_count_apart() -> None:
    a, b = SidecarMetrics(), SidecarMetrics()
    a.decisions.labels("kvgate", "prefix").inc()
    text_a, text_b = generate_latest(a.registry).decode(), generate_latest(b.registry).decode()
    assert 'kvgate_decisions_total{policy="kvgate",reason="prefix"} 1.0' in text_a
    assert "kvgate_decisions_total{" not in text_b


def test_the_exposition_names_what_the_dashboards_read() -> None:
    text = generate_latest(SidecarMetrics().registry).decode()
    for name in ("kvgate_decision_seconds", "kvgate_event_loop_lag_seconds", "kvgate_config_mismatch"):
        assert f"# TYPE {name} " in text, name
