import random

import pytest
from kvgate.prefix_index import PrefixIndex, _Generation


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


def test_a_segment_hint_never_changes_what_is_found() -> None:
    gen = _Generation(segment=4)
    chains = [[f"c{c}-{i}" for i in range(7)] for c in range(5)]
    for c, chain in enumerate(chains):
        gen.add_new(chain, f"{c}")
    gen.set("c1-3", "updated")
    assert len(gen.parts) > 5  # the chains span many segments
    for key in [h for chain in chains for h in chain]:
        held = next(part[key] for part in gen.parts if key in part)  # each key is in one segment
        assert gen.get(key) == held
        for hint in range(len(gen.parts) + 2):
            entry, where = gen.find(key, hint)
            assert entry == held and gen.parts[where][key] == entry
    assert gen.find("absent", 2) == (None, 2)


def test_matches_and_records_are_the_same_with_and_without_segment_hints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Many small segments and two generations' worth of aging: conversations that grow turn by
    # turn, branch, and come back on other nodes.
    def run() -> list[tuple[dict[str, int], int]]:
        rng = random.Random(7)
        index = PrefixIndex(max_entries=200)
        out = []
        for step in range(600):
            conv = rng.randrange(40)
            turns = rng.randrange(1, 30)
            hashes = [f"{conv}-{t}" if t < 20 else f"{conv}-{step}-{t}" for t in range(turns)]
            m = index.match(hashes, {"a", "b", "c"})
            out.append((m.depth, m.shared))
            index.record(hashes, rng.choice("abc"))
        return out

    hinted = run()

    def scan(self: _Generation, h: str, hint: int) -> tuple[str | None, int]:
        for i in range(len(self.parts) - 1, -1, -1):  # every segment, newest first; the hint unused
            if h in self.parts[i]:
                return self.parts[i][h], i
        return None, hint

    monkeypatch.setattr(_Generation, "find", scan)
    assert run() == hinted


@pytest.mark.parametrize("bound", [64, 200, 1000, 100_000])
def test_a_record_that_continues_its_match_leaves_the_index_as_a_full_walk_would(bound: int) -> None:
    """``record(..., matched)`` skips the chunks its match found the node holding; with generations
    aging under it (small bounds), conversations that grow, branch and move between nodes, every
    later match and the index's contents are what walking every chunk again gives."""

    def run(continue_match: bool) -> tuple[list[tuple[dict[str, int], int]], list[dict[str, str]]]:
        rng = random.Random(bound)
        index = PrefixIndex(max_entries=bound)
        out = []
        for step in range(1500):
            conv = rng.randrange(40)
            turns = rng.randrange(1, 30)
            branch = rng.random() < 0.3
            hashes = [
                f"{conv}-{t}" if t < 20 and not (branch and t > 10) else f"{conv}-{step}-{t}"
                for t in range(turns)
            ]
            eligible = {"a", "b", "c", "d"} if rng.random() < 0.8 else {"a", "b"}
            m = index.match(hashes, eligible)
            out.append((m.depth, m.shared))
            node = rng.choice(sorted(eligible))
            index.record(hashes, node, m if continue_match else None)
        contents = [
            {k: v for part in gen.parts for k, v in part.items()} for gen in (index._current, index._previous)
        ]
        return out, contents

    assert run(continue_match=True) == run(continue_match=False)


def test_a_record_after_a_new_generation_walks_every_chunk_again() -> None:
    """The chunks a match found were in the generation that has since become the previous one:
    ``record`` copies them forward, as a full walk does, instead of trusting the match."""
    idx = PrefixIndex(max_entries=8)  # a generation holds 4 entries
    idx.record(["a", "b", "c"], "n1")
    m = idx.match(["a", "b", "c"], {"n1"})
    assert m.depth == {"n1": 3}
    idx.record(["x", "y"], "n2")  # the current generation fills up: a new one begins
    idx.record(["a", "b", "c"], "n1", m)
    idx.record(["p", "q", "r", "s"], "n2")  # and another: what was not copied forward is dropped
    assert idx.match(["a", "b", "c"], {"n1"}).depth == {"n1": 3}
