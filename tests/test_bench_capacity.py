"""The capacity benchmark's arithmetic: which level counts as within budget, and which is the
capacity."""

from __future__ import annotations

from kvgate_bench.capacity import MAX_DECISION_P99_MS, Level, capacity, markdown


def level(clients: int, rps: float, **kw: float) -> Level:
    base = {"decisions": rps * 5, "failopen": 0.0, "decision_p99_ms": 2.0}
    return Level("kvgate", 1024, clients, int(rps * 5), 0, rps, 5.0, **{**base, **kw})  # type: ignore[arg-type]


def test_a_level_counts_only_within_the_fall_open_and_latency_bounds() -> None:
    assert level(1, 100).within
    assert not level(1, 100, failopen=0.002).within
    assert not level(1, 100, decision_p99_ms=MAX_DECISION_P99_MS * 2).within
    errored = level(1, 100)
    errored.errors = 1
    assert not errored.within
    peer = Level("vllm-router:round_robin", 1024, 4, 500, 0, 100.0, 5.0)  # no decisions to count
    assert peer.within
    peer.latency_p99_ms = MAX_DECISION_P99_MS * 2  # judged by its answers' p99
    assert not peer.within


def test_capacity_is_the_fastest_level_within_bounds_not_the_fastest_level() -> None:
    rows = [level(1, 100), level(8, 900), level(32, 1200, decision_p99_ms=50.0), level(16, 1000)]
    best = capacity(rows, "kvgate", 1024)
    assert best is not None and (best.clients, best.rps) == (16, 1000)
    assert capacity(rows, "kvgate", 51_200) is None
    text = markdown(rows, [1024, 51_200])
    assert "| kvgate | 1000 (16); 1200;" in text and "none; 0 |" in text
