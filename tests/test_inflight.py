"""The in-flight ledger through the decision service: counts rise with decisions and come back to zero
with their reports, and a drop that overtakes its decision keeps it from counting."""

from __future__ import annotations

from kvgate.messages import Outcome

from tests.cores import config, features, ready, run


def test_inflight_counts_rise_with_decisions_and_end_with_reports() -> None:
    async def scenario() -> None:
        sc = ready(config(None), None)
        routed = [await sc.service.route(features(i)) for i in range(12)]
        assert sum(sc.registry.ledger.counts.values()) == 12 and sum(sc.registry.ledger.tokens.values()) > 0
        sc.service.report([Outcome.first(r.decision_id, r.candidates[0].id) for r in routed])
        assert sum(sc.registry.ledger.tokens.values()) == 0  # first bytes: prefill done
        assert sum(sc.registry.ledger.counts.values()) == 12
        sc.service.report(
            [Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.1, 0.5) for r in routed]
        )
        assert sum(sc.registry.ledger.counts.values()) == 0 and len(sc.registry.ledger) == 0
        sc.service.report(
            [Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.1, 0.5) for r in routed]
        )
        assert all(v == 0 for v in sc.registry.ledger.counts.values())  # a second report changes nothing

    run(scenario())


def test_a_drop_ends_a_decision_even_when_it_overtakes_the_decision() -> None:
    async def scenario() -> None:
        sc = ready(config(None), None)
        counted = await sc.service.route(features(1), "gw.1")
        sc.service.report([Outcome.drop("gw.1")])
        assert len(sc.registry.ledger) == 0 and sum(sc.registry.ledger.counts.values()) == 0
        sc.service.report([Outcome.drop("gw.2")])  # Nginx gave up before the sidecar saw the request
        late = await sc.service.route(features(2), "gw.2")
        assert late.candidates and len(sc.registry.ledger) == 0
        assert sum(sc.registry.ledger.counts.values()) == 0 and counted.decision_id == "gw.1"

    run(scenario())
