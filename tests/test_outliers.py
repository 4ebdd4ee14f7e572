"""Passive health: which outcomes count, ejection, growth, the fleet cap and probation."""

from __future__ import annotations

from kvgate.config import OutlierConfig
from kvgate.outliers import OutlierDetector, OutlierState, failure_reason

CFG = OutlierConfig(consecutive=3, base_ejection_s=10.0, max_ejection_s=35.0, max_ejection_percent=50.0)


def test_only_failures_the_backend_caused_count() -> None:
    assert failure_reason(502, False) == "status 502"
    assert failure_reason(504, False) == "timeout"
    assert failure_reason(0, False) == "no response"
    assert failure_reason(200, True) == "cut stream"
    assert failure_reason(499, False) is None  # the client went away
    assert failure_reason(400, False) is None and failure_reason(200, False) is None


def test_consecutive_failures_eject_and_a_success_in_between_resets() -> None:
    d, s = OutlierDetector(CFG), OutlierState()
    assert not d.record(s, "status 503", 0.0, 0, 4)
    assert not d.record(s, "status 503", 0.1, 0, 4)
    assert not d.record(s, None, 0.2, 0, 4)  # a success: start over
    assert not d.record(s, "timeout", 0.3, 0, 4) and not d.record(s, "timeout", 0.4, 0, 4)
    assert d.record(s, "timeout", 0.5, 0, 4)
    assert s.ejected_until == 10.5 and s.ejections == 1


def test_ejections_grow_and_are_capped_and_probation_re_ejects_at_once() -> None:
    d, s = OutlierDetector(CFG), OutlierState()
    for t in range(3):
        d.record(s, "cut stream", float(t), 0, 4)
    assert s.ejected_until == 12.0
    assert not d.expire(s, 11.9) and d.expire(s, 12.0)
    assert s.probation and s.ejected_until is None
    assert d.record(s, "status 500", 12.5, 0, 4)  # the probe failed: out again, for longer
    assert s.ejected_until == 12.5 + 20.0
    d.expire(s, 40.0)
    assert d.record(s, "status 500", 40.1, 0, 4)
    assert s.ejected_until == 40.1 + 30.0
    d.expire(s, 80.0)
    assert d.record(s, "status 500", 80.1, 0, 4)
    assert s.ejected_until == 80.1 + 35.0  # capped at max
    d.expire(s, 200.0)
    assert not d.record(s, None, 200.1, 0, 4) and not s.probation  # the probe succeeded


def test_at_most_the_configured_share_is_out_and_never_the_whole_fleet() -> None:
    d = OutlierDetector(CFG)
    assert d.max_ejected(4) == 2 and d.max_ejected(3) == 1 and d.max_ejected(2) == 1 and d.max_ejected(1) == 0
    s = OutlierState()
    for t in range(5):
        assert not d.record(s, "status 502", float(t), 2, 4)  # two of four are out already
    assert s.ejected_until is None
    assert d.record(s, "status 502", 6.0, 1, 4)


def test_a_long_healthy_spell_starts_the_ejection_time_over() -> None:
    d, s = OutlierDetector(CFG), OutlierState()
    for t in range(3):
        d.record(s, "status 502", float(t), 0, 4)
    d.expire(s, 20.0)
    d.record(s, None, 20.1, 0, 4)
    for t in range(3):
        d.record(s, "status 502", 100.0 + t, 0, 4)  # more than max_ejection after the last one
    assert s.ejected_until == 102.0 + 10.0


def test_disabled_never_ejects() -> None:
    d, s = OutlierDetector(OutlierConfig(enabled=False)), OutlierState()
    assert not any(d.record(s, "status 500", float(t), 0, 4) for t in range(20))
