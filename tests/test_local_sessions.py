"""The in-process LRU of session bindings."""

from kvgate.local_sessions import LocalSessions


def test_it_holds_at_most_its_capacity_and_drops_the_least_recently_used() -> None:
    m = LocalSessions(2)
    m.set("a", "b0", 1.0)
    m.set("b", "b1", 2.0)
    assert m.get("a") == ("b0", 1.0)  # a read makes "a" recent
    m.set("c", "b2", 3.0)
    assert len(m) == 2 and m.get("b") is None and m.get("a") == ("b0", 1.0)


def test_a_later_answer_overwrites_the_binding() -> None:
    m = LocalSessions(10)
    m.set("a", "b0", 1.0)
    m.set("a", "b1", 5.0)
    assert m.get("a") == ("b1", 5.0) and len(m) == 1
