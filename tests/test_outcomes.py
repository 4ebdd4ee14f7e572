"""Outcome reports applied alone: each kind changes what it owns and nothing else, and every count
a decision raised is back at zero once its one end or drop is in."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from kvgate.features import Features, session_key
from kvgate.messages import Outcome

from tests.cores import MODEL, core


def feats(i: int) -> Features:
    return Features(MODEL, None, "none", (f"x{i}",), 8_000)


def test_first_byte_ends_the_prefill_share_and_end_the_request() -> None:
    sc = core()
    r = asyncio.run(sc.service.route(feats(1), "d1"))
    b = r.candidates[0].id
    assert sc.registry.ledger.tokens[b] == 2_000 and sc.registry.ledger.counts[b] == 1
    sc.service.outcomes.apply([Outcome.first("d1", b)])
    assert sc.registry.ledger.tokens[b] == 0 and sc.registry.ledger.counts[b] == 1
    sc.service.outcomes.apply([Outcome.end("d1", b, 200, True, 0.2, 1.0)])
    assert sc.registry.ledger.counts[b] == 0 and len(sc.registry.ledger) == 0


def test_a_try_counts_against_its_backend_alone_and_a_drop_ends_its_decision() -> None:
    sc = core(outlier={"consecutive": 2})
    r = asyncio.run(sc.service.route(feats(2), "d2"))
    sc.service.outcomes.apply([Outcome.tried("b0", 502), Outcome.tried("b0", 502)])
    assert not sc.registry.snapshot(MODEL).nodes.get("b0")  # ejected after two failures
    assert len(sc.registry.ledger) == 1  # the decision is still in flight
    sc.service.outcomes.apply([Outcome.drop("d2")])
    assert len(sc.registry.ledger) == 0 and sum(sc.registry.ledger.counts.values()) == 0
    assert r.candidates


def test_a_response_id_binds_the_next_turn_to_the_backend_that_stores_it() -> None:
    sc = core()
    asyncio.run(sc.service.route(feats(3), "d3"))
    sc.service.outcomes.apply([Outcome.first("d3", "b1", response_id="resp_abc")])
    assert asyncio.run(sc.sessions.peek(session_key("r", "resp_abc"))) == "b1"
    sc.service.outcomes.apply([Outcome.end("d3", "b1", 200)])
    assert len(sc.registry.ledger) == 0


def test_cached_tokens_an_engine_reports_count_as_delivered_reuse() -> None:
    sc = core()
    r = asyncio.run(sc.service.route(feats(3), "d3"))
    b = r.candidates[0].id
    sc.service.outcomes.apply([Outcome.end("d3", b, 200, True, 0.2, 1.0, cached_tokens=1_024)])
    sc.service.outcomes.apply([Outcome.end(None, b, 500, False, None, 0.1, cached_tokens=99)])  # no answer
    got = sc.metrics.registry.get_sample_value("kvgate_route_reuse_tokens_total", {"kind": "delivered"})
    assert got == 1_024


def test_a_responses_turn_ahead_of_its_previous_responses_report_waits_for_it() -> None:
    """A client may send the next turn within milliseconds of the response it continues, before
    that response's first-byte report has reached the sidecar: the decision waits briefly for the
    report instead of placing the turn where load says (a backend without the response: 404)."""

    async def scenario() -> None:
        sc = core()
        key = session_key("r", "resp_late")
        f = Features(MODEL, key, "response", (), 100)
        guess = (await sc.service.explain(f)).candidates[0].id
        home = next(b for b in ("b0", "b1") if b != guess)
        loop = asyncio.get_running_loop()
        loop.call_later(
            0.005, sc.service.outcomes.apply, [Outcome.first("d0", home, response_id="resp_late")]
        )
        routed = await sc.service.route(f, "d1")
        assert routed.candidates[0].id == home
        # A response no backend reported: decided after the bounded wait, where load says.
        t0 = loop.time()
        other = await sc.service.route(
            Features(MODEL, session_key("r", "resp_none"), "response", (), 100), "d2"
        )
        assert other.candidates and loop.time() - t0 < 0.5
        waits = {
            r: sc.metrics.registry.get_sample_value("kvgate_response_binding_waits_total", {"result": r})
            for r in ("found", "unknown")
        }
        assert waits == {"found": 1.0, "unknown": 1.0}
        for did, b in (("d1", home), ("d2", other.candidates[0].id)):
            sc.service.outcomes.apply([Outcome.end(did, b, 200)])
        assert len(sc.registry.ledger) == 0

    asyncio.run(scenario())


def test_in_the_fair_order_a_tenant_is_charged_what_its_requests_wrote() -> None:
    """Routed asking for 4,000 tokens, a request charges its tenant for them; its end, with the
    usage Nginx read, brings the charge to what it wrote; the Prometheus gauge says so, and the
    map of charges is empty again. The share it wrote is what the tenant's next request counts."""
    # An hour's half-life: what decays while the test runs is bounded by the time it took (a
    # loaded machine may take a second between two lines), not by a guess.
    half_life_s = 3_600
    queue_cfg = {
        "enabled": True,
        "order": "fair",
        "fair_output_weight": 2,
        "fair_window_ms": half_life_s * 1000,
    }
    sc = core(queue=queue_cfg)
    f = dataclasses.replace(feats(4), client_key="team-a", max_tokens=4_000)
    t0 = time.monotonic()

    def kept() -> float:  # the share of a charge left after the test's time so far
        return math.exp2(-(time.monotonic() - t0) / half_life_s)

    r = asyncio.run(sc.service.route(f, "d4"))
    queue = sc.service.queue
    assert queue is not None and sc.service.sizes()["tenant_charges_awaiting_end"] == 1

    def attained() -> float | None:
        return sc.metrics.registry.get_sample_value("kvgate_tenant_attained_tokens", {"tenant": "team-a"})

    charged = attained()
    assert charged is not None and (f.est_tokens + 8_000) * kept() <= charged <= f.est_tokens + 8_000
    sc.service.outcomes.apply(
        [Outcome.end("d4", r.candidates[0].id, 200, True, 0.2, 1.0, completion_tokens=400)]
    )
    now = attained()
    assert now is not None and (f.est_tokens + 800) * kept() <= now <= f.est_tokens + 800
    assert sc.service.sizes()["tenant_charges_awaiting_end"] == 0 and len(sc.registry.ledger) == 0
    # Its next request is charged, and counted in its backend's KV mark, as writing the share of its
    # max_tokens the first one wrote (400 of 4,000), not all of them.
    f2 = dataclasses.replace(f, hashes=("y4",))
    asyncio.run(sc.service.route(f2, "d5"))
    assert queue.cost(f2) == f2.est_tokens + 2 * 400
    assert sc.registry.ledger._entries["d5"].output == 400


def test_a_request_nginx_routed_on_its_own_is_charged_to_its_tenant_when_it_ends() -> None:
    """A fail-open request had no decision to charge it: its end, carrying its key's name and its
    usage, charges its tenant then, as a routed one is charged (prompt, plus output at the weight),
    and counts it by tenant. An end without usage charges no service but is still counted."""
    sc = core(queue={"enabled": True, "order": "fair", "fair_output_weight": 2, "fair_window_ms": 3_600_000})
    t0 = time.monotonic()
    sc.service.outcomes.apply(
        [
            Outcome.end(
                None, "b0", 200, True, 0.1, 0.5, prompt_tokens=300, completion_tokens=40, client_key="team-a"
            ),
            Outcome.end(None, "b1", 502, False, None, 0.1, client_key="team-a"),
            Outcome.end(None, "b1", 200, True, None, 0.5, prompt_tokens=50, completion_tokens=5),
            # A tenant header names the tenant over the key (queue.tenant_header).
            Outcome.end(
                None,
                "b0",
                200,
                True,
                None,
                0.5,
                prompt_tokens=20,
                completion_tokens=1,
                client_key="team-a",
                tenant="acme",
            ),
        ]
    )
    sample = sc.metrics.registry.get_sample_value
    attained = sample("kvgate_tenant_attained_tokens", {"tenant": "team-a"})
    kept = math.exp2(-(time.monotonic() - t0) / 3_600)
    assert attained is not None and 380 * kept <= attained <= 380
    assert sample("kvgate_tenant_service_tokens_total", {"tenant": "team-a"}) == 380
    assert sample("kvgate_tenant_service_tokens_total", {"tenant": "anonymous"}) == 60
    assert sample("kvgate_failopen_ends_total", {"tenant": "team-a"}) == 2
    assert sample("kvgate_failopen_ends_total", {"tenant": "anonymous"}) == 1
    assert sample("kvgate_failopen_ends_total", {"tenant": "acme"}) == 1
    assert sample("kvgate_tenant_service_tokens_total", {"tenant": "acme"}) == 22
    assert len(sc.registry.ledger) == 0 and sc.service.sizes()["tenant_charges_awaiting_end"] == 0


def test_a_decision_its_drop_overtook_counts_nothing() -> None:
    """Nginx gave up waiting and routed on its own; its drop reached the sidecar before the decide
    did. The late decision is dead: it gives its rate-limit count back and charges no tenant (the
    request counts at its fail-open end), and nothing of it stays in flight."""
    sc = core(
        queue={"enabled": True, "order": "fair"},
        auth={"keys": [{"name": "team-a", "sha256": "a" * 64}]},
        limits={"per_key": {"tokens_per_minute": 100_000}},
    )
    f = dataclasses.replace(feats(6), client_key="team-a", max_tokens=100)
    sc.service.outcomes.apply([Outcome.drop("d6")])
    asyncio.run(sc.service.route(f, "d6"))
    limiter = sc.service.admission.limiter
    assert limiter is not None and limiter.headroom(["key:team-a"], time.time()) == 100_000
    assert sc.metrics.registry.get_sample_value("kvgate_tenant_attained_tokens", {"tenant": "team-a"}) is None
    sizes = sc.service.sizes()
    assert sizes["admitted_awaiting_usage"] == 0 and sizes["tenant_charges_awaiting_end"] == 0
    assert len(sc.registry.ledger) == 0
    asyncio.run(sc.service.route(f, "d7"))  # one not overtaken counts as before
    assert limiter.headroom(["key:team-a"], time.time()) == 100_000 - f.est_tokens - 100


def test_a_dropped_decision_and_one_with_no_backend_give_their_count_back() -> None:
    """A decision Nginx did not use (its answer came too late, or its client went away before a
    backend saw the request) never ran, and one with no backend is routed by Nginx on its own: their
    requests count at their own ends, if they run, so the decisions give back what they counted."""
    sc = core(
        auth={"keys": [{"name": "team-a", "sha256": "a" * 64}]},
        limits={"per_key": {"tokens_per_minute": 100_000}},
        scrape={"unhealthy_after": 1},
    )
    f = dataclasses.replace(feats(8), client_key="team-a", max_tokens=100)
    limiter = sc.service.admission.limiter
    assert limiter is not None
    asyncio.run(sc.service.route(f, "d8"))
    assert limiter.headroom(["key:team-a"], time.time()) == 100_000 - f.est_tokens - 100
    sc.service.outcomes.apply([Outcome.drop("d8")])
    assert limiter.headroom(["key:team-a"], time.time()) == 100_000 and len(sc.registry.ledger) == 0
    for b in ("b0", "b1"):
        sc.registry.failure(b, "connection refused")
    r = asyncio.run(sc.service.route(f, "d9"))
    assert r.candidates == () and limiter.headroom(["key:team-a"], time.time()) == 100_000
    assert sc.service.sizes()["admitted_awaiting_usage"] == 0
