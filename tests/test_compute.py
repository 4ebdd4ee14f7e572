"""The compute layer in the decision service, in one process: length-bucketed pools with spill, and
the gateway queue's late binding, and the token estimate fed by outcomes (the estimate's own tests:
``test_tokens.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvgate.features import Features
from kvgate.messages import Outcome
from kvgate.queue import QueueTimeout
from kvgate.service import Queued, Routed
from kvgate.sidecar import Sidecar
from kvgate.tokens import DECAY, PRIOR_TOKENS

from tests.cores import MODEL, core, idle


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
    # 30,000 bytes in 10,000 tokens, beside the default ratio's weight (``kvgate.tokens``).
    kept = 1 - DECAY  # the window's sums are added to the decayed prior
    prior = PRIOR_TOKENS * tokens.config.default_bytes_per_token
    assert tokens.ratio(MODEL) == pytest.approx((kept * prior + 30_000) / (kept * PRIOR_TOKENS + 10_000))
    # Routed and never answered (dropped, failed): its bytes never join the counts.
    routed = asyncio.run(sc.service.route(Features(MODEL, None, "none", ("h2",), 90_000), "d2"))
    sc.service.report([Outcome.end("d2", routed.candidates[0].id, 502, False)])
    before = tokens.ratio(MODEL)
    tokens.counted(backend, 30_000.0)
    assert tokens.ratio(MODEL) < before  # 10,000 more tokens and no bytes: the ratio fell


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
    # A plan that is not carried out (an explanation; a waiting request's round) counts no spill.
    assert asyncio.run(sc.service.explain(feats(40_000, "w"))).pool == "short"
    assert sc.metrics.pool_spills.labels("long", "short")._value.get() == 1


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (0.0, ["long", "long", "long", "long"]),
        (2.0, ["long", "long", "short", "short"]),
        (1.0, ["long", "short", "short", "long"]),
    ],
)
def test_a_pool_with_room_spills_once_its_backlog_is_ratio_times_the_other_s(
    ratio: float, expected: list[str]
) -> None:
    """Long prompts of 10,000 tokens each, and room for all of them: without a ratio the long pool
    takes every one; with one, a prompt spills while what it would wait for there (the backlog and
    itself) is more than ratio x what it would in the short pool. At 2: behind two prompts (30,000 >
    2 x 10,000); at 1: behind one, until the short pool holds one on each backend."""
    sc = service(
        ["short", "short", "long"],
        pools={**POOLS, "backlog_ratio": ratio},
        routing={"saturation_prefill_tokens": 10**7},
    )
    pools = []
    for i in range(4):
        r = routed(sc, feats(40_000, f"p{i}"), f"d{i}")
        assert isinstance(r, Routed)
        pools.append(r.pool)
    assert pools == expected
    assert sc.metrics.pool_spills.labels("long", "short")._value.get() == expected.count("short")


def test_when_no_pool_has_room_a_request_still_goes_where_it_waits_for_less() -> None:
    """Every backend saturated (50 requests waiting at each): without a ratio the long pool keeps
    every long prompt, however deep its backlog; with one, a prompt goes where the prefill it would
    wait for is smaller by that ratio, room or not (pools that never starve)."""
    for ratio, expected in ((0.0, ["long"] * 4), (1.0, ["long", "short"])):
        sc = service(["short", "short", "long"], pools={**POOLS, "backlog_ratio": ratio})
        for b in ("b0", "b1", "b2"):
            idle(sc, b, waiting=50)
        pools = []
        for i in range(4):
            r = routed(sc, feats(40_000, f"p{i}"), f"d{i}")
            assert isinstance(r, Routed)
            pools.append(r.pool)
        assert pools[: len(expected)] == expected, ratio  # then: whichever short backend is freer


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


def test_a_cached_prompt_whose_holder_is_busy_goes_back_in_line_behind_a_short_new_one() -> None:
    """Shortest-first orders by the prefill where a prompt is cached. When only a backend without its
    prefix has room, the cached prompt would prefill all of it there: it is put back in line as that
    long prompt, a short new one goes first, and it then leaves for its holder once that has room."""

    async def scenario() -> None:
        sc = service(queue={"enabled": True, "order": "shortest"})
        svc, ledger = sc.service, sc.registry.ledger
        context = tuple(f"ctx{i}" for i in range(15))  # 15 chunks of 512 bytes: 1,920 tokens
        svc.index.record(context, "b0")
        now = ledger.clock()
        ledger.start("busy0", "b0", 5_000, now)  # both backends prefilling long prompts
        ledger.start("busy1", "b1", 5_000, now)
        asked = {
            "cached": await svc.decide(Features(MODEL, None, "none", (*context, "q"), 8_000), "cached"),
            "short": await svc.decide(feats(2_000, "s"), "short"),  # 500 tokens, held nowhere
            "long": await svc.decide(feats(8_000, "l"), "long"),  # 2,000 tokens, held nowhere
        }
        assert all(isinstance(a, Queued) for a in asked.values())
        queue = svc.queue
        assert queue is not None and [w.decision_id for w in queue.in_order()] == ["cached", "short", "long"]
        svc.report([Outcome.first("busy1", "b1")])  # b1 has room; b0, holding the context, has not
        sent = {w.decision_id: r for w, r in await svc.dispatch()}
        assert list(sent) == ["short"]  # the cached one would prefill 2,000 tokens on b1: not first
        assert svc.metrics.queue_reordered._value.get() == 1
        svc.report([Outcome.first("busy0", "b0"), Outcome.first("short", "b1")])
        sent.update({w.decision_id: r for w, r in await svc.dispatch()})
        routes = {did: r.candidates[0].id for did, r in sent.items() if isinstance(r, Routed)}
        assert routes == {"short": "b1", "cached": "b0", "long": "b1"}
        for did, backend in (("busy0", "b0"), ("busy1", "b1"), *routes.items()):
            svc.report([Outcome.end(did, backend, 200, ttft=0.1)])
        assert len(queue) == 0 and sum(ledger.counts.values()) == 0 and sum(ledger.tokens.values()) == 0

    asyncio.run(scenario())
