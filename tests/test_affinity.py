"""Settling a session alone: two replicas' decisions over one session store (process memory here,
Redis in the process tests) end on one binding, and each outcome is counted by name."""

from __future__ import annotations

import asyncio

from kvgate.affinity import Affinity
from kvgate.config import PolicyName
from kvgate.features import Features
from kvgate.policies import Decision, Reason, Request, SessionAction, decide
from kvgate.sidecar import Sidecar

from tests.cores import MODEL, core


def affinity_counts(sc: Sidecar) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for m in sc.metrics.affinity.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }


def test_the_second_replica_to_claim_a_session_follows_the_first() -> None:
    sc = core()
    settle = Affinity(sc.config, sc.sessions, sc.metrics).settle
    snap = sc.registry.snapshot(MODEL)
    req = Request(Features(MODEL, "s1", "header", (), 400), 1)
    first = Decision(("b0", "b1"), Reason.LOAD, SessionAction.BIND)
    other = Decision(("b1", "b0"), Reason.LOAD, SessionAction.BIND)  # another replica picked b1
    assert asyncio.run(settle("s1", first, req, snap, PolicyName.KVGATE, True)) == first
    again = asyncio.run(settle("s1", other, req, snap, PolicyName.KVGATE, True))
    assert again.candidates[0] == "b0" and again.session is SessionAction.KEEP
    assert affinity_counts(sc) == {"miss": 1.0, "hit": 1.0}


def test_a_kept_binding_fresh_in_the_cache_costs_no_claim_and_a_rebind_moves_it() -> None:
    sc = core()
    settle = Affinity(sc.config, sc.sessions, sc.metrics).settle
    snap = sc.registry.snapshot(MODEL)
    req = Request(Features(MODEL, "s1", "header", (), 400), 1, bound="b0")
    kept = decide(PolicyName.KVGATE, req, snap, 2)
    assert kept.session is SessionAction.KEEP and kept.candidates[0] == "b0"
    assert asyncio.run(settle("s1", kept, req, snap, PolicyName.KVGATE, True)) == kept
    assert sc.sessions.cached("s1") is None  # confirmed: nothing asked of the store
    moved = Decision(("b1", "b0"), Reason.LOAD, SessionAction.REBIND)
    asyncio.run(settle("s1", moved, req, snap, PolicyName.KVGATE, True))
    assert asyncio.run(sc.sessions.peek("s1")) == "b1"
    assert affinity_counts(sc) == {"hit": 1.0, "rebind": 1.0}
