"""The gateway queue's order and bounds, on a clock the test moves."""

from __future__ import annotations

import pytest
from kvgate import queue as queue_module
from kvgate.config import DispatchOrder, PolicyName, QueueConfig
from kvgate.features import Features
from kvgate.messages import Outcome
from kvgate.queue import GatewayQueue, QueueFull, Waiting


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def queue(**kw: object) -> tuple[GatewayQueue, Clock]:
    clock = Clock()
    return GatewayQueue(QueueConfig(enabled=True, **kw), clock), clock  # type: ignore[arg-type]


def waiting(
    q: GatewayQueue,
    did: str,
    tokens: int = 100,
    priority: int = 0,
    key: str | None = None,
    max_tokens: int = 0,
    tenant: str | None = None,
    addr: str | None = None,
) -> Waiting:
    """A request of 100 prompt tokens; with ``max_tokens`` 0 its cost to its tenant is just those."""
    f = Features(
        "m", None, "none", (), 400, client_key=key, client_addr=addr, max_tokens=max_tokens, tenant=tenant
    )
    w = Waiting(did, f, PolicyName.KVGATE, priority, q.clock(), tokens)
    q.add(w)
    return w


def order(q: GatewayQueue) -> list[str]:
    return [w.decision_id for w in q.in_order()]


def test_fcfs_keeps_arrival_order_within_a_priority_class() -> None:
    q, clock = queue()
    for did, prio in (("a", 0), ("b", 1), ("c", 0), ("d", -1)):
        waiting(q, did, priority=prio)
        clock.t += 1
    assert order(q) == ["d", "a", "c", "b"]


def test_shortest_first_with_ageing_bounds_how_long_a_long_prompt_waits() -> None:
    q, clock = queue(order=DispatchOrder.SHORTEST, ageing_s=10.0)
    waiting(q, "long", tokens=50_000)
    clock.t += 1
    waiting(q, "short", tokens=10)
    waiting(q, "mid", tokens=1_000)
    assert order(q) == ["short", "mid", "long"]
    clock.t += 9.5  # the long one has waited 10.5 s: it goes ahead of every younger request
    waiting(q, "tiny", tokens=1)
    assert order(q) == ["long", "tiny", "short", "mid"]


def test_a_request_placeable_only_where_it_would_prefill_much_more_goes_back_in_line() -> None:
    """Shortest-first by the prefill where a prompt is cached: a cached one that can go now only to a
    backend without its prefix is put back in line as the long prompt it would be there; one that
    would still prefill little, or no more than twice its key, or that aged, leaves as it is. Not
    in the FCFS or fair orders, which do not order by prefill."""
    q, clock = queue(order=DispatchOrder.SHORTEST, ageing_s=10.0)
    cached = waiting(q, "cached", tokens=300)  # 8,000 tokens, all but 300 cached on a busy backend
    waiting(q, "mid", tokens=4_000)
    assert order(q) == ["cached", "mid"]
    assert not q.reorder(cached, 1_500, budget=2_048)  # one step's prefill anywhere: it leaves
    assert not q.reorder(cached, 500, budget=100)  # under twice its key
    assert q.reorder(cached, 8_000, budget=2_048)
    assert cached.tokens == 8_000 and order(q) == ["mid", "cached"]
    assert not q.reorder(cached, 8_000, budget=2_048)  # in its new place it leaves
    clock.t += 10
    late = waiting(q, "late", tokens=300)
    clock.t += 10
    assert not q.reorder(late, 8_000, budget=2_048)  # aged: it goes where it can
    for other in (DispatchOrder.FCFS, DispatchOrder.FAIR):
        q, _ = queue(order=other)
        assert not q.reorder(waiting(q, "cached", tokens=300), 8_000, budget=2_048)


def test_ageing_by_fair_share_lets_a_long_prompt_wait_at_most_a_multiple_of_what_fcfs_would_give() -> None:
    """Dispatching one request a second, a long prompt that joins behind 4 others would wait about 4 s
    first come first served; with ageing_fair_share 2 it goes first once it has waited 8 s, long
    before the fixed 60 s ageing."""
    q, clock = queue(order=DispatchOrder.SHORTEST, ageing_s=60.0, ageing_fair_share=2.0)
    for i in range(60):  # a steady rate of one dispatch a second (the estimate has settled)
        w = waiting(q, f"warm{i}")
        clock.t += 1
        q.dispatched(w)
    for i in range(4):
        waiting(q, f"ahead{i}", tokens=10)
    long = waiting(q, "long", tokens=50_000)
    assert 3.0 < long.fair_s < 5.0  # 4 ahead at about one a second
    clock.t += 0.9 * 2 * long.fair_s
    waiting(q, "short", tokens=5)
    assert order(q)[-1] == "long"  # the four ahead had little FCFS wait to give: they age sooner
    clock.t += 0.2 * 2 * long.fair_s
    assert order(q)[-2:] == ["long", "short"]


def test_a_full_queue_refuses_with_a_retry_after_from_the_dispatch_rate() -> None:
    q, clock = queue(max_size=3)
    ws = [waiting(q, f"w{i}") for i in range(3)]
    with pytest.raises(QueueFull) as refused:
        waiting(q, "late")
    assert refused.value.retry_after == 1  # nothing dispatched yet: no rate to go by
    for w in ws[:2]:  # two dispatches 2 s apart: 0.5 per second, smoothed
        clock.t += 2
        q.dispatched(w)
    assert len(q) == 1
    waiting(q, "x")
    waiting(q, "y")
    with pytest.raises(QueueFull) as refused:
        waiting(q, "z")
    assert 1 < refused.value.retry_after <= 60


def test_expired_removes_exactly_the_requests_that_waited_too_long() -> None:
    q, clock = queue(max_wait_s=5.0)
    waiting(q, "old")
    clock.t += 3
    waiting(q, "young")
    clock.t += 2.5
    assert [w.decision_id for w in q.expired()] == ["old"]
    assert "old" not in q and "young" in q and len(q) == 1
    assert q.remove("young") is not None and q.remove("young") is None and len(q) == 0


def test_one_api_key_holds_at_most_its_share_and_the_others_still_get_in() -> None:
    """A key that floods fills its half of the queue, then its own requests are refused (saying
    whose share is full) while another key's still join; its share frees up as its requests leave
    by any way out (dispatched, expired, removed), and the counts end at zero."""
    q, clock = queue(max_size=10, max_key_share=0.5, max_wait_s=5.0)
    flood = [waiting(q, f"f{i}", key="flood") for i in range(5)]
    with pytest.raises(QueueFull) as refused:
        waiting(q, "f5", key="flood")
    assert refused.value.key == "key:flood"
    other = [waiting(q, f"o{i}", key="other") for i in range(3)]
    anonymous = waiting(q, "anon")  # no key (auth off): only the whole queue bounds it
    assert len(q) == 9 and q.keys_waiting() == 2
    q.dispatched(flood[0])
    waiting(q, "f6", key="flood")  # its share has room again
    assert q.remove("f1") is not None
    clock.t += 6
    expired = q.expired()
    assert {w.decision_id for w in expired} == {w.decision_id for w in [*flood[2:], *other, anonymous]} | {
        "f6"
    }
    assert len(q) == 0 and q.keys_waiting() == 0


def test_a_tenant_header_s_tenant_holds_at_most_its_share_and_addresses_are_not_held_apart() -> None:
    """Behind an edge that names tenants (queue.tenant_header) and checks no keys here, one tenant
    that floods is held to its share as a key is (else it fills the queue and everyone else gets
    429), whatever key it uses; requests known by their address alone share the whole queue."""
    q, _ = queue(max_size=10, max_key_share=0.3)
    for i in range(3):
        waiting(q, f"a{i}", tenant="acme", key=f"k{i}")
    with pytest.raises(QueueFull) as refused:
        waiting(q, "a3", tenant="acme")
    assert refused.value.key == "tenant:acme"
    waiting(q, "g0", tenant="globex")
    for i in range(6):
        waiting(q, f"ip{i}", addr="10.0.0.7")
    assert len(q) == 10 and q.keys_waiting() == 2


def test_fair_order_serves_a_quiet_tenant_ahead_of_one_that_floods() -> None:
    """Tenant a flooded the queue first; tenant b's two requests come later. Virtual finish tags
    interleave them: b's first request goes right after a's first, not after all of a's."""
    q, clock = queue(order=DispatchOrder.FAIR, max_key_share=1.0)
    for i in range(6):
        waiting(q, f"a{i}", key="a")
        clock.t += 0.1
    waiting(q, "b0", key="b")
    waiting(q, "b1", key="b")
    assert order(q)[:4] == ["a0", "b0", "a1", "b1"]


def test_fair_order_counts_the_service_a_tenant_had_recently() -> None:
    """a was served 1,000 tokens just now (routed without waiting): b, served nothing, goes first
    even though it came later; a's service then decays by half each window."""
    q, clock = queue(order=DispatchOrder.FAIR, fair_window_s=10.0)
    q.served("key:a", 1000)
    waiting(q, "a0", key="a")
    clock.t += 1
    waiting(q, "b0", key="b")
    assert order(q) == ["b0", "a0"]
    clock.t += 40  # four half-lives: 62 tokens left, less than b's request
    q.served("key:b", 100)
    assert order(q) == ["a0", "b0"]


def test_fair_order_keeps_priority_classes_and_arrival_order_within_a_tenant() -> None:
    q, clock = queue(order=DispatchOrder.FAIR, max_key_share=1.0)
    waiting(q, "a0", key="a", tokens=10)
    clock.t += 1
    waiting(q, "a1", key="a", tokens=10)
    waiting(q, "urgent", key="b", priority=-1, tokens=10_000)
    assert order(q) == ["urgent", "a0", "a1"]


def test_a_flood_whose_backlog_is_served_after_its_arrivals_stop_stays_past_its_share() -> None:
    """The reserve's test of who is past its share (``past_share``) counts each tenant's recent
    service and what it has waiting at the gateway, whole. A flood that stopped arriving four
    half-lives ago but still has a backlog waiting is past its share; the quiet tenant, whose steady
    service now outweighs the flood's decayed service, is not. As the backlog is dispatched it is
    the flood's recent service, so the flood stays past its share (judged by its arrivals, decayed,
    the quiet tenant was, and waited for the room that backlog took). What leaves unserved
    (removed, expired) counts no more, and as the flood's service decays the quiet tenant's steady
    one is the larger share."""
    q, clock = queue(order=DispatchOrder.FAIR, fair_window_s=10.0, max_key_share=1.0, max_wait_s=40.0)
    flood, quiet = (
        Features("m", None, "none", (), 400, client_key="flood"),
        Features("m", None, "none", (), 400, client_key="quiet"),
    )
    for _ in range(10):  # the flood has 10 requests of 100 tokens served, 20 left waiting
        q.served("key:flood", flood.est_tokens)
    for i in range(20):
        waiting(q, f"f{i}", key="flood")
    q.served("key:quiet", quiet.est_tokens)
    assert q.past_share(flood) and not q.past_share(quiet)
    clock.t += 40  # four half-lives later: the quiet tenant is still served, the flood's backlog waits
    for _ in range(3):
        q.served("key:quiet", quiet.est_tokens)
    assert q.tenants.attained("key:quiet", clock.t) > q.tenants.attained("key:flood", clock.t)
    clock.t += 0.2  # past the active count's refresh
    assert q.past_share(flood) and not q.past_share(quiet)  # its backlog still asks
    for w in q.in_order()[:10]:  # half the backlog is served now
        q.dispatched(w)
        q.served("key:flood", w.features.est_tokens)
    clock.t += 0.2
    assert q.past_share(flood) and not q.past_share(quiet)
    q.remove("f10")
    assert len(q.expired()) == 9 and len(q) == 0  # the rest waited max_wait_s
    assert q._asking == {}
    clock.t += 0.2
    assert q.past_share(flood) and not q.past_share(quiet)  # what it was served still counts
    clock.t += 20  # two half-lives more, the quiet tenant still served
    for _ in range(3):
        q.served("key:quiet", quiet.est_tokens)
    assert q.past_share(quiet) and not q.past_share(flood)


def test_a_tenant_with_requests_waiting_and_none_served_counts_for_the_share() -> None:
    """A flood whose first requests all wait (none served yet) is already the one past its share."""
    q, _ = queue(order=DispatchOrder.FAIR, max_key_share=1.0)
    flood, quiet = (
        Features("m", None, "none", (), 400, client_key="flood"),
        Features("m", None, "none", (), 400, client_key="quiet"),
    )
    q.served("key:quiet", quiet.est_tokens)
    assert not q.past_share(quiet)  # alone
    for i in range(5):
        waiting(q, f"f{i}", key="flood")
    assert q.past_share(flood) and not q.past_share(quiet)


def test_a_tenant_asking_for_long_answers_is_the_one_past_its_share() -> None:
    """A tenant's service counts the output its requests may write (``fair_output_weight`` per
    token): one sending 100-token prompts that ask for 2,000 tokens each is past its share against
    one sending 1,000-token prompts with short answers. Counted by prompts alone it was the other
    way round, and the reserve held back the tenant the long answers crowded out."""
    long_answers = Features("m", None, "none", (), 400, client_key="decodes", max_tokens=2000)
    long_prompts = Features("m", None, "none", (), 4000, client_key="prompts", max_tokens=50)
    for weight, past in ((2.0, long_answers), (0.0, long_prompts)):
        q, clock = queue(order=DispatchOrder.FAIR, fair_output_weight=weight)
        assert q.cost(long_answers) == 100 + round(weight * 2000)
        assert q.cost(long_prompts) == 1000 + round(weight * 50)
        for _ in range(5):
            for f in (long_answers, long_prompts):
                q.served(f"key:{f.client_key}", q.cost(f))
                clock.t += 0.1
        other = long_prompts if past is long_answers else long_answers
        assert q.past_share(past) and not q.past_share(other), weight


def test_a_request_without_max_tokens_costs_the_configured_output() -> None:
    q, _ = queue(order=DispatchOrder.FAIR, fair_output_tokens=300, fair_output_weight=1.5)
    f = Features("m", None, "none", (), 400, completions=2)
    assert q.cost(f) == 100 + round(1.5 * 2 * 300)  # each of its n completions may write 300
    w = waiting(q, "a", key="a", max_tokens=10)
    assert q._asking == {"key:a": 100 + 15}
    q.remove(w.decision_id)
    assert q._asking == {}


def test_a_charge_is_corrected_at_its_end_by_what_the_request_wrote() -> None:
    """A client asking for 4,000 tokens that gets 100 is charged for 100 once its usage comes back,
    and its next requests are charged, when routed, for the share its requests wrote (never under
    1/32 of what they ask); one with no max_tokens that writes 900 is charged 900, not the
    configured 300; a request that never ran (dropped) gives its whole cost back, one its backend
    refused its output; any other end without usage keeps its charge. Every charge leaves at its end
    or drop."""
    q, clock = queue(order=DispatchOrder.FAIR, fair_output_tokens=300, fair_output_weight=2.0)
    generous = Features("m", None, "none", (), 400, client_key="a", max_tokens=4000)
    tenant, cost = q.charge("d1", generous)
    assert tenant == "key:a" and cost == 100 + 8000 and q.tenants.attained("key:a", clock.t) == cost
    q.settle(Outcome.end("d1", "b0", 200, completion_tokens=100))
    assert q.tenants.attained("key:a", clock.t) == 100 + 200
    assert q.cost(generous) == 100 + 2 * 4000 // 32  # 100 of 4,000 is under the floor of 1/32
    unbounded = Features("m", None, "none", (), 400, client_key="b")
    assert q.charge("d2", unbounded)[1] == 100 + 600
    q.settle(Outcome.end("d2", "b0", 200, completion_tokens=900))
    assert q.tenants.attained("key:b", clock.t) == 100 + 1800
    assert q.cost(unbounded) == 100 + 600  # no max_tokens: nothing to take a share of
    q.charge("d3", generous)
    q.settle(Outcome.drop("d3"))
    assert q.tenants.attained("key:a", clock.t) == 300  # as before d3
    for status in (499, 0):  # no usage (the client gone, no answer): the engine may have written
        q.charge("d4", generous)
        q.settle(Outcome.end("d4", "b0", status))
        assert q.tenants.attained("key:a", clock.t) == 300 + 350, status
        q.tenants.correct("key:a", -350, clock.t)
    q.charge("d4", generous)
    q.settle(Outcome.end("d4", "b0", 400))  # refused by its backend: it wrote nothing
    assert q.tenants.attained("key:a", clock.t) == 300 + 100
    assert q.tenants.writes("key:a") == 1 / 32  # and a refusal teaches no share
    q.charge("d4", generous)
    q.settle(Outcome.end("d4", "b0", 502))  # a server error, no usage: its charge stays
    assert q.tenants.attained("key:a", clock.t) == 400 + 350
    q.charge("d5", generous)
    q.settle(Outcome.end("d5", "b0", 200, completion_tokens=2000))  # half: a moving mean moves
    assert q.tenants.attained("key:a", clock.t) == 750 + 100 + 4000
    assert q.tenants.writes("key:a") == 1 / 32 + 0.2 * (0.5 - 1 / 32)
    q.charge("d6", generous)
    q.settle(Outcome.end("d6", "b0", 200, completion_tokens=10**12))  # more than it asked: what it asked
    assert q.tenants.attained("key:a", clock.t) == 4850 + 100 + 8000 and q.tenants.writes("key:a") <= 1.0
    q.settle(Outcome.end("d1", "b0", 200, completion_tokens=1))  # a second end corrects nothing
    assert q.tenants.attained("key:a", clock.t) == 12950 and q.charges() == 0
    # A long request: its charge decayed while it ran, and so does its correction (as if what it
    # wrote had been charged when it was routed).
    q2, clock2 = queue(order=DispatchOrder.FAIR, fair_output_weight=2.0, fair_window_s=10.0)
    q2.charge("long", generous)
    clock2.t += 10.0
    q2.settle(Outcome.end("long", "b0", 200, completion_tokens=100))
    assert abs(q2.tenants.attained("key:a", clock2.t) - (100 + 200) / 2) < 1e-6


def test_charges_are_kept_only_where_the_fair_order_counts_output_and_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = Features("m", None, "none", (), 400, client_key="a", max_tokens=10)
    for kw in ({"order": DispatchOrder.FCFS}, {"order": DispatchOrder.FAIR, "fair_output_weight": 0.0}):
        q, _ = queue(**kw)
        q.charge("d1", f)
        assert q.charges() == 0, kw
    monkeypatch.setattr(queue_module, "MAX_CHARGED", 3)
    q, _ = queue(order=DispatchOrder.FAIR)
    for i in range(5):  # reports can be lost: the oldest charges go first
        q.charge(f"d{i}", f)
    assert list(q._charged) == ["d2", "d3", "d4"]


def test_what_a_waiting_request_asks_is_counted_as_it_joined_so_its_count_comes_back_to_zero() -> None:
    """A tenant's learned share changes while its request waits: the request still takes back, as it
    leaves, what it added as it joined."""
    q, _ = queue(order=DispatchOrder.FAIR, fair_output_weight=1.0)
    f = Features("m", None, "none", (), 400, client_key="a", max_tokens=1000)
    q.charge("d0", f)
    w = waiting(q, "w1", key="a", max_tokens=1000)
    assert q._asking == {"key:a": 100 + 1000}
    q.settle(Outcome.end("d0", "b0", 200, completion_tokens=100))
    assert q.cost(w.features) == 100 + 100
    q.remove(w.decision_id)
    assert q._asking == {}
