from kvgate.prefix_index import PrefixIndex


def test_longest_prefix_per_backend() -> None:
    idx = PrefixIndex()
    idx.record(["a", "b", "c"], "n1")
    idx.record(["a", "b"], "n2")
    assert idx.match(["a", "b", "c", "d"], {"n1", "n2"}).depth == {"n1": 3, "n2": 2}
    assert idx.match(["a", "b", "c"], {"n2"}).depth == {"n2": 2}
    assert idx.match(["x"], {"n1"}).depth == {}


def test_memory_stays_bounded_and_hot_prefixes_survive() -> None:
    idx = PrefixIndex(max_entries=1000)
    for i in range(10_000):
        idx.record(["hot"], "n1")
        idx.record([f"cold-{i}"], "n2")
        assert len(idx) <= 1000
    assert idx.match(["hot"], {"n1"}).depth == {"n1": 1}
    assert idx.match(["cold-0"], {"n2"}).depth == {}


def test_holders_are_capped_so_a_universal_prefix_carries_no_weight() -> None:
    idx = PrefixIndex()
    for n in range(20):
        idx.record(["sys"], f"n{n}")
    assert len(idx.match(["sys"], {f"n{n}" for n in range(20)}).depth) == 8


def test_a_prefix_many_conversations_continue_is_reported_as_shared() -> None:
    idx = PrefixIndex()
    idx.record(["sys0", "sys1", "conv-a1", "conv-a2"], "n1")
    assert idx.match(["sys0", "sys1", "conv-a1"], {"n1"}).shared == 0
    idx.record(["sys0", "sys1", "conv-b1"], "n2")
    idx.record(["sys0", "sys1", "conv-c1"], "n3")
    m = idx.match(["sys0", "sys1", "conv-a1", "conv-a2"], {"n1", "n2", "n3"})
    assert m.shared == 2 and m.depth["n1"] == 4
