"""The wire messages as Python types: each outcome constructor fills the fields its kind has."""

import dataclasses

from kvgate.messages import Outcome, OutcomeKind


def test_an_end_sets_every_field_by_its_name() -> None:
    o = Outcome.end("d", "b0", 200, False, 0.1, 0.5, True, 30, 4, "resp-1", 16, "team-a", "10.0.0.7", "acme")
    assert dataclasses.asdict(o) == {
        "kind": OutcomeKind.END,
        "decision_id": "d",
        "backend": "b0",
        "status": 200,
        "sent": False,
        "ttft": 0.1,
        "duration": 0.5,
        "cut": True,
        "prompt_tokens": 30,
        "completion_tokens": 4,
        "response_id": "resp-1",
        "cached_tokens": 16,
        "client_key": "team-a",
        "client_addr": "10.0.0.7",
        "tenant": "acme",
    }


def test_first_try_and_drop_carry_only_what_they_know() -> None:
    assert Outcome.first("d", "b1", "r") == Outcome(OutcomeKind.FIRST, "d", "b1", response_id="r")
    tried = Outcome.tried("b2", 502)
    assert (tried.kind, tried.decision_id, tried.backend, tried.status) == (OutcomeKind.TRY, None, "b2", 502)
    drop = Outcome.drop("d")
    assert (drop.kind, drop.decision_id, drop.backend, drop.status) == (OutcomeKind.DROP, "d", "", 0)
