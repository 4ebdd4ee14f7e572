"""The approximate index's model of a backend's eviction: least recently sent first, as many chunks
as its cache holds, a prompt's head kept longest."""

from kvgate.residency import Residency


def chunks(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def test_a_prefix_counts_only_down_to_what_the_cache_still_holds() -> None:
    r = Residency()
    a = chunks("a", 8)
    r.sent("b0", a, capacity=8)
    assert r.trim(a, {"b0": 8}) == {"b0": 8}
    r.sent("b0", chunks("x", 3), capacity=8)  # 11 chunks sent into 8: a's last 3 are gone
    assert r.trim(a, {"b0": 8}) == {"b0": 5}
    assert r.trim(a, {"b0": 4}) == {"b0": 4}  # the index's own depth is never raised
    r.sent("b0", chunks("y", 5), capacity=8)
    assert r.trim(a, {"b0": 8}) == {}  # all of it pushed out


def test_a_prefix_sent_again_is_the_freshest_and_a_shared_head_outlives_its_tails() -> None:
    r = Residency()
    head = chunks("h", 4)
    r.sent("b0", [*head, *chunks("t", 4)], capacity=10)
    r.sent("b0", [*head, *chunks("u", 4)], capacity=10)  # the same head, another tail
    r.sent("b0", chunks("z", 2), capacity=10)
    first = [*head, *chunks("t", 4)]
    assert r.trim(first, {"b0": 8}) == {"b0": 4}  # the first tail went, the head stays


def test_a_backend_of_unknown_cache_size_is_trusted_as_the_index_says() -> None:
    r = Residency()
    a = chunks("a", 8)
    r.sent("b0", a, capacity=8)
    r.sent("b0", chunks("x", 8), capacity=None)  # its size no longer known: its model is dropped
    assert r.trim(a, {"b0": 8, "b1": 3}) == {"b0": 8, "b1": 3}
    assert len(r) == 0


def test_a_removed_backend_is_forgotten() -> None:
    r = Residency()
    r.sent("b0", chunks("a", 2), capacity=4)
    r.sent("b1", chunks("a", 2), capacity=4)
    r.forget({"b1"})
    assert len(r) == 1


def test_a_restarted_engine_holds_nothing_the_index_credits_it_with() -> None:
    r = Residency()
    a = chunks("a", 8)
    r.sent("b0", a, capacity=8)
    r.sent("b1", a, capacity=8)
    r.restart("b0")
    r.restart("b2")  # unknown cache size: nothing modelled, nothing to empty
    assert r.trim(a, {"b0": 8, "b1": 8, "b2": 8}) == {"b1": 8, "b2": 8}
    r.sent("b0", a, capacity=8)  # sent again: held again
    assert r.trim(a, {"b0": 8}) == {"b0": 8}


def test_a_context_every_request_starts_with_stays_while_its_questions_come_and_go() -> None:
    r = Residency()
    context = chunks("c", 6)
    r.sent("b0", context, capacity=10)
    for i in range(20):  # each question pushes out the oldest question
        r.sent("b0", [*context, f"q{i}"], capacity=10)
    assert r.trim([*context, "q0"], {"b0": 7}) == {"b0": 6}


def test_a_prompt_longer_than_its_hashes_fills_the_cache_by_its_size() -> None:
    r = Residency()
    a = chunks("a", 4)
    r.sent("b0", a, capacity=20)
    r.sent("b0", chunks("long", 2), capacity=20, size=17)  # hashed by 2 chunks, 17 long
    assert r.trim(a, {"b0": 4}) == {"b0": 3}


def test_what_the_model_holds_is_described_per_backend() -> None:
    r = Residency()
    assert r.describe("b0") is None
    r.sent("b0", chunks("a", 6), capacity=4)
    assert r.describe("b0") == {"chunks": 4, "capacity_chunks": 4}
    r.forget(set())
    assert r.describe("b0") is None
