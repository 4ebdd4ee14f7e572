"""The in-flight ledger through the decision service: counts rise with decisions and come back to zero
with their reports, and a drop that overtakes its decision keeps it from counting; and the prefill in
progress, counted less what the backend's fit says is done."""

from __future__ import annotations

import dataclasses

from kvgate.config import GatewayConfig
from kvgate.first_byte import PROGRESS_CAP, FirstByteBudget
from kvgate.inflight import InflightLedger
from kvgate.messages import Outcome

from tests.cores import config, features, ready, run


def test_a_request_for_n_completions_counts_as_n_requests_until_its_report() -> None:
    """vLLM runs each of a request's n completions as an engine request of its own (its
    num_requests_running counts them): the ledger counts them all, and brings them all down at
    the end, at a drop, or when the decision moves with its session."""

    async def scenario() -> None:
        sc = ready(config(None), None)
        ledger = sc.registry.ledger
        four = dataclasses.replace(features(1), completions=4)
        routed = await sc.service.route(four)
        assert sum(ledger.counts.values()) == 4
        other = routed.candidates[1].id  # the next of its ordered candidates
        ledger.move(routed.decision_id, other, 0)
        assert ledger.counts[other] == 4 and ledger.counts[routed.candidates[0].id] == 0
        sc.service.report([Outcome.end(routed.decision_id, other, 200, True, 0.1, 0.5)])
        assert sum(ledger.counts.values()) == 0
        dropped = await sc.service.route(dataclasses.replace(features(3), completions=3))
        assert sum(ledger.counts.values()) == 3
        sc.service.report([Outcome.drop(dropped.decision_id)])
        assert sum(ledger.counts.values()) == 0 and len(ledger) == 0

    run(scenario())


def test_the_kv_a_request_may_take_counts_until_its_end_and_moves_with_it() -> None:
    """Each decision counts the KV cache tokens it may newly take on its backend: the prompt tokens
    it prefills there and each completion's max_tokens (else queue.fair_output_tokens). The count
    moves with the decision (its prefill is the new backend's) and comes down at its end or its
    drop, to zero; its first byte leaves it in place (its blocks stay)."""

    async def scenario() -> None:
        sc = ready(config(None), None)
        ledger = sc.registry.ledger
        three = dataclasses.replace(features(1), completions=3, max_tokens=100)
        routed = await sc.service.route(three)
        first = routed.candidates[0].id
        prefill = ledger.tokens[first]
        assert prefill > 0 and ledger.kv == {first: prefill + 3 * 100}
        bare = dataclasses.replace(features(2), max_tokens=None)  # counted as fair_output_tokens
        other = await sc.service.route(bare)
        held = sum(ledger.kv.values()) - prefill - 300
        assert held > sc.config.queue.fair_output_tokens
        moved_to = routed.candidates[1].id
        before = ledger.kv.get(moved_to, 0)
        ledger.move(routed.decision_id, moved_to, 7)
        assert ledger.kv[moved_to] == before + 7 + 300
        sc.service.report([Outcome.first(other.decision_id, other.candidates[0].id)])
        assert sum(ledger.kv.values()) == 7 + 300 + held
        sc.service.report([Outcome.end(routed.decision_id, moved_to, 200, True, 0.1, 0.5)])
        sc.service.report([Outcome.drop(other.decision_id)])
        assert sum(ledger.kv.values()) == 0 and len(ledger) == 0

    run(scenario())


def test_inflight_counts_rise_with_decisions_and_end_with_reports() -> None:
    async def scenario() -> None:
        sc = ready(config(None), None)
        routed = [await sc.service.route(features(i)) for i in range(12)]
        ledger = sc.registry.ledger
        assert sum(ledger.counts.values()) == 12 and sum(ledger.tokens.values()) > 0
        assert sum(ledger.attention.values()) > 0
        assert sum(ledger.unreported.values()) == 12  # prompts the backends may count before we know
        sc.service.report([Outcome.first(r.decision_id, r.candidates[0].id) for r in routed])
        assert sum(ledger.tokens.values()) == 0  # first bytes: prefill done
        assert sum(ledger.unreported.values()) == 0
        assert sum(ledger.attention.values()) == 0.0
        assert sum(sc.registry.ledger.counts.values()) == 12
        sc.service.report(
            [Outcome.end(r.decision_id, r.candidates[0].id, 200, True, 0.1, 0.5) for r in routed]
        )
        assert sum(sc.registry.ledger.counts.values()) == 0 and len(sc.registry.ledger) == 0
        more = [await sc.service.route(features(i)) for i in range(20, 26)]  # ended before a first byte
        assert sum(ledger.unreported.values()) == 6
        sc.service.report([Outcome.end(r.decision_id, r.candidates[0].id, 502, True, 0.1, 0.5) for r in more])
        assert sum(ledger.tokens.values()) == 0 and sum(ledger.attention.values()) == 0.0
        assert sum(ledger.unreported.values()) == 0
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
        assert sum(sc.registry.ledger.unreported.values()) == 0

    run(scenario())


def test_each_decision_expects_a_first_byte_time_and_its_error_is_measured_on_the_ledger_clock() -> None:
    """Once a backend has answered enough, each decision carries the seconds the first-byte model
    expects (in /debug/decisions too), and the error against the first byte that came is observed:
    on the ledger's own clock, which the virtual replay sets to its simulated time."""
    from prometheus_client import generate_latest

    async def scenario() -> None:
        sc = ready(config(None, backends=1, policy="round_robin"), None)
        now = [0.0]
        sc.registry.ledger.clock = lambda: now[0]
        for i in range(8):  # each first byte 0.2 simulated seconds after its decision
            r = await sc.service.route(features(i), f"d{i}")
            assert r.predicted_ttft_s is None or abs(r.predicted_ttft_s - 0.2) < 0.05
            now[0] += 0.2
            sc.service.report([Outcome.first(f"d{i}", r.candidates[0].id)])
            sc.service.report([Outcome.end(f"d{i}", r.candidates[0].id, 200, True, 0.2, 0.3)])
        learned = await sc.service.route(features(50), "d50")
        assert learned.predicted_ttft_s is not None and abs(learned.predicted_ttft_s - 0.2) < 0.05
        now[0] += 0.4  # twice as long as expected: an error of about a half
        sc.service.report([Outcome.first("d50", learned.candidates[0].id)])
        text = generate_latest(sc.metrics.registry).decode()
        assert 'kvgate_ttft_prediction_error_bucket{backend="b0",le="0.5"}' in text
        count = next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("kvgate_ttft_prediction_error_count")
        )
        assert count >= 1
        sc.service.report([Outcome.end("d50", learned.candidates[0].id, 200, True, 0.4, 0.5)])
        assert len(sc.registry.ledger) == 0

    run(scenario())


def test_the_prefill_in_progress_counts_less_what_the_fit_says_is_done() -> None:
    """A backend whose first bytes take 0.1 s plus 0.1 ms a token of work: a 10,000-token prefill
    costs it about a second. Half a second into it, a new request waits behind half of it; past
    the second, behind ``PROGRESS_CAP`` of it, until its first byte says it is done, and the next
    one's prefill counts from then."""
    now = [0.0]
    fit = FirstByteBudget(GatewayConfig(), lambda: now[0])
    for i in range(40):
        work = 1_000 * (i % 10)
        fit.learn("b", work, 0.1 + 1e-4 * work)
    ledger = InflightLedger(lambda _: True)
    ledger.clock = lambda: now[0]
    ledger.progress = fit.progress
    ledger.start("a", "b", 10_000, now[0])
    assert ledger.ahead("b") == (10_000, 0.0)
    now[0] = 0.5
    assert abs(ledger.ahead("b")[0] - 5_000) <= 10
    ledger.start("c", "b", 2_000, now[0])
    assert abs(ledger.ahead("b")[0] - 7_000) <= 10  # the new one waits behind the same half
    now[0] = 3.0  # longer than expected: not done before its first byte
    assert ledger.ahead("b")[0] == round(10_000 * (1 - PROGRESS_CAP)) + 2_000
    assert ledger.prefill_done("a", "b", now[0]) is not None
    assert ledger.ahead("b")[0] == 2_000  # the next one's prefill starts now
    now[0] = 3.1  # 0.1 s into its 0.2 s
    assert abs(ledger.ahead("b")[0] - 1_000) <= 10
    ledger.finish("c")
    ledger.finish("a")
    assert ledger.ahead("b") == (0, 0.0) and ledger.tokens["b"] == 0
    now[0] = 10.0  # a request on an idle backend starts its own clock
    ledger.start("d", "b", 2_000, now[0])
    assert ledger.ahead("b")[0] == 2_000
    ledger.finish("d")
    assert len(ledger) == 0 and ledger.ahead("b") == (0, 0.0)
