from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from kvgate.ring import Ring

KEYS = [f"session-{i}" for i in range(20_000)]


def owners(ring: Ring) -> dict[str, str]:
    return {k: ring.owner(k) or "" for k in KEYS}


@settings(max_examples=15, deadline=None)
@given(st.integers(min_value=3, max_value=12))
def test_keys_spread_within_tolerance(n: int) -> None:
    """With 160 points per node, no node owns more than 1.35x or less than 0.65x of its fair share."""
    ring = Ring({f"node-{i}": 1.0 for i in range(n)})
    counts = Counter(owners(ring).values())
    fair = len(KEYS) / n
    assert max(counts.values()) <= 1.35 * fair
    assert min(counts.values()) >= 0.65 * fair


@settings(max_examples=15, deadline=None)
@given(st.integers(min_value=3, max_value=10), st.data())
def test_adding_a_node_moves_about_one_nth_of_keys_only_to_it(n: int, data: st.DataObject) -> None:
    nodes = {f"node-{i}": 1.0 for i in range(n)}
    before = owners(Ring(nodes))
    after = owners(Ring({**nodes, "new": 1.0}))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "new" for k in moved)
    assert abs(len(moved) / len(KEYS) - 1 / (n + 1)) < 0.5 / (n + 1)


@settings(max_examples=15, deadline=None)
@given(st.integers(min_value=3, max_value=10), st.data())
def test_removing_a_node_moves_only_its_keys(n: int, data: st.DataObject) -> None:
    nodes = {f"node-{i}": 1.0 for i in range(n)}
    gone = data.draw(st.sampled_from(sorted(nodes)))
    before = owners(Ring(nodes))
    after = owners(Ring({k: v for k, v in nodes.items() if k != gone}))
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)
    assert set(moved) == {k for k in KEYS if before[k] == gone}


def test_ring_is_deterministic_and_order_independent() -> None:
    a = Ring({"b": 1.0, "a": 1.0, "c": 2.0})
    b = Ring({"c": 2.0, "a": 1.0, "b": 1.0})
    assert [a.owner(k) for k in KEYS[:500]] == [b.owner(k) for k in KEYS[:500]]


def test_walk_yields_each_node_once_owner_first() -> None:
    ring = Ring({f"n{i}": 1.0 for i in range(5)})
    walk = list(ring.walk("k"))
    assert len(walk) == 5 and len(set(walk)) == 5 and walk[0] == ring.owner("k")
    assert list(Ring({}).walk("k")) == []


def test_weights_scale_ownership() -> None:
    counts = Counter(owners(Ring({"big": 3.0, "small": 1.0})).values())
    assert 2.3 < counts["big"] / counts["small"] < 3.9
