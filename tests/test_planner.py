"""The planner alone: what a decision would be, written nowhere; how Nginx gets it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from kvgate.config import PolicyName
from kvgate.expected import to_front
from kvgate.features import Features
from kvgate.kv_events import BlockStored, EventBatch
from kvgate.kv_hashes import chain
from kvgate.load import Scraped
from kvgate.planner import Plan
from kvgate.policies import Reason
from kvgate.sidecar import Sidecar

from tests.cores import MODEL, core, idle

POOLS = {
    "rules": [{"pool": "short", "max_prompt_tokens": 2000}, {"pool": "long"}],
    "spill": {"long": ["short"]},
}


def feats(n_bytes: int, key: str | None = None) -> Features:
    return Features(MODEL, key, "header" if key else "none", (f"x{n_bytes}",), n_bytes)


def plan(sc: Sidecar, f: Features, policy: PolicyName = PolicyName.KVGATE, dry_run: bool = False) -> Plan:
    return asyncio.run(sc.service.planner.plan(f, policy, 1, dry_run))


def test_a_plan_writes_nothing() -> None:
    sc = core()
    p = plan(sc, feats(4_000, key="s1"))
    assert p.decision.candidates[0] in ("b0", "b1") and p.pool is None and p.decode == ()
    assert len(sc.registry.ledger) == 0  # nothing counted in flight
    assert sc.sessions.cached("s1") is None  # nothing bound
    assert sc.index.sizes()["prefix_index_blocks"] == 0  # nothing recorded


def test_a_long_prompt_plans_in_its_pool_and_spills_when_the_pool_is_full() -> None:
    sc = core(["short", "short", "long"], pools=POOLS)
    long = plan(sc, feats(40_000))  # 10,000 estimated tokens
    assert (long.pool, long.decision.candidates[0]) == ("long", "b2")
    idle(sc, "b2", waiting=50)  # the long pool has no room: spill to short
    spilled = plan(sc, feats(40_000))
    assert spilled.pool == "short" and spilled.decision.candidates[0] in ("b0", "b1")


def test_a_request_waits_only_when_no_backend_it_may_use_has_room() -> None:
    sc = core()
    idle(sc, "b0", waiting=50)
    p = plan(sc, feats(4_000), PolicyName.CONSISTENT_HASH)
    assert not sc.service.planner.must_wait(p)  # b1 has room, whichever the ring picked
    idle(sc, "b1", waiting=50)
    full = plan(sc, feats(4_000), PolicyName.CONSISTENT_HASH)
    assert sc.service.planner.must_wait(full)


def test_a_long_prompt_goes_where_no_prefill_waits_and_waits_when_none_is_clear() -> None:
    """Beside a short prompt waiting for prefill, a long one would take the engine's step with it
    (the short one answered only when the long one's chunk is done): the long one goes to a backend
    with nothing waiting, and when every backend has something waiting it waits at the gateway; a
    short one that fits beside goes."""
    sc = core(n=2)  # a prefill budget of 1,000 tokens
    pick = plan(sc, feats(40_000)).decision.candidates[0]  # 10,000 estimated tokens
    other = "b1" if pick == "b0" else "b0"
    sc.registry.ledger.start("short", pick, 300, time.monotonic())
    # Whatever made the policy pick it (a prefix, a bound elsewhere), placement sees the prefill.
    p = plan(sc, feats(40_000))
    picked = dataclasses.replace(p, decision=to_front(p.decision, pick, Reason.RING))
    moved = sc.service.planner._placed(picked, PolicyName.KVGATE)
    assert (moved.decision.candidates[0], moved.decision.reason) == (other, Reason.TTFT)
    assert not sc.service.planner.must_wait(moved)
    sc.registry.ledger.start("short2", other, 300, time.monotonic())
    assert sc.service.planner.must_wait(plan(sc, feats(40_000)))
    assert not sc.service.planner.must_wait(plan(sc, feats(2_000)))  # 500 tokens fit beside 300


def test_a_prompt_goes_where_the_kv_cache_can_hold_it() -> None:
    """A pick whose KV cache, at its last scrape, has no free blocks for the part of the prompt it
    would prefill gives way to a backend that has (vLLM would hold the prompt, or start it and
    preempt it, until blocks free); no move goes to a backend without them; with none that can, the
    pick stays. Each backend's cache here: 100 blocks of 128 tokens, 12,800 tokens."""
    sc = core(n=2)

    def scrape(backend: str, kv: float) -> None:
        sc.registry.scrape_ok(
            backend, Scraped(0, 0, kv, None, None, time.monotonic(), block_size=128, kv_blocks=100)
        )
        sc.registry.changed()

    def placed(pick: str) -> tuple[str, Reason]:
        p = plan(sc, feats(40_000))  # 10,000 estimated tokens
        picked = dataclasses.replace(p, decision=to_front(p.decision, pick, Reason.RING))
        d = sc.service.planner._placed(picked, PolicyName.KVGATE).decision
        return d.candidates[0], d.reason

    scrape("b0", 0.5)  # 6,400 tokens free
    scrape("b1", 0.1)  # 11,520 free
    assert plan(sc, feats(40_000)).snap.holds("b1", 10_000)
    assert placed("b0") == ("b1", Reason.TTFT)
    assert placed("b1") == ("b1", Reason.RING)
    # b0 now has a prompt waiting for prefill: a move would suit it, but b1 cannot hold the prompt.
    scrape("b1", 0.5)
    scrape("b0", 0.1)
    sc.registry.ledger.start("short", "b0", 300, time.monotonic())
    assert placed("b0") == ("b0", Reason.RING)
    scrape("b0", 0.5)  # neither can: the pick stays
    assert placed("b0") == ("b0", Reason.RING)


def test_disaggregated_the_candidates_are_decoders_and_the_prefill_leg_rides_along() -> None:
    sc = core(["prefill", "decode", "decode"], disaggregation={"models": ["*"], "label": "pool"})
    p = plan(sc, feats(8_000))
    assert p.decision.candidates[0] == "b0" and set(p.decode) == {"b1", "b2"}
    routed = sc.service.planner.routed("d1", PolicyName.KVGATE, p, 0)
    assert [c.id for c in routed.prefill] == ["b0"] and {c.id for c in routed.candidates} == {"b1", "b2"}
    assert routed.label.startswith("pd/") and len(routed.first_byte_ms) == len(routed.candidates)


def exact_feats(tokens: list[int]) -> Features:
    return Features(MODEL, None, "none", (), len(tokens) * 4, token_ids=tuple(tokens))


def test_the_exact_index_sends_a_prompt_to_the_backend_whose_events_say_it_holds_it() -> None:
    sc = core(n=3)
    tokens = list(range(4_000))
    held = chain(tokens, 16)
    sc.exact.apply("b0", 0, EventBatch(0.0, (BlockStored(tuple(held[:10]), None, 16),), 0))
    sc.exact.apply("b1", 0, EventBatch(0.0, (BlockStored(tuple(held[:200]), None, 16),), 0))
    sc.exact.apply("b2", 0, EventBatch(0.0, (), 0))  # a stream, nothing stored: block size unknown
    p = plan(sc, exact_feats(tokens))
    assert p.decision.candidates[0] == "b1"
    assert p.req.prefix_depth["b1"] == 200 * 16 * 4 // 512 and p.req.prefix_depth["b0"] == 10 * 16 * 4 // 512
    assert "b2" not in p.req.prefix_depth  # no view of it: the approximate index speaks for it
    # What the index says the decision can reuse: on the best backend, on the chosen one (the same).
    assert sc.service.planner.routed("d", PolicyName.KVGATE, p, 0).reuse == (200 * 16, 200 * 16)
    # Without token ids the same request is looked up approximately, and nothing is known.
    assert plan(sc, Features(MODEL, None, "none", (), 16_000)).req.prefix_depth == {}


def test_a_partial_view_takes_the_deeper_of_the_two_indexes() -> None:
    sc = core(n=2)
    tokens = list(range(4_000))
    sc.exact.apply("b0", 7, EventBatch(0.0, (BlockStored(tuple(chain(tokens, 16)[:5]), None, 16),), 0))
    p = plan(sc, exact_feats(tokens))
    assert p.req.prefix_depth["b0"] == 5 * 16 * 4 // 512  # partial (joined at 7): still counts


def test_a_prefix_pushed_out_of_a_backends_cache_no_longer_counts_as_held() -> None:
    evicted = pushed_out(core())
    assert evicted == [{"b0": 8}, {"b0": 5}, {}]  # its tail went first, then all of it
    # Off (a backend whose cache outlives its GPU memory): the index is trusted as it is.
    kept = pushed_out(core(routing={"saturation_prefill_tokens": 1000, "prefix_eviction": False}))
    assert kept == [{"b0": 8}] * 3


def test_a_prefix_on_a_backend_whose_engine_started_again_no_longer_counts_as_held() -> None:
    """Its counters went back (``Registry.started_again``): the new engine's cache is empty."""
    sc = core()
    sc.registry.scrape_ok("b0", Scraped(0, 0, 0.1, 100.0, 0.0, time.monotonic(), kv_blocks=64, block_size=16))
    f = Features(MODEL, None, "none", tuple(f"a{i}" for i in range(8)), 8 * 512)
    sc.index.record(f.hashes, "b0")
    sc.service.planner.count_routed(f, 0, "b0")
    assert plan(sc, f).req.prefix_depth == {"b0": 8}
    sc.registry.scrape_ok("b0", Scraped(0, 0, 0.1, 3.0, 0.0, time.monotonic(), kv_blocks=64, block_size=16))
    sc.registry.changed()
    assert plan(sc, f).req.prefix_depth == {}


def pushed_out(sc: Sidecar) -> list[dict[str, int]]:
    """What b0 holds of an 8-chunk prompt the index has, after it, then after 3 and 5 more chunks
    are sent into b0's 8-chunk cache."""
    planner = sc.service.planner
    # b0's cache: 64 blocks of 16 tokens, 8 chunks of 512 bytes at 4 bytes per token.
    sc.registry.scrape_ok("b0", Scraped(0, 0, 0.1, None, None, time.monotonic(), kv_blocks=64, block_size=16))
    sc.registry.changed()

    def sent(name: str, n: int) -> Features:
        f = Features(MODEL, None, "none", tuple(f"{name}{i}" for i in range(n)), n * 512)
        sc.index.record(f.hashes, "b0")
        planner.count_routed(f, 0, "b0")
        return f

    a = sent("a", 8)
    held = [plan(sc, a).req.prefix_depth]
    sent("x", 3)
    held.append(plan(sc, a).req.prefix_depth)
    sent("y", 5)
    held.append(plan(sc, a).req.prefix_depth)
    if not held[-1]:  # the index still has it, the cache not: the queue's key is the whole prompt
        assert planner.least_prefill(plan(sc, a)) == a.est_tokens
    return held
