"""The Python twin of the wire protocol against the golden messages (Lua checks the same file in
``test_lua_phases.py``), and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kvgate import protocol
from kvgate.features import Features
from kvgate.messages import (
    Candidate,
    Decide,
    DecisionReply,
    ErrorCode,
    ErrorReply,
    KeysQuery,
    KeysReply,
    ModelsQuery,
    ModelsReply,
    Outcome,
    OutcomeKind,
    PeersQuery,
    PeersReply,
    QueuedReply,
    Report,
)
from kvgate.protocol import ProtocolError

GOLDEN = json.loads((Path(__file__).parent / "golden" / "protocol.json").read_text())


def features(d: dict[str, Any]) -> Features:
    return Features(
        d["model"],
        d["key"],
        d["key_source"],
        tuple(d["hashes"]),
        d["prompt_bytes"],
        d["client_key"],
        d["client_addr"],
        d["max_tokens"],
        d["priority"],
        d["completions"],
        tenant=d["tenant"],
    )


def outcome(d: dict[str, Any]) -> Outcome:
    kind = OutcomeKind(d["kind"])
    return Outcome(
        kind,
        d["decision_id"],
        d["backend"],
        d["status"],
        d["sent"],
        d["ttft"],
        d["duration"],
        d["cut"],
        d["prompt_tokens"],
        d["completion_tokens"],
        d["response_id"],
        d["cached_tokens"],
        d["client_key"],
        d["client_addr"],
        d["tenant"],
    )


def reply(d: dict[str, Any]) -> object:
    kind = d["kind"]
    if kind == "decision":
        return DecisionReply(
            d["decision_id"],
            tuple(Candidate(*c) for c in d["candidates"]),
            d["route"],
            d["priority"],
            tuple(Candidate(*c) for c in d["prefill"]),
            tuple(d["first_byte_ms"]),
            d["max_tokens"],
        )
    if kind == "queued":
        return QueuedReply(d["decision_id"])
    if kind == "error":
        return ErrorReply(ErrorCode(d["code"]), d["message"], d["retry_after"])
    if kind == "keys":
        rates = {name: tuple(rate) for name, rate in d["rates"].items()}
        return KeysReply(d["version"], d["keys"], d["priorities"], rates)
    if kind == "peers":
        return PeersReply(
            d["version"],
            tuple(Candidate(*p) for p in d["peers"]),
            d["known"],
            d["fingerprint"],
            d["auth"],
            d["limits"],
        )
    return ModelsReply(tuple(d["cards"]))


def test_golden_version_is_the_protocol_version() -> None:
    assert GOLDEN["version"] == protocol.VERSION


@pytest.mark.parametrize("case", GOLDEN["decide"], ids=lambda c: str(c["features"]["key_source"]))
def test_decide_messages_encode_and_decode_as_golden(case: dict[str, Any]) -> None:
    f = features(case["features"])
    assert protocol.encode_message(Decide(case["id"], f, case["body"])) == case["wire"]
    assert protocol.decode_message(protocol.line(case["wire"])) == Decide(case["id"], f, case["body"])


@pytest.mark.parametrize("case", GOLDEN["report"])
def test_report_messages_encode_and_decode_as_golden(case: dict[str, Any]) -> None:
    batch = tuple(outcome(o) for o in case["outcomes"])
    assert protocol.encode_message(Report(batch)) == case["wire"]
    assert protocol.decode_message(protocol.line(case["wire"])) == Report(batch)


def test_queries_encode_and_decode_as_golden() -> None:
    assert protocol.encode_message(PeersQuery(GOLDEN["peers"]["fingerprint"])) == GOLDEN["peers"]["wire"]
    assert protocol.encode_message(ModelsQuery()) == GOLDEN["models"]["wire"]
    assert protocol.decode_message(protocol.line(GOLDEN["peers"]["wire"])) == PeersQuery(
        GOLDEN["peers"]["fingerprint"]
    )
    assert protocol.decode_message(protocol.line(GOLDEN["models"]["wire"])) == ModelsQuery()
    assert protocol.encode_message(KeysQuery()) == GOLDEN["keys"]["wire"]
    assert protocol.decode_message(protocol.line(GOLDEN["keys"]["wire"])) == KeysQuery()


@pytest.mark.parametrize("case", GOLDEN["replies"], ids=lambda c: str(c["meaning"]["kind"]))
def test_replies_encode_and_decode_as_golden(case: dict[str, Any]) -> None:
    r = reply(case["meaning"])
    assert protocol.encode_reply(r) == case["wire"]  # type: ignore[arg-type]
    assert protocol.decode_reply(case["wire"]) == r


@pytest.mark.parametrize(
    "raw, code",
    [
        (b'{"op":"peers"}', ErrorCode.PROTOCOL_VERSION),
        (b'{"pv":1,"op":"peers"}', ErrorCode.PROTOCOL_VERSION),
        (b'{"pv":4,"op":"nope"}', ErrorCode.BAD_REQUEST),
        (b"[1,2]", ErrorCode.BAD_REQUEST),
        (b"\xff\xfe", ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":"a","f":{"k":"h:\xed\xa0\x80"}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":"a","f":{"k":"h:\\udfff"}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":"a","f":{"b":NaN}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":"a","f":{"b":1e400}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":"a","f":{"h":"not a list"}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":"a","f":[]}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","f":{}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"decide","i":5,"f":{}}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"report","o":[{"k":"end","i":7}]}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"report","o":[{"k":"sideways"}]}', ErrorCode.BAD_REQUEST),
        (b'{"pv":4,"op":"report","o":[{"k":"drop"}]}', ErrorCode.BAD_REQUEST),
    ],
)
def test_lines_that_are_not_messages_are_refused_with_a_code(raw: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as err:
        protocol.decode_message(raw)
    assert err.value.code is code


def test_a_refused_report_is_not_answered() -> None:
    """Lua reads no answer to a report: an error line would become the answer to its next call."""
    with pytest.raises(ProtocolError) as err:
        protocol.decode_message(b'{"pv":9,"op":"report","o":[]}')
    assert not err.value.answered
    with pytest.raises(ProtocolError) as err:
        protocol.decode_message(b'{"pv":9,"op":"decide"}')
    assert err.value.answered


def test_an_empty_table_from_lua_reads_as_no_hashes() -> None:
    msg = protocol.decode_message(b'{"pv":4,"op":"decide","i":"x.1","f":{"ks":"none","b":0,"h":{}}}')
    assert isinstance(msg, Decide) and msg.features.hashes == ()
