"""Admission by TTFT objective: the pure verdict, the count of objectives met, and the decision
service carrying it out (moved, held in the gateway queue, shed with a Retry-After, sent late),
ending with nothing held."""

from __future__ import annotations

import dataclasses

import pytest
from kvgate.config import Config, PolicyName
from kvgate.messages import Outcome
from kvgate.metrics import SidecarMetrics
from kvgate.service import Queued, Routed
from kvgate.slo import SloGate, SloShed, Verdict, judge
from prometheus_client import generate_latest

from tests.cores import core, features, run

# backend -> (expected seconds to the first byte now, there idle)
BUSY_A = {"a": (3.0, 0.4), "b": (0.8, 0.5)}
BOTH_BUSY = {"a": (3.0, 0.4), "b": (2.5, 0.5)}


@pytest.mark.parametrize(
    ("predictions", "waited", "sheddable", "can_wait", "movable", "verdict", "backend"),
    [
        ({"a": (0.9, 0.2)}, 0.0, True, True, True, Verdict.GO, None),
        ({}, 0.0, True, True, True, Verdict.GO, None),  # nothing learned: nothing known to break
        ({"b": (5.0, 1.0)}, 0.0, True, True, True, Verdict.GO, None),  # the planned one unknown
        (BUSY_A, 0.0, True, True, True, Verdict.MOVED, "b"),
        (BUSY_A, 0.0, True, True, False, Verdict.WAIT, None),  # a bound session stays: it waits
        (BOTH_BUSY, 0.0, True, True, True, Verdict.WAIT, None),
        (BOTH_BUSY, 0.7, True, True, True, Verdict.SHED, None),  # 0.3 s left: not even idle makes it
        (BOTH_BUSY, 0.0, True, False, True, Verdict.SHED, None),  # no queue to wait in
        (BOTH_BUSY, 0.7, False, True, True, Verdict.LATE, None),
        ({"a": (0.95, 0.2)}, 0.1, True, True, True, Verdict.WAIT, None),  # waiting counts
    ],
)
def test_a_verdict_follows_the_best_prediction_against_the_time_left(
    predictions: dict[str, tuple[float, float]],
    waited: float,
    sheddable: bool,
    can_wait: bool,
    movable: bool,
    verdict: Verdict,
    backend: str | None,
) -> None:
    j = judge(1.0, waited, predictions, "a", sheddable, can_wait, movable)
    assert (j.verdict, j.backend) == (verdict, backend)


def test_a_shed_request_is_told_when_the_backlog_should_have_drained() -> None:
    j = judge(1.0, 0.0, {"a": (7.2, 0.3), "b": (9.0, 0.3)}, "a", True, False)
    assert (j.verdict, j.retry_after, j.expected) == (Verdict.SHED, 7, 7.2)  # ceil(7.2 - 1.0)
    assert judge(1.0, 0.0, {"a": (900.0, 0.3)}, "a", True, False).retry_after == 60  # capped


def gate_of(**slo: object) -> SloGate:
    cfg = Config.from_mapping({"slo": slo, "backends": [{"url": "http://127.0.0.1:1"}]})
    return SloGate(cfg.slo, SidecarMetrics())


def _counted(gate: SloGate) -> dict[str, float]:
    out = {}
    for metric in gate.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "kvgate_slo_requests_total":
                out[sample.labels["outcome"]] = sample.value
    return out


def test_each_routed_request_s_end_says_whether_it_met_its_objective() -> None:
    gate = gate_of(objectives=[{"ttft_ms": 1000, "itl_ms": 50}])
    for did in ("fast", "slow", "json", "failed", "choppy", "dropped"):
        gate.promise(did, gate.config.objectives[0])
    gate.settle(Outcome.end("fast", "b0", 200, True, 0.4, 2.0, completion_tokens=100))
    gate.settle(Outcome.end("slow", "b0", 200, True, 1.4, 2.0))
    gate.settle(Outcome.end("json", "b0", 200, True, None, 0.9))  # its first byte came with its end
    gate.settle(Outcome.end("failed", "b0", 500, True, 0.1, 0.2))
    gate.settle(Outcome.end("choppy", "b0", 200, True, 0.4, 20.0, completion_tokens=100))
    gate.settle(Outcome.drop("dropped"))
    gate.settle(Outcome.end("never-promised", "b0", 200, True, 0.1, 0.2))
    assert _counted(gate) == {"met": 2.0, "missed": 3.0}
    assert len(gate) == 0  # every objective held comes down at its request's end or drop


def test_the_service_moves_holds_sheds_and_sends_late_as_its_predictions_say() -> None:
    """Two idle backends that answer in 1 ms per prefill token. Requests pile up unanswered until
    neither backend makes the objective: one that could not make it even there idle, and may be shed,
    is refused with Retry-After; one that could waits in the gateway queue and goes once the backlog
    answers; every objective and admission ends."""

    async def scenario() -> None:
        f0 = features(0)
        own = f0.est_tokens
        objective_ms = round(own * 2.5)  # 1 ms per token: two prompts queued ahead still make it
        sc = core(
            n=2,
            routing={"saturation_prefill_tokens": 10**7, "policy": "least_load"},
            queue={"enabled": True, "client_priority": True},
            slo={"objectives": [{"ttft_ms": objective_ms}], "sheddable_priority": 1},
        )
        service = sc.service
        for b in sc.registry.backends:
            for work in (0, 1000, 2000, 3000, 4000, 5000):
                service.first_byte.learn(b, work, work / 1000)  # 1 ms per token of work
        routed = []
        for i in range(4):  # two per backend: the next would have three prompts ahead of its first token
            r = await service.decide(features(i), f"d{i}")
            assert isinstance(r, Routed) and r.decision.reason.value != "slo"
            routed.append(r)
        # A long prompt that breaks the objective even on an idle backend: sheddable, refused.
        shed = dataclasses.replace(features(10, turns=8), priority=1)
        assert shed.est_tokens > objective_ms
        with pytest.raises(SloShed) as refused:
            await service.decide(shed, "shed")
        assert refused.value.retry_after >= 1
        held = await service.decide(features(11), "held")
        assert isinstance(held, Queued)
        assert await service.dispatch() == []  # still nothing makes it
        for r in routed:  # the backlog answers: its prefill is no longer ahead of anyone
            service.report([Outcome.first(r.decision_id, r.candidates[0].id)])
        ((waiting, sent),) = await service.dispatch()
        assert waiting.decision_id == "held" and isinstance(sent, Routed)
        for r in [*routed, sent]:
            service.report([Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.05, 0.1)])
        text = generate_latest(sc.metrics.registry).decode()
        for line in (
            'kvgate_slo_verdicts_total{verdict="go"}',
            'kvgate_slo_verdicts_total{verdict="wait"}',
            'kvgate_slo_verdicts_total{verdict="shed"} 1.0',
            'kvgate_slo_requests_total{outcome="met"} 5.0',
            'kvgate_slo_requests_total{outcome="shed"} 1.0',
        ):
            assert line in text
        assert service.sizes()["objectives_awaiting_end"] == 0
        assert service.sizes()["queue_waiting"] == 0 and len(service.registry.ledger) == 0

    run(scenario())


def test_a_request_that_cannot_be_shed_or_held_goes_late_and_one_that_can_move_moves() -> None:
    """Without a gateway queue and with nothing sheddable: a request planned behind a backlog goes to
    the backend that makes its objective; once none does, it goes as planned."""

    async def scenario() -> None:
        own = features(0).est_tokens
        sc = core(
            n=2,
            routing={"saturation_prefill_tokens": 10**7, "policy": "round_robin"},
            slo={"objectives": [{"ttft_ms": round(own * 1.5)}]},
        )
        service = sc.service
        for b in sc.registry.backends:
            for work in (0, 1000, 2000, 3000, 4000, 5000):
                service.first_byte.learn(b, work, work / 1000)
        first = await service.decide(features(0), "d0")
        second = await service.decide(features(1), "d1")  # round robin: one on each
        assert isinstance(first, Routed) and isinstance(second, Routed)
        assert first.candidates[0].id != second.candidates[0].id
        service.report([Outcome.first("d1", second.candidates[0].id)])  # its backend is free again
        # Round robin plans the first backend again, behind a prompt (2x its own > 1.5x): moved.
        third = await service.decide(features(2), "d2")
        assert isinstance(third, Routed)
        assert (third.decision.reason.value, third.candidates[0].id) == ("slo", second.candidates[0].id)
        late = await service.decide(features(3), "d3")  # both hold one; no queue, not sheddable
        assert isinstance(late, Routed)
        text = generate_latest(sc.metrics.registry).decode()
        assert 'kvgate_slo_verdicts_total{verdict="moved"} 1.0' in text
        assert 'kvgate_slo_verdicts_total{verdict="late"} 1.0' in text
        for r in (first, second, third, late):
            service.report([Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.05, 0.1)])
        assert service.sizes()["objectives_awaiting_end"] == 0

    run(scenario())


def test_a_sheddable_request_waiting_behind_a_held_one_is_refused_once_its_objective_has_passed() -> None:
    """A held request blocks the ones after it in the queue's order (as a full backend does), so
    they are not planned each round; one of them that may be shed is still refused as soon as it has
    waited its whole objective."""

    async def scenario() -> None:
        own = features(0).est_tokens
        sc = core(
            n=1,
            routing={"saturation_prefill_tokens": 10**7, "policy": "least_load"},
            queue={"enabled": True, "client_priority": True},
            slo={"objectives": [{"ttft_ms": round(own * 2.5)}], "sheddable_priority": 1},
        )
        service = sc.service
        assert service.queue is not None
        now = [0.0]
        service.queue.clock = lambda: now[0]
        (backend,) = sc.registry.backends
        for work in (0, 1000, 2000, 3000, 4000, 5000):
            service.first_byte.learn(backend, work, work / 1000)
        ahead = [await service.decide(features(i), f"d{i}") for i in range(2)]  # 2 prompts of backlog
        late = await service.decide(dataclasses.replace(features(3), priority=1), "late")
        assert isinstance(late, Queued)
        now[0] += own * 2.5 / 1000  # its whole objective
        fresh = await service.decide(features(4), "fresh")  # class 0 goes first, and is held
        assert isinstance(fresh, Queued)
        ((waiting, refused),) = await service.dispatch()
        assert waiting.decision_id == "late" and isinstance(refused, SloShed)
        assert "fresh" in service.queue and "late" not in service.queue
        service.abandon("fresh")
        for r in ahead:
            assert isinstance(r, Routed)
            service.report([Outcome.end(r.decision_id, backend, 200, True, 0.05, 0.1)])
        assert service.sizes()["queue_waiting"] == 0 and service.sizes()["objectives_awaiting_end"] == 0

    run(scenario())


def test_a_refusal_says_when_the_first_token_was_expected_counted_from_arrival() -> None:
    """The objective counts from the request's arrival: a request that waited in the gateway queue
    is refused with the wait included (0.6 s expected after 0.5 s waited is 1.1 s, past 1 s)."""

    async def scenario() -> str:
        f = features(0)
        sc = core(
            n=1,
            routing={"policy": "least_load"},
            queue={"enabled": True},
            slo={"objectives": [{"ttft_ms": 1000}], "sheddable_priority": 0},
        )
        (backend,) = sc.registry.backends
        for work in (0, 1000, 2000, 3000, 4000, 5000):
            sc.service.first_byte.learn(backend, work, 0.6 * work / f.est_tokens)  # this prompt: 0.6 s
        plan = await sc.service.planner.plan(f, PolicyName.LEAST_LOAD, 1, False)
        with pytest.raises(SloShed) as refused:
            sc.service._judge("late", f, plan, 0, 0.5)
        return str(refused.value)

    assert run(scenario()) == (
        "its first token is expected 1,100 ms after it arrived, past its objective of 1,000 ms"
    )
