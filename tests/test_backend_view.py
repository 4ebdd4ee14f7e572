"""``/v1/backends`` (``kvgate.backend_view``): each backend's registry state beside what the decision
service learned of it."""

from __future__ import annotations

import time

from kvgate.backend_view import describe
from kvgate.load import Scraped

from tests.cores import core


def test_each_backend_shows_its_state_load_and_what_was_learned_of_it() -> None:
    sc = core(n=2)
    now = time.monotonic()
    sc.registry.scrape_ok("b0", Scraped(3, 1, 0.25, None, None, now, kv_blocks=64, block_size=16))
    for _ in range(5):
        sc.service.first_byte.learn("b0", 1000, 0.2)
    for _ in range(sc.registry.scrape.unhealthy_after):
        sc.registry.failure("b1", "refused")
    b0, b1 = describe(sc.registry, sc.service, now)
    assert (b0["id"], b0["state"], b1["id"], b1["state"]) == ("b0", "healthy", "b1", "unhealthy")
    assert b0["load"] == {
        "known": True,
        "requests": 4,
        "waiting": 1,
        "kv_usage": 0.25,
        "waiting_for_kv": None,
    }
    assert b0["cache"] == {"block_size": 16, "blocks": 64} and b1["cache"] is None
    assert b0["first_byte"]["samples"] == 5 and b1["first_byte"] is None  # type: ignore[index]
    assert b1["last_error"] == "refused" and b0["inflight"] == 0
