"""The share of a credited prefix a backend serves: its scraped hit rate against the credited one."""

from kvgate.features import Features
from kvgate.load import Scraped
from kvgate.realized import MIN_PROMPT, Realized


def scraped(at: float, queries: float, hits: float) -> Scraped:
    return Scraped(0, 0, None, queries, hits, at)


def feat(prompt_bytes: int) -> Features:
    return Features("m", None, "none", (), prompt_bytes)


def served(intervals: int, credited: int, hits: int) -> tuple[Realized, float]:
    """A backend marked at a first scrape, then ``intervals`` scrapes each after 10k prompt tokens
    routed with ``credited`` of them credited, the engine serving ``hits`` of 10k queried."""
    r = Realized()
    r.routed("b", 0, 0)
    r.share("b", scraped(0, 0, 0))
    share = 1.0
    for i in range(1, intervals + 1):
        r.routed("b", 10_000, credited)
        share = r.share("b", scraped(i, i * 10_000, i * hits))
    return r, share


def test_unknown_until_a_window_of_traffic_and_two_scrapes() -> None:
    r = Realized()
    assert r.share("b", scraped(1, 0, 0)) == 1.0  # never routed there
    r.routed("b", MIN_PROMPT, MIN_PROMPT // 2)
    assert r.share("b", scraped(1, 0, 0)) == 1.0  # the first scrape only sets the mark
    r.routed("b", MIN_PROMPT, MIN_PROMPT // 2)
    assert r.share("b", scraped(1, 0, 0)) == 1.0  # the same scrape again: nothing new to fold


def test_a_backend_serving_a_fifth_of_what_the_index_credits() -> None:
    r, share = served(39, 5_000, 1_000)  # half of each prompt credited, 10 % served
    assert abs(share - 0.2) < 1e-9
    # What the gateway counts it will prefill there: the uncredited part, plus 80 % of the credited.
    f = feat(40_000)  # 10,000 tokens at 4 bytes each
    assert f.est_tokens == 10_000
    assert r.uncached(f, 0, "b", None) == 10_000  # nothing credited: nothing to scale
    held_half = 5_000 * 4 // 512  # chunks of 512 bytes covering about half the prompt
    plain = 10_000 - held_half * 512 // 4
    assert r.uncached(f, held_half, "b", None) == 10_000 - round(0.2 * (10_000 - plain))


def test_a_backend_serving_more_than_credited_is_trusted_as_credited() -> None:
    _, share = served(9, 1_000, 9_000)
    assert share == 1.0


def test_a_restarted_engine_starts_a_new_mark_and_a_removed_backend_is_forgotten() -> None:
    r, _ = served(9, 5_000, 2_500)
    assert abs(r.share("b", None) - 0.5) < 1e-9
    r.routed("b", 10_000, 5_000)
    assert abs(r.share("b", scraped(10, 500, 0)) - 0.5) < 1e-9  # counters went back: only the mark
    r.routed("b", 10_000, 5_000)
    assert abs(r.share("b", scraped(11, 10_500, 2_500)) - 0.5) < 1e-9  # folds from the new mark
    r.forget({"other"})
    assert len(r) == 0 and r.share("b", None) == 1.0


def test_the_share_of_a_backends_prompts_this_gateway_sent() -> None:
    r, _ = served(9, 5_000, 2_500)  # the engine took what this gateway sent: all of it its own
    assert r.own("b") == 1.0
    r2 = Realized()
    r2.routed("b", 0, 0)
    r2.share("b", scraped(0, 0, 0))
    for i in range(1, 10):  # another replica sends as much again
        r2.routed("b", 10_000, 0)
        r2.share("b", scraped(i, i * 20_000, 0))
    assert abs(r2.own("b") - 0.5) < 1e-9
    assert Realized().own("b") == 1.0  # unknown
