"""The decision service with a real Redis: replicas racing for one session agree, a burst of new
sessions spreads while its claims wait, a bound session stays until its backend saturates, and each
candidate's first-byte budget is learned from its answers, and a backend serving none of its credited
prefix is counted as prefilling it."""

from __future__ import annotations

import asyncio
import time

from kvgate.features import Features, extract
from kvgate.load import Scraped
from kvgate.messages import Outcome
from kvgate.policies import SessionAction
from kvgate.redis_client import connect

from tests.cores import MODEL, config, features, ready, run
from tests.helpers import PATIENT_REDIS


def test_two_services_racing_for_a_new_session_agree_on_one_backend(redis_url: str) -> None:
    """The claim race: both replicas decide a new key at once; the first SET NX wins, the other
    re-decides from the winner, and both answer the same backend."""

    async def scenario() -> None:
        cfg = config(redis_url, redis_extra=PATIENT_REDIS)
        ca, cb = connect(cfg.redis), connect(cfg.redis)
        assert ca is not None and cb is not None
        a, b = ready(cfg, ca), ready(cfg, cb)
        for i in range(40):
            f = features(i, session=f"race-{i}")
            # Skew the loads so the two would pick differently if they did not agree through Redis.
            a.registry.ledger.counts.update({"b0": 0, "b1": 9, "b2": 9})
            b.registry.ledger.counts.update({"b0": 9, "b1": 9, "b2": 0})
            ra, rb = await asyncio.gather(a.service.route(f), b.service.route(f))
            assert ra.candidates[0] == rb.candidates[0], i
            actions = {ra.decision.session, rb.decision.session}
            assert SessionAction.BIND in actions, actions  # exactly one claimed it first
        await ca.aclose()
        await cb.aclose()

    run(scenario())


def test_a_burst_of_new_sessions_spreads_while_their_claims_wait_for_redis(redis_url: str) -> None:
    """Ten new conversations decided at once: each waits for its Redis claim, and the decisions made
    meanwhile must count it in flight. Before they did not, and all ten went to the backend that
    looked least loaded when the burst began."""

    async def scenario() -> None:
        cfg = config(redis_url, backends=2)
        client = connect(cfg.redis)
        sc = ready(cfg, client)
        # b0 has a long prefill queued; b1 is idle. Each new prompt is ~8,000 tokens.
        sc.registry.ledger.start("earlier", "b0", 24_000, time.monotonic())
        burst = [features(500 + i, session=f"burst-{i}") for i in range(10)]
        routed = await asyncio.gather(*(sc.service.route(f, f"d{i}") for i, f in enumerate(burst)))
        picks = [r.candidates[0].id for r in routed]
        assert picks.count("b1") < 10, picks  # not all on the one that was idle at the start
        assert picks.count("b0") >= 2, picks
        # What is counted is where they went.
        assert sc.registry.ledger.counts == {"b0": picks.count("b0") + 1, "b1": picks.count("b1")}
        for i, r in enumerate(routed):
            sc.service.report([Outcome.end(f"d{i}", r.candidates[0].id, 200, True, 0.1, 0.2)])
        sc.service.report([Outcome.end("earlier", "b0", 200, True, 0.1, 0.2)])
        assert sc.registry.ledger.counts == {"b0": 0, "b1": 0}
        assert sc.registry.ledger.tokens == {"b0": 0, "b1": 0}
        assert client is not None
        await client.aclose()

    run(scenario())


def test_a_bound_session_is_kept_and_moves_only_when_its_backend_saturates(redis_url: str) -> None:
    async def scenario() -> None:
        cfg = config(redis_url)
        client = connect(cfg.redis)
        sc = ready(cfg, client)
        first = await sc.service.route(features(1, session="s"))
        home = first.candidates[0].id
        again = await sc.service.route(features(1, 2, session="s"))
        assert again.candidates[0].id == home and again.decision.session is SessionAction.KEEP
        sc.registry.scrape_ok(home, Scraped(4, 20, 0.5, None, None, asyncio.get_running_loop().time()))
        sc.registry.changed()
        moved = await sc.service.route(features(1, 3, session="s"))
        assert moved.candidates[0].id != home and moved.decision.session is SessionAction.REBIND
        assert client is not None
        stored = await client.get(f"{cfg.redis.prefix}:s:h:s")
        assert stored.decode() == moved.candidates[0].id
        await client.aclose()

    run(scenario())


def test_each_candidate_gets_a_first_byte_budget_learned_from_its_answers() -> None:
    """A backend that has answered quickly gets the floor; one that never answered, or is saturated,
    the ceiling; a first byte from a fallback (the primary failed) teaches nothing about either."""

    async def scenario() -> None:
        sc = ready(config(None, backends=2, policy="round_robin"), None)
        ceiling, floor = 60_000, 5_000
        first = await sc.service.route(features(0), "d0")
        assert first.first_byte_ms == (ceiling, ceiling)  # nothing learned yet
        sc.service.report([Outcome.first("d0", "other-backend")])  # answered by a fallback
        assert sc.service.first_byte.describe(first.candidates[0].id) is None
        for i in range(1, 20):
            r = await sc.service.route(features(i), f"d{i}")
            sc.service.report([Outcome.first(f"d{i}", r.candidates[0].id)])
            sc.service.report([Outcome.end(f"d{i}", r.candidates[0].id, 200, True, 0.01, 0.02)])
        sc.service.report([Outcome.end("d0", first.candidates[0].id, 200, True, 0.01, 0.02)])
        learned = await sc.service.route(features(50), "d50")
        assert learned.first_byte_ms == (floor, floor)
        busy = learned.candidates[0].id
        sc.registry.scrape_ok(busy, Scraped(4, 20, 0.5, None, None, asyncio.get_running_loop().time()))
        sc.registry.changed()
        again = await sc.service.route(features(51), "d51")
        budgets = dict(zip((c.id for c in again.candidates), again.first_byte_ms, strict=True))
        assert budgets[busy] == ceiling and min(budgets.values()) == floor
        sc.service.report([Outcome.end(d, "", 499, False) for d in ("d50", "d51")])

    run(scenario())


def test_with_the_fair_order_each_tenant_s_service_wait_and_depth_are_counted() -> None:
    """Tenants (API keys) in the queue's metrics: prompt tokens routed, the service charged (prompt
    and output), requests waiting, the wait; the depth is counted from the queue itself, so it is
    back to nothing once the queue is."""
    import dataclasses

    from kvgate.service import Queued
    from prometheus_client import generate_latest

    from tests.cores import core, idle

    async def scenario() -> None:
        sc = core(n=1, queue={"enabled": True, "order": "fair"})
        (backend,) = sc.registry.backends
        first = dataclasses.replace(features(0), client_key="team-a", max_tokens=100)
        routed = await sc.service.decide(first, "d0")
        assert not isinstance(routed, Queued)
        idle(sc, backend, waiting=50)  # saturated: the next one waits
        waiting = await sc.service.decide(dataclasses.replace(features(1), client_key="team-b"), "d1")
        assert isinstance(waiting, Queued)
        text = generate_latest(sc.metrics.registry).decode()
        assert 'kvgate_tenant_queue_depth{tenant="team-b"} 1.0' in text
        assert f'kvgate_tenant_routed_tokens_total{{tenant="team-a"}} {float(first.est_tokens)}' in text
        service = first.est_tokens + 100 * sc.config.queue.fair_output_weight  # its max_tokens weighed
        assert f'kvgate_tenant_service_tokens_total{{tenant="team-a"}} {float(service)}' in text
        idle(sc, backend)
        sc.service.report([Outcome.end("d0", backend, 200, True, 0.1, 0.2)])
        (done,) = await sc.service.dispatch()
        assert done[0].decision_id == "d1"
        text = generate_latest(sc.metrics.registry).decode()
        assert "kvgate_tenant_queue_depth{" not in text  # nothing waits: no series
        assert 'kvgate_tenant_queue_wait_seconds_count{tenant="team-b"} 1.0' in text
        sc.service.report([Outcome.end("d1", backend, 200, True, 0.1, 0.2)])

    run(scenario())


def test_a_tenant_past_its_share_leaves_a_backend_clear_for_the_others() -> None:
    """Two tenants, one flooding: once the flood has had more than half the recent service, its
    requests go only where another backend stays clear of prefill waiting to start (fair_reserve),
    so that the quiet tenant's next request starts at once; the quiet tenant's go as usual. With
    the reserve off, the flood's request takes the last clear backend."""
    import dataclasses

    from kvgate.service import Queued

    from tests.cores import core

    def flood(i: int) -> Features:
        return dataclasses.replace(features(100 + i), client_key="flood")

    async def scenario(reserve: int) -> tuple[bool, bool]:
        sc = core(n=2, queue={"enabled": True, "order": "fair", "fair_reserve": reserve})
        for i in range(3):
            routed = await sc.service.decide(flood(i), f"f{i}")
            assert not isinstance(routed, Queued)
            sc.service.report([Outcome.first(f"f{i}", routed.candidates[0].id)])
        quiet = await sc.service.decide(dataclasses.replace(features(1), client_key="quiet"), "q0")
        assert not isinstance(quiet, Queued)
        sc.service.report([Outcome.first("q0", quiet.candidates[0].id)])
        # One backend has a prompt waiting for prefill, the other is clear.
        sc.registry.ledger.start("earlier", "b0", 3_000, time.monotonic())
        held = isinstance(await sc.service.decide(flood(9), "f9"), Queued)
        counted = sc.metrics.registry.get_sample_value(
            "kvgate_tenant_past_share_queued_total", {"tenant": "flood"}
        )
        assert counted == (1.0 if held else None)
        quiet_held = isinstance(
            await sc.service.decide(dataclasses.replace(features(2), client_key="quiet"), "q1"), Queued
        )
        return held, quiet_held

    assert run(scenario(1)) == (True, False)
    assert run(scenario(0)) == (False, False)


def test_a_quiet_tenant_served_more_than_a_waiting_flood_is_neither_past_its_share_nor_held() -> None:
    """The flood asks for more than the quiet tenant but, its requests waiting at the gateway, has
    been served less. Past its share is judged on the service each had and what it has waiting,
    whole: the quiet tenant is not, the flood is. And a flood's request first in the fair order
    (the least served) that may not take the room it finds holds back only the flood's later
    requests: the quiet tenant's request behind it takes that room. Judged by service alone, the
    quiet tenant was past its share and waited for the reserve; and the flood's request held back
    everyone behind it."""
    import dataclasses

    from kvgate.service import Queued

    from tests.cores import core, idle

    def tenant(key: str, i: int) -> Features:
        return dataclasses.replace(features(i), client_key=key)

    async def scenario() -> None:
        sc = core(n=2, queue={"enabled": True, "order": "fair", "fair_reserve": 1})
        queue = sc.service.queue
        assert queue is not None
        for key, i in (("flood", 100), ("quiet", 1), ("quiet", 2)):
            routed = await sc.service.decide(tenant(key, i), f"{key}{i}")
            assert not isinstance(routed, Queued)
            sc.service.report([Outcome.first(f"{key}{i}", routed.candidates[0].id)])
        for b in ("b0", "b1"):
            idle(sc, b, waiting=50)  # both saturated: what comes now waits
        for i in range(101, 107):
            assert isinstance(await sc.service.decide(tenant("flood", i), f"flood{i}"), Queued)
        assert isinstance(await sc.service.decide(tenant("quiet", 3), "quiet3"), Queued)
        assert queue.tenants.attained("key:quiet", queue.clock()) > queue.tenants.attained(
            "key:flood", queue.clock()
        )
        assert queue.past_share(tenant("flood", 0)) and not queue.past_share(tenant("quiet", 0))
        assert queue.in_order()[0].features.client_key == "flood"
        # Room again, but b0 has a prompt waiting for prefill: the flood may not take b1, the last
        # clear backend; the quiet tenant may.
        for b in ("b0", "b1"):
            idle(sc, b)
        sc.registry.ledger.start("earlier", "b0", 3_000, time.monotonic())
        sent = {w.decision_id: r for w, r in await sc.service.dispatch()}
        assert "quiet3" in sent, sent
        assert len(queue) >= 1 and all(w.features.client_key == "flood" for w in queue.in_order())

    run(scenario())


def test_a_request_goes_where_its_first_byte_is_expected_first_unless_its_session_is_bound() -> None:
    """The policy's pick holds the prompt, but its backend has proved much slower to prefill (a
    smaller GPU, say) with as much queued as the other: the other one is expected to give the first
    byte much sooner even prefilling the whole prompt, so the request goes there (route ``ttft``).
    A bound session stays; with ``ttft_margin`` 1 the pick stands."""
    import dataclasses

    from kvgate.policies import Reason

    from tests.cores import core

    def turn(n: int, session: str | None) -> Features:
        f = features(7, n, session=session)  # without a session: no key, the prefix index decides
        return f if session else dataclasses.replace(f, key=None, key_source="none")

    async def scenario(margin: float, session: str | None) -> tuple[str, Reason]:
        sc = core(n=2, routing={"ttft_margin": margin})
        first = await sc.service.route(turn(1, session), "d0")
        home = first.candidates[0].id
        other = next(b for b in ("b0", "b1") if b != home)
        sc.service.report([Outcome.end("d0", home, 200, True, 0.1, 0.2)])
        for work in (1_000, 2_000, 4_000, 8_000, 16_000):
            sc.service.first_byte.learn(home, work, 0.02 + work / 2_000)
            sc.service.first_byte.learn(other, work, 0.02 + work / 50_000)
        for did, b in (("q0", home), ("q1", other)):
            sc.registry.ledger.start(did, b, 2_000, time.monotonic())
        again = await sc.service.route(turn(2, session), "d1")
        for did, b in (("d1", again.candidates[0].id), ("q0", home), ("q1", other)):
            sc.service.report([Outcome.end(did, b, 200, True, 0.1, 0.2)])
        assert sum(sc.registry.ledger.counts.values()) == 0
        moved = "moved" if again.candidates[0].id != home else "stayed"
        return moved, again.decision.reason

    assert run(scenario(0.2, None)) == ("moved", Reason.TTFT)
    assert run(scenario(1.0, None)) == ("stayed", Reason.PREFIX)
    assert run(scenario(0.2, "bound")) == ("stayed", Reason.SESSION)


def test_a_session_waits_behind_its_backends_queue_when_that_is_sooner_than_prefilling_elsewhere() -> None:
    """Turn 12 of a conversation whose backend holds turn 11, with a prefill queued there past the
    saturation budget: the policy rebinds a session off a saturated backend, where the other would
    prefill the whole prompt again. Both fits alike, the held prompt behind that queue is expected
    first, so the session stays (kept, not rebound; route ``ttft``). A backend out of KV cache is
    left: no figure sees the wait for free blocks. So is a queue under the fair order, where it may
    be a flood the order keeps the other tenants clear of. (Saturated backends were never compared,
    and the session moved in every case.)"""
    from kvgate.policies import Reason

    from tests.cores import core

    async def scenario(home_kv: float, order: str = "") -> tuple[bool, SessionAction, Reason]:
        queue = {"enabled": True, "order": order} if order else {}
        sc = core(n=2, routing={"saturation_prefill_tokens": 512}, queue=queue)
        first = await sc.service.route(features(7, 11, session="chat"), "d0")
        home = first.candidates[0].id
        sc.service.report([Outcome.end("d0", home, 200, True, 0.1, 0.2)])
        for b in ("b0", "b1"):
            for work in (500, 1_000, 2_000, 4_000, 8_000):
                sc.service.first_byte.learn(b, work, 0.01 + work / 20_000)
        sc.registry.ledger.start("q0", home, 800, time.monotonic())  # saturated by its queue
        sc.registry.scrape_ok(home, Scraped(1, 0, home_kv, None, None, time.monotonic()))
        sc.registry.changed()
        again = await sc.service.route(features(7, 12, session="chat"), "d1")
        for did, b in (("d1", again.candidates[0].id), ("q0", home)):
            sc.service.report([Outcome.end(did, b, 200, True, 0.1, 0.2)])
        assert sum(sc.registry.ledger.counts.values()) == 0
        return again.candidates[0].id == home, again.decision.session, again.decision.reason

    assert run(scenario(0.5)) == (True, SessionAction.KEEP, Reason.TTFT)
    assert run(scenario(0.5, "shortest")) == (True, SessionAction.KEEP, Reason.TTFT)
    for kv, order in ((0.97, ""), (0.5, "fair")):
        stayed, session, _ = run(scenario(kv, order))
        assert not stayed and session is SessionAction.REBIND, (kv, order)


def test_a_burst_is_not_all_sent_to_a_backend_whose_fit_expects_it_sooner() -> None:
    """Both fits saw prompts whose first byte did not follow their size (0.03 s on b0 and 0.2 s on
    b1, learned while a neighbour restarted, say, with a slope of 10 ns per token), so neither
    expectation grows by anything worth the name with the prefill queued there. Twelve new short
    prompts at once, far from saturating either backend: b0, expected sooner, takes no more than
    the ordinary load bound allows (it holds none of them), b1 the rest; every count ends at zero.
    (With the holders' bound for every move, b0 took all twelve.)"""
    import math

    from tests.cores import core

    async def scenario() -> list[str]:
        sc = core(n=2, routing={"saturation_prefill_tokens": 32_768})
        for work in (100, 400, 1_600, 200, 800):
            sc.service.first_byte.learn("b0", work, 0.03 + work * 1e-8)  # shown as 0.0 s per 1k
            sc.service.first_byte.learn("b1", work, 0.2 + work * 1e-8)
        went = []
        for i in range(12):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"question {i}: " + "why " * 150}],
            }
            went.append((await sc.service.route(extract(body), f"d{i}")).candidates[0].id)
        for i, b in enumerate(went):
            sc.service.report([Outcome.end(f"d{i}", b, 200, True, 0.1, 0.2)])
        assert sum(sc.registry.ledger.counts.values()) == 0
        return went

    went = run(scenario())
    assert "b1" in went and went.count("b0") <= math.ceil(1.25 * 12 / 2), went


def test_a_backend_expected_late_long_ago_gets_its_share_of_requests_again() -> None:
    """b1 answered in 1 s and b0 in 0.03 s, then both went quiet for five minutes: moves to the
    backend expected sooner no longer follow fits that old (``first_byte.MIN_WEIGHT``), so b1
    gets the requests the policy gives it, and its next answers correct its fit. While the fits
    were fresh, every pick of b1 moved to b0."""
    from kvgate.policies import Reason

    from tests.cores import core

    async def scenario(quiet_s: float) -> list[tuple[str, Reason]]:
        sc = core(n=2, routing={"saturation_prefill_tokens": 32_768})
        now = [1000.0]
        sc.registry.ledger.clock = lambda: now[0]
        for work in (100, 400, 1_600, 200, 800):
            sc.service.first_byte.learn("b0", work, 0.03 + work * 1e-5)
            sc.service.first_byte.learn("b1", work, 1.0 + work * 1e-5)
        now[0] += quiet_s
        went = []
        for i in range(8):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"question {i}: " + "why " * 50}],
            }
            routed = await sc.service.route(extract(body), f"d{i}")
            went.append((routed.candidates[0].id, routed.decision.reason))
            sc.service.report([Outcome.end(f"d{i}", routed.candidates[0].id, 200, True, 0.1, 0.2)])
        assert sum(sc.registry.ledger.counts.values()) == 0
        return went

    fresh, quiet = run(scenario(1.0)), run(scenario(300.0))
    assert {b for b, _ in fresh} == {"b0"} and Reason.TTFT in {r for _, r in fresh}, fresh
    assert "b1" in {b for b, _ in quiet} and Reason.TTFT not in {r for _, r in quiet}, quiet


def test_a_backend_that_serves_none_of_its_credited_prefix_is_counted_as_prefilling_it() -> None:
    """The index credits the backend with the prompt it was sent before; its scrapes say its cache
    served none of it (evicted, say): the prefill this gateway counts there (the in-flight ledger
    the policies and the SLO's predictions read) comes back to the whole prompt."""

    async def scenario() -> None:
        sc = ready(config(None, backends=1), None)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]}
        f = extract(body)
        now = asyncio.get_running_loop().time()
        first = await sc.service.route(f, "d0")
        b = first.candidates[0].id
        sc.service.report([Outcome.end("d0", b, 200, True, 0.01, 0.02)])
        credited = await sc.service.route(f, "d1")
        trusting = sc.registry.ledger.tokens[b]
        assert trusting < f.est_tokens // 10  # the index says the backend holds it: little to prefill
        sc.service.report([Outcome.end("d1", b, 200, True, 0.01, 0.02)])
        for i in range(2, 14):
            # Each scrape: the engine was asked for the prompt's tokens and served none from cache.
            sc.registry.scrape_ok(b, Scraped(0, 0, 0.1, i * f.est_tokens, 0, now + i))
            await sc.service.route(f, f"d{i}")
            sc.service.report([Outcome.end(f"d{i}", b, 200, True, 0.01, 0.02)])
        assert sc.registry.ledger.tokens.get(b, 0) == 0  # every decision ended
        await sc.service.route(f, "d14")
        assert sc.registry.ledger.tokens[b] == f.est_tokens
        assert credited.reuse[1] > 0
        sc.service.report([Outcome.end("d14", b, 200, True, 0.01, 0.02)])

    run(scenario())


def test_a_long_prompt_waits_its_gather_time_so_a_short_one_arriving_with_it_goes_first() -> None:
    """``queue.gather_ms``: a prompt too long to share a step waits that long before it is placed,
    so the short one of the same burst is answered first; the dispatcher looks again when the wait
    is over (not at its next tick). With 0 the long one is placed at once."""
    from kvgate.service import Queued

    from tests.cores import core

    def prompt(n_bytes: int) -> Features:
        return Features(MODEL, None, "none", (f"p{n_bytes}",), n_bytes)

    async def scenario(gather_ms: int) -> list[str]:
        sc = core(n=1, queue={"enabled": True, "order": "shortest", "gather_ms": gather_ms})
        loop = asyncio.create_task(sc.service.dispatch_loop(tick_s=30.0))
        await asyncio.sleep(0)  # the loop is listening
        started = time.monotonic()
        asked = {
            "long": await sc.service.decide(prompt(40_000), "long"),  # 10,000 tokens: over the budget
            "short": await sc.service.decide(prompt(800), "short"),
        }
        order = [name for name, answer in asked.items() if not isinstance(answer, Queued)]
        assert len(order) == 1  # the other does not fit beside it: it waits for its first byte
        sc.service.report([Outcome.first(order[0], "b0")])
        later = next(a for a in asked.values() if isinstance(a, Queued))
        assert isinstance(later, Queued) and later.waiting.future is not None
        await asyncio.wait_for(later.waiting.future, 2.0)  # dispatched well before the next tick
        order.append(later.decision_id)
        if gather_ms:
            assert time.monotonic() - started >= gather_ms / 1000
        for did in ("long", "short"):
            sc.service.report([Outcome.end(did, "b0", 200, True, 0.1, 0.2)])
        loop.cancel()
        assert sum(sc.registry.ledger.counts.values()) == 0 and len(sc.service.queue or ()) == 0
        return order

    assert run(scenario(50)) == ["short", "long"]
    assert run(scenario(0)) == ["long", "short"]
