"""The backend registry: health from checks and outcomes, metrics that fail, timeouts that never take
out a backend that served or the whole fleet, and ring rebuilds only when the eligible set changes."""

from __future__ import annotations

import asyncio

from kvgate.config import BackendSpec
from kvgate.load import Scraped

from tests.conftest import MODEL
from tests.cores import config, ready, run


def test_health_turns_on_consecutive_failures_and_back_on_successes() -> None:
    async def scenario() -> None:
        sc = ready(config(None), None)
        reg = sc.registry
        v0, _ = reg.peers()
        reg.failure("b1", "refused")
        assert reg.backends["b1"].healthy
        reg.failure("b1", "refused")
        assert not reg.backends["b1"].healthy
        v1, peers = reg.peers()
        assert v1 > v0 and [p.id for p in peers] == ["b0", "b2"]
        now = asyncio.get_running_loop().time()
        reg.scrape_ok("b1", Scraped(0, 0, 0.1, None, None, now))
        assert not reg.backends["b1"].healthy
        reg.scrape_ok("b1", Scraped(0, 0, 0.1, None, None, now))
        assert reg.backends["b1"].healthy and reg.peers()[0] > v1

    run(scenario())


def test_metrics_that_fail_leave_a_backend_healthy_with_its_load_unknown() -> None:
    """A failed /metrics (slow, garbage) is a missing signal: the backend stays in, its load goes
    stale and so unknown, never zero."""

    async def scenario() -> None:
        sc = ready(config(None), None)
        reg = sc.registry
        for _ in range(5):
            reg.load_unknown("b1", "/metrics: no answer within 80 ms")
        assert reg.backends["b1"].eligible and reg.backends["b1"].last_error is not None
        later = asyncio.get_running_loop().time() + 60.0
        assert not reg.snapshot(MODEL, later).nodes["b1"].load.known

    run(scenario())


def test_health_timeouts_take_out_neither_a_backend_that_served_nor_the_whole_fleet() -> None:
    """A health check that times out is no proof of death: a backend that delivered a response
    within ALIVE_S stays in, and timeouts never take out more than outlier ejection may (half of
    three: one). A refusal is proof: it takes a backend out whatever the rest of the fleet does."""

    async def scenario() -> None:
        sc = ready(config(None), None)
        reg = sc.registry
        now = asyncio.get_running_loop().time()
        reg.alive("b0", now)
        for b in ("b0", "b1", "b2"):
            for _ in range(5):
                reg.failure(b, "/health: no answer within 80 ms", timeout=True, now=now + 1)
        eligible = sorted(b for b, s in reg.backends.items() if s.eligible)
        assert "b0" in eligible and len(eligible) == 2, eligible  # b0 served; one of b1, b2 out
        assert sc.metrics.health_kept.labels("b0")._value.get() > 0
        # Later, b0 silent for longer than ALIVE_S: its timeouts still cannot empty the fleet.
        for b in ("b0", "b1", "b2"):
            for _ in range(5):
                reg.failure(b, "/health: no answer within 80 ms", timeout=True, now=now + 60)
        assert len([s for s in reg.backends.values() if s.eligible]) == 2
        for b in ("b0", "b1", "b2"):
            for _ in range(2):
                reg.failure(b, "ClientConnectorError: refused")
        assert not any(s.eligible for s in reg.backends.values())

    run(scenario())


def test_membership_changes_rebuild_the_ring_only_when_the_eligible_set_changes() -> None:
    async def scenario() -> None:
        cfg = config(None)
        sc = ready(cfg, None)
        version = sc.registry.peers_version
        assert not sc.registry.set_membership((b, False) for b in cfg.backends)
        assert sc.registry.peers_version == version
        extra = BackendSpec("b9", "http://127.0.0.1:9")
        assert sc.registry.set_membership([*((b, False) for b in cfg.backends), (extra, False)])
        assert sc.registry.peers_version == version + 1
        assert sc.registry.set_membership([*((b, False) for b in cfg.backends), (extra, True)])  # drained
        assert "b9" not in {p.id for p in sc.registry.peers()[1]}

    run(scenario())


def test_an_engine_that_started_again_starts_a_new_first_byte_fit() -> None:
    """What the gateway learned of a backend's first bytes (``kvgate.first_byte``) goes when its
    engine is new: its counters went back (a restart quicker than the health checks), or it is
    healthy again after failing them (once, though its counters went back too). A scrape whose
    counters grew keeps it."""

    async def scenario() -> None:
        sc = ready(config(None), None)
        reg, fits = sc.registry, sc.service.first_byte
        now = asyncio.get_running_loop().time()

        def taught() -> None:
            for _ in range(5):
                fits.learn("b1", 1000, 0.5)
            assert fits.predict("b1", 1000) is not None

        def scraped(prompt_tokens: float, queries: float) -> Scraped:
            return Scraped(0, 0, 0.1, queries, 0.0, now, prompt_tokens=prompt_tokens)

        reg.scrape_ok("b1", scraped(5_000, 5_000))
        taught()
        reg.scrape_ok("b1", scraped(9_000, 9_000))
        assert fits.predict("b1", 1000) is not None
        reg.scrape_ok("b1", scraped(200, 9_500))  # the prompt-token counter went back
        assert fits.predict("b1", 1000) is None
        taught()
        reg.scrape_ok("b1", scraped(900, 100))  # the prefix-cache counter went back
        assert fits.predict("b1", 1000) is None
        taught()
        reg.failure("b1", "refused")
        reg.failure("b1", "refused")
        assert not reg.backends["b1"].healthy and fits.predict("b1", 1000) is not None
        reg.scrape_ok("b1", scraped(10, 10))  # back with its counters gone back: one restart, not two
        reg.scrape_ok("b1", scraped(20, 20))
        assert reg.backends["b1"].healthy and fits.predict("b1", 1000) is None
        assert reg.metrics.restarts.labels("b1")._value.get() == 3

    run(scenario())
