"""Expected time to first byte per backend, and placement on the backend expected first."""

from __future__ import annotations

from kvgate.expected import expected, fastest
from kvgate.policies import Decision, Reason, SessionAction


def predict(n: str, tokens: int, attention: float) -> float | None:
    """A fit per backend: b is twice as slow as a per token, and also pays for attention; c has
    none yet."""
    return {"a": 0.01 + tokens / 10_000, "b": 0.01 + tokens / 5_000 + attention / 100_000}.get(n)


def test_each_backend_is_expected_behind_its_queue_and_idle_with_its_own_part() -> None:
    queued = {"a": (20_000, 50_000.0)}
    own = {"a": (1_000, 500.0), "b": (8_000, 32_000.0), "c": (8_000, 32_000.0)}
    got = expected(["a", "b", "c"], lambda n: queued.get(n, (0, 0.0)), own.__getitem__, predict)
    assert set(got) == {"a", "b"}  # no fit, no figure
    assert abs(got["a"][0] - 2.11) < 1e-9 and abs(got["a"][1] - 0.11) < 1e-9
    assert abs(got["b"][0] - 1.93) < 1e-9 and got["b"][0] == got["b"][1]


def test_the_pick_gives_way_only_to_a_backend_expected_a_margin_sooner() -> None:
    d = Decision(("a", "b", "c"), Reason.PREFIX, SessionAction.BIND)
    moved = fastest(d, {"a": 2.0, "b": 1.5, "c": 1.8}, 0.2)
    assert moved.candidates == ("b", "a", "c") and moved.reason is Reason.TTFT
    assert moved.session is SessionAction.BIND  # the binding follows the placement
    assert fastest(d, {"a": 2.0, "b": 1.7}, 0.2) == d  # within the margin: the pick stands
    assert fastest(d, {"b": 0.1}, 0.2) == d  # the pick has no prediction: nothing to compare
    two = Decision(("a", "b"), Reason.LOAD)
    assert fastest(two, {"a": 2.0, "b": 1.0, "c": 0.1}, 0.2).candidates == ("c", "a")  # as many tries
