"""The exact index: events applied per backend, sequence numbers (gaps, restarts, replays seen
twice), staleness from the scraped misses, and its memory bound."""

from collections.abc import Iterator

from kvgate.exact_index import Applied, ExactIndex, View
from kvgate.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


def stored(*hashes: int, rank: int = 0) -> EventBatch:
    return EventBatch(0.0, (BlockStored(hashes, None, 16),), rank)


def removed(*hashes: int) -> EventBatch:
    return EventBatch(0.0, (BlockRemoved(hashes),), 0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_stream_from_zero_is_a_full_view_of_what_the_backend_holds() -> None:
    ix = ExactIndex()
    assert ix.view("a") is View.NONE and ix.depth("a", [1, 2]) == 0
    assert ix.apply("a", 0, stored(1, 2, 3)) is Applied.OK
    assert ix.view("a") is View.FULL and ix.block_size("a") == 16
    assert ix.depth("a", [1, 2, 3, 4]) == 3
    assert ix.depth("a", [9, 2, 3]) == 0  # a prefix, not a set: the first block decides
    assert ix.apply("a", 1, removed(2)) is Applied.OK
    assert ix.depth("a", [1, 2, 3]) == 1
    assert ix.size("a") == 2


def test_two_copies_of_a_block_need_two_removals() -> None:
    ix = ExactIndex()
    ix.apply("a", 0, stored(1))
    ix.apply("a", 1, stored(1))
    ix.apply("a", 2, removed(1))
    assert ix.depth("a", [1]) == 1
    ix.apply("a", 3, removed(1, 77))  # a removal of a block never seen is ignored
    assert ix.depth("a", [1]) == 0


def test_a_late_subscriber_and_a_gap_make_the_view_partial_and_a_restart_makes_it_full() -> None:
    ix = ExactIndex()
    assert ix.apply("a", 5, stored(1)) is Applied.GAP  # joined late: what came before is unknown
    assert ix.view("a") is View.PARTIAL and ix.next_seq("a") == 6
    assert ix.apply("a", 3, stored(9), replayed=True) is Applied.OLD  # a replay repeats what was applied
    assert ix.depth("a", [9]) == 0
    assert ix.apply("a", 0, stored(2)) is Applied.RESTART  # live, going back: a new engine, cache empty
    assert ix.view("a") is View.FULL and ix.depth("a", [1]) == 0 and ix.depth("a", [2]) == 1
    assert ix.apply("a", 1, stored(3)) is Applied.OK
    assert ix.apply("a", 4, stored(4)) is Applied.GAP
    assert ix.view("a") is View.PARTIAL
    assert ix.apply("a", 5, EventBatch(0.0, (AllBlocksCleared(),), 0)) is Applied.OK
    assert ix.view("a") is View.FULL and ix.size("a") == 0  # cleared: empty, and fully known again


def test_ranks_hold_their_own_blocks() -> None:
    ix = ExactIndex()
    ix.apply("a", 0, stored(1, 2, rank=0))
    ix.apply("a", 1, stored(1, 2, 3, rank=1))
    ix.apply("a", 2, removed(3))
    assert ix.depth("a", [1, 2, 3]) == 3  # rank 1 holds it; the removal was rank 0's
    assert ix.depth("b", [1]) == 0


def test_a_backend_that_prefills_with_no_events_goes_stale_until_events_come_again() -> None:
    clock = Clock()
    ix = ExactIndex(stale_s=10.0, clock=clock)
    ix.apply("a", 0, stored(1))
    ix.scraped("a", 1000.0)
    clock.t += 30
    ix.scraped("a", 1016.0)  # one block prefilled: not yet a sign
    assert ix.view("a") is View.FULL
    ix.scraped("a", 1040.0)  # two blocks and more, 30 s without an event
    assert ix.view("a") is View.STALE
    ix.apply("a", 1, stored(2))
    assert ix.view("a") is View.FULL
    clock.t += 5
    ix.scraped("a", 5000.0)  # within stale_s of the last event
    assert ix.view("a") is View.FULL
    ix.scraped("a", 10.0)  # counters went back: the engine restarted
    clock.t += 30
    ix.scraped("a", 20.0)
    assert ix.view("a") is View.FULL


def test_memory_is_bounded_and_the_oldest_blocks_go_first() -> None:
    ix = ExactIndex(max_blocks=1024)
    for seq in range(10):
        ix.apply("a", seq, stored(*range(seq * 500, seq * 500 + 500)))
    assert ix.size("a") == 1024 and ix.dropped == 5000 - 1024
    assert ix.depth("a", [4999]) == 1 and ix.depth("a", [0]) == 0


def test_a_restart_seen_late_clears_the_backend_and_starts_a_partial_view() -> None:
    ix = ExactIndex()
    ix.apply("a", 0, stored(1))
    ix.apply("a", 1, stored(2))
    assert ix.apply("a", 1, stored(3)) is Applied.RESTART  # the new engine's seq 0 never arrived
    assert ix.view("a") is View.PARTIAL and ix.depth("a", [1]) == 0 and ix.depth("a", [3]) == 1
    ix.restart("a")
    assert ix.next_seq("a") is None and ix.size("a") == 0


def test_forget() -> None:
    ix = ExactIndex()
    ix.apply("a", 0, stored(1))
    ix.forget("a")
    assert ix.view("a") is View.NONE and ix.next_seq("a") is None and ix.last_event("a") is None


def test_a_lookup_reads_the_chain_no_further_than_some_backend_holds_it() -> None:
    ix = ExactIndex()
    ix.apply("a", 0, stored(1, 2, 3))
    ix.apply("b", 0, stored(1, 2))
    read: list[int] = []

    def chain() -> Iterator[int]:
        for h in range(1, 1000):
            read.append(h)
            yield h

    assert ix.depths(["a", "b", "c"], chain()) == {"a": 3, "b": 2, "c": 0}
    assert read == [1, 2, 3, 4]  # block 4 is held nowhere: the other 995 are never hashed
