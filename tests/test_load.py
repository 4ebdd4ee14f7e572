"""A backend's load as the policies see it: scraped gauges, unknown when stale, never zero."""

from kvgate.load import Scraped, spare_capacity, view


def scraped(running: float, waiting: float, kv: float | None, at: float = 100.0, **kw: object) -> Scraped:
    return Scraped(running, waiting, kv, None, None, at, **kw)  # type: ignore[arg-type]


def test_a_fresh_scrape_is_the_load_and_a_stale_one_is_unknown_not_zero() -> None:
    fresh = view(scraped(2, 3, 0.5), now=101.0, stale_after=2.0, unknown_requests=7.0)
    assert (fresh.requests, fresh.waiting, fresh.kv_usage, fresh.known) == (5, 3, 0.5, True)
    stale = view(scraped(0, 0, 0.0), now=103.0, stale_after=2.0, unknown_requests=7.0)
    assert (stale.requests, stale.known) == (7.0, False)
    assert view(None, 0.0, 2.0, 7.0).requests == 7.0


def test_saturation_needs_known_load() -> None:
    assert view(scraped(0, 8, 0.1), 100.0, 2.0, 0.0).saturated(max_waiting=8, max_kv=0.95)
    assert view(scraped(0, 0, 0.96), 100.0, 2.0, 0.0).saturated(max_waiting=8, max_kv=0.95)
    assert not view(scraped(0, 99, 1.0), 200.0, 2.0, 0.0).saturated(max_waiting=8, max_kv=0.95)


def test_requests_waiting_for_kv_blocks_mark_the_backend_short() -> None:
    assert view(scraped(1, 1, 0.9, waiting_for_kv=1), 100.0, 2.0, 0.0).kv_short
    assert not view(scraped(1, 1, 0.9, waiting_for_kv=0), 100.0, 2.0, 0.0).kv_short


def test_the_kv_cache_size_is_its_blocks_times_their_size_and_outlives_a_stale_scrape() -> None:
    """``kv_tokens`` from vllm:cache_config_info (0 where a backend exports none); the size is a
    fixed fact, so a stale scrape keeps it while its load becomes unknown."""
    sized = scraped(1, 0, 0.2, block_size=128, kv_blocks=256)
    assert view(sized, 100.0, 2.0, 0.0).kv_tokens == 32_768
    assert view(sized, 200.0, 2.0, 0.0).kv_tokens == 32_768
    assert view(scraped(1, 0, 0.2), 100.0, 2.0, 0.0).kv_tokens == 0


def test_spare_capacity_falls_with_requests_and_kv_usage() -> None:
    idle = view(scraped(0, 0, 0.0), 100.0, 2.0, 0.0)
    busy = view(scraped(3, 0, 0.5), 100.0, 2.0, 0.0)
    assert spare_capacity(2.0, idle) == 2.0
    assert spare_capacity(2.0, busy) == 2.0 * 0.5 / 4
