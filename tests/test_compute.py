"""The compute layer's pure parts and the decision service's use of them, in one process: the learned
token estimate, length-bucketed pools with spill, and the gateway queue's late binding."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvgate.config import ConfigError, TokensConfig
from kvgate.features import Features
from kvgate.messages import Outcome
from kvgate.queue import QueueTimeout
from kvgate.service import Queued, Routed
from kvgate.sidecar import Sidecar
from kvgate.tokens import TokenEstimator

from tests.cores import MODEL, core


# -- the token estimate ------------------------------------------------------------------------------
def test_bytes_per_token_is_learned_from_what_each_backend_counted() -> None:
    t = TokenEstimator(TokensConfig())
    assert t.ratio(MODEL) == 4.0  # until something is learned
    t.counted("a", 100.0)  # first sight: the window starts here
    t.served("a", MODEL, 20_000)
    t.counted("a", 100.0 + 10_000)  # 20,000 bytes were 10,000 tokens
    assert t.ratio(MODEL) == pytest.approx(2.0)
    t.served("a", MODEL, 40_000)
    t.counted("a", 10_100.0 + 10_000)  # 4 bytes per token now: smoothed, not jumped to
    assert 2.0 < t.ratio(MODEL) < 4.0


def test_the_ratio_holds_when_reports_and_scrapes_are_out_of_step() -> None:
    """Prompts of 3 bytes per token, 2,000 to 40,000 tokens long; the backend counts each one when
    its prefill ends, and Nginx's first-byte report reaches the sidecar up to a scrape later (or
    earlier than the scrape that reads the count). The learned ratio stays near 3 throughout: it is
    a ratio of sums over the same prompts, not an average of each window's ratio."""
    import random

    rng = random.Random(7)
    t = TokenEstimator(TokensConfig())
    counter = 0.0
    t.counted("a", counter)
    late: list[int] = []  # bytes whose report comes after the next scrape
    seen = []
    for _ in range(400):
        for size in late:
            t.served("a", MODEL, size)
        late = []
        for _ in range(rng.randint(0, 2)):  # prompts whose prefill ended in this window
            tokens = rng.randint(2_000, 40_000)
            counter += tokens
            if rng.random() < 0.5:
                t.served("a", MODEL, 3 * tokens)
            else:
                late.append(3 * tokens)
        t.counted("a", counter)
        if MODEL in t.learned:
            seen.append(t.ratio(MODEL))
    assert len(seen) > 300
    assert all(2.4 < r < 3.6 for r in seen[20:])  # within 20 % once it has a few windows
    assert abs(sum(seen[20:]) / len(seen[20:]) - 3.0) < 0.15


def test_a_prompt_counts_once_its_first_byte_is_reported() -> None:
    """The decision service hands the estimator a prompt's bytes when its first byte comes back (or
    its whole JSON answer), never when it is routed: a backend counts prompt tokens at prefill's
    end, and a routed prompt may wait in its queue for minutes."""
    sc = service()
    f = Features(MODEL, None, "none", ("h30000",), 30_000)
    routed = asyncio.run(sc.service.route(f, "d1"))
    backend = routed.candidates[0].id
    tokens = sc.service.tokens
    tokens.counted(backend, 0.0)
    tokens.counted(backend, 10_000.0)  # a prompt another client sent was counted meanwhile
    assert MODEL not in tokens.learned  # ours is not in that window: it has not prefilled yet
    sc.service.report([Outcome.first("d1", backend)])
    sc.service.report([Outcome.end("d1", backend, 200, True, 0.5, 1.0)])  # counted once, not twice
    tokens.counted(backend, 20_000.0)
    assert tokens.ratio(MODEL) == pytest.approx(30_000 / 10_000)
    # Routed and never answered (dropped, failed): its bytes never join the counts.
    routed = asyncio.run(sc.service.route(Features(MODEL, None, "none", ("h2",), 90_000), "d2"))
    sc.service.report([Outcome.end("d2", routed.candidates[0].id, 502, False)])
    tokens.counted(backend, 30_000.0)
    assert tokens.ratio(MODEL) < 3.0  # 10,000 more tokens and no bytes: only the sums' decay moved


def test_with_several_replicas_each_learns_from_its_share_of_the_counts() -> None:
    """Two replicas each send half the prompts; each sees the whole counter move but only its own
    bytes, so each divides the counted tokens by the replica count."""
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0, replicas=2)
    t.served("a", MODEL, 30_000)  # ours: 10,000 tokens at 3 bytes per token
    t.counted("a", 20_000.0, replicas=2)  # ours and the other replica's, 10,000 tokens each
    assert t.ratio(MODEL) == pytest.approx(3.0)


def test_windows_that_mix_models_or_follow_a_restart_teach_nothing() -> None:
    t = TokenEstimator(TokensConfig())
    t.counted("a", 0.0)
    t.served("a", MODEL, 20_000)
    t.served("a", "other", 20_000)
    t.counted("a", 10_000.0)
    assert t.learned == {}
    t.served("a", MODEL, 20_000)
    t.counted("a", 5.0)  # the counter went back: the backend restarted
    assert t.learned == {}
    t.served("a", MODEL, 100)
    t.counted("a", 105.0)  # 100 tokens: too small a window to trust
    assert t.learned == {}


def test_a_ratio_set_in_the_config_wins_and_bad_ones_are_refused() -> None:
    t = TokenEstimator(TokensConfig.from_mapping({"bytes_per_token": {MODEL: 2.5}}))
    t.counted("a", 0.0)
    t.served("a", MODEL, 40_000)
    t.counted("a", 10_000.0)
    assert t.ratio(MODEL) == 2.5 and t.ratio("other") == 4.0
    for bad in (0, "x", True, 100, float("nan")):
        with pytest.raises(ConfigError, match="bytes_per_token"):
            TokensConfig.from_mapping({"bytes_per_token": {MODEL: bad}})


# -- the decision service with pools and the queue ---------------------------------------------------
def service(labels: list[str] | None = None, **sections: Any) -> Sidecar:
    return core(labels, **sections)


def feats(n_bytes: int, tag: str = "x") -> Features:
    return Features(MODEL, None, "none", (f"{tag}{n_bytes}",), n_bytes)


def routed(sc: Sidecar, f: Features, did: str | None = None) -> Routed | Queued:
    return asyncio.run(sc.service.decide(f, did))


POOLS = {
    "rules": [{"pool": "short", "max_prompt_tokens": 2000}, {"pool": "long"}],
    "spill": {"long": ["short"]},
}


def test_pools_pick_by_estimated_length_and_a_full_pool_spills_in_order() -> None:
    sc = service(["short", "short", "long"], pools=POOLS)
    short = routed(sc, feats(400))
    long = routed(sc, feats(40_000))  # 10,000 tokens
    assert isinstance(short, Routed) and short.pool == "short" and short.candidates[0].id in ("b0", "b1")
    assert isinstance(long, Routed) and long.pool == "long" and [c.id for c in long.candidates] == ["b2"]
    # The long pool has no room now (10,000 tokens awaiting prefill): the next long prompt spills.
    spilled = routed(sc, feats(40_000, "y"))
    assert isinstance(spilled, Routed) and spilled.pool == "short"
    assert sc.metrics.pool_spills.labels("long", "short")._value.get() == 1
    explained = asyncio.run(sc.service.explain(feats(400, "z")))
    assert explained.pool == "short"


def test_a_queued_request_is_bound_when_a_backend_frees_up_and_counts_end_at_zero() -> None:
    async def scenario() -> None:
        sc = service(queue={"enabled": True})
        svc = sc.service
        first = await svc.decide(feats(8000, "a"), "d1")  # 2,000 tokens each: one per backend
        second = await svc.decide(feats(8000, "b"), "d2")
        third = await svc.decide(feats(8000, "c"), "d3")
        assert isinstance(first, Routed) and isinstance(second, Routed)
        assert isinstance(third, Queued) and len(svc.queue or ()) == 1
        assert await svc.dispatch() == []  # nothing freed: it keeps waiting
        svc.report([Outcome.first("d2", second.candidates[0].id)])  # d2's prefill is done
        (w, result), *rest = await svc.dispatch()
        assert not rest and w.decision_id == "d3" and isinstance(result, Routed)
        assert result.candidates[0].id == second.candidates[0].id  # bound where room opened, late
        for did, r in (("d1", first), ("d2", second), ("d3", result)):
            svc.report([Outcome.end(did, r.candidates[0].id, 200, ttft=0.1)])
        assert sum(sc.registry.ledger.counts.values()) == 0 and sum(sc.registry.ledger.tokens.values()) == 0

    asyncio.run(scenario())


def test_a_request_that_waits_too_long_or_whose_client_left_leaves_the_queue_unrouted() -> None:
    async def scenario() -> None:
        sc = service(queue={"enabled": True, "max_wait_ms": 100})
        svc = sc.service
        assert svc.queue is not None
        clock = [0.0]
        svc.queue.clock = lambda: clock[0]
        for i in range(2):
            assert isinstance(await svc.decide(feats(8000, f"busy{i}"), f"busy{i}"), Routed)
        late = await svc.decide(feats(8000, "late"), "late")
        gone = await svc.decide(feats(8000, "gone"), "gone")
        assert isinstance(late, Queued) and isinstance(gone, Queued)
        svc.report([Outcome.drop("gone")])  # its client went away
        assert "gone" not in svc.queue
        clock[0] = 0.2
        ((w, refusal),) = await svc.dispatch()
        assert w.decision_id == "late" and isinstance(refusal, QueueTimeout) and refusal.retry_after >= 1
        assert len(svc.queue) == 0
        assert sorted(sc.registry.ledger.tokens.values()) == [2000, 2000]  # only the two that ran

    asyncio.run(scenario())


def test_a_dropped_waiting_request_ends_its_connections_wait() -> None:
    """Live, a queued request's socket connection awaits its future: a drop report (the client left)
    cancels it, so the connection closes instead of sending heartbeats until it notices."""

    async def scenario() -> None:
        sc = service(queue={"enabled": True})
        svc = sc.service
        svc._wake = asyncio.Event()  # as dispatch_loop sets it: decisions get live futures
        for i in range(2):
            assert isinstance(await svc.decide(feats(8000, f"busy{i}"), f"busy{i}"), Routed)
        queued = await svc.decide(feats(8000, "w"), "w")
        assert isinstance(queued, Queued) and queued.waiting.future is not None
        svc.report([Outcome.drop("w")])
        assert queued.waiting.future.cancelled() and len(svc.queue or ()) == 0

    asyncio.run(scenario())
