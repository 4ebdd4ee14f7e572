"""Regenerates protocol.json: wire messages of the Lua <-> sidecar protocol and what they mean.

Both twins check every case: Python (``tests/test_protocol.py``) and Lua in a real Nginx
(``tests/e2e/test_lua_phases.py``) must build each ``wire`` message from its meaning and read it back.
Run only when the protocol changes on purpose (both protocol.py and protocol.lua), then review the
diff: ``python tests/golden/make_protocol.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    PeersQuery,
    PeersReply,
    QueuedReply,
    Report,
)

FEATURES = [
    Features(
        "meta-llama/Llama-3.1-8B-Instruct",
        "h:sess-1",
        "header",
        ("0123456789abcdef", "fedcba9876543210"),
        1536,
    ),
    Features("m", "p:a1b2c3d4e5f60718", "prefix", (), 40),
    Features(None, None, "none", (), 0),
    Features("m", "u:héllo ✓", "user", ("aaaaaaaaaaaaaaaa",), 700),
    Features("m", "h:s", "header", (), 12, client_key="team-a", client_addr="10.0.0.7", max_tokens=64),
    Features("m", "h:s", "header", (), 12, client_key="team-a", max_tokens=64, completions=4),
    Features("m", "p:0011223344556677", "prefix", (), 99, priority=-5),
    Features("m", None, "none", (), 8, client_key="team-a", tenant="acme.eu:prod-1"),
]
# With the exact index on, a decision carries the request's body (to be tokenized).
BODY = '{"model":"m","messages":[{"role":"user","content":"héllo \\"there\\""}]}'
DECIDES = [(f, None) for f in FEATURES] + [(Features("m", None, "none", (), len(BODY)), BODY)]
OUTCOMES = [
    (Outcome.first("1a2b.5f3c.7", "sim-1"),),
    (Outcome.first("1a2b.5f3c.12", "sim-1", "resp_0f1e2d"),),  # a stored response, bound at once
    (Outcome.tried("sim-0", 502), Outcome.end("1a2b.5f3c.7", "sim-1", 200, True, 0.25, 1.5)),
    (Outcome.end("1a2b.5f3c.9", "sim-2", 504, False, None, 1.0),),
    (Outcome.end(None, "sim-2", 200, True, None, 0.125),),  # fail-open: no decision
    # fail-open, with its tenant (key name, client address, header) and the usage it is counted by
    (
        Outcome.end(
            None,
            "sim-0",
            200,
            True,
            0.1,
            0.5,
            False,
            30,
            6,
            client_key="team-a",
            client_addr="10.0.0.7",
            tenant="acme",
        ),
    ),
    (Outcome.end("1a2b.5f3c.10", "sim-0", 200, True, 0.5, 0.75, cut=True),),
    (Outcome.end("1a2b.5f3c.11", "sim-0", 200, True, None, 0.5, False, 17, 64),),
    (Outcome.end("1a2b.5f3c.12", "sim-1", 200, True, None, 0.5, response_id="resp_0f1e2d"),),
    (Outcome.end("1a2b.5f3c.13", "sim-0", 200, True, 0.2, 0.5, False, 40, 8, cached_tokens=32),),
    (Outcome.drop("1a2b.5f3c.8"),),
]
FINGERPRINT = "1f2e3d4c5b6a7980"  # of the settings an Nginx was rendered with
REPLIES = [
    DecisionReply(
        "1a2b.5f3c.42",
        (Candidate("sim-1", "127.0.0.1:8002"), Candidate("sim-0", "127.0.0.1:8001")),
        "prefix",
    ),
    DecisionReply(
        "1a2b.5f3c.48",
        (Candidate("sim-1", "127.0.0.1:8002"), Candidate("sim-0", "127.0.0.1:8001")),
        "ring",
        first_byte_ms=(5000, 60000),
        max_tokens=812,
    ),
    DecisionReply("1a2b.5f3c.43", (Candidate("vllm-a", "10.0.0.5:8000"),), "load/rebind-saturated"),
    DecisionReply("1a2b.5f3c.44", (), "no_backend"),
    DecisionReply("1a2b.5f3c.45", (Candidate("d-0", "10.0.1.1:8000"),), "ring@long", 3),
    DecisionReply(
        "1a2b.5f3c.46",
        (Candidate("d-0", "10.0.1.1:8000"), Candidate("d-1", "10.0.1.2:8000")),
        "load",
        None,
        (Candidate("p-0", "10.0.2.1:8000"),),
    ),
    QueuedReply("1a2b.5f3c.47"),
    ErrorReply(ErrorCode.QUEUE_FULL, "the gateway queue is full", 3),
    ErrorReply(ErrorCode.QUEUE_TIMEOUT, "waited too long", 1),
    ErrorReply(ErrorCode.UNKNOWN_MODEL, "The model `x` does not exist."),
    ErrorReply(ErrorCode.PROTOCOL_VERSION, "protocol version mismatch"),
    ErrorReply(ErrorCode.RATE_LIMITED, "Rate limit reached; retry later.", 42),
    KeysReply(
        7, {"a" * 64: "team-a", "b" * 64: "team-b"}, {"team-b": -2}, {"team-a": (60, 0), "team-b": (0, 5000)}
    ),
    PeersReply(
        3,
        (Candidate("sim-0", "127.0.0.1:8001"), Candidate("sim-1", "127.0.0.1:8002")),
        3,
        "ee2990f8fe5be382",
        True,
        False,
    ),
    ModelsReply(({"id": "m", "object": "model", "created": 0, "owned_by": "vllm"},)),
]


def features(f: Features) -> dict[str, object]:
    return {
        "model": f.model,
        "key": f.key,
        "key_source": f.key_source,
        "hashes": list(f.hashes),
        "prompt_bytes": f.prompt_bytes,
        "client_key": f.client_key,
        "client_addr": f.client_addr,
        "max_tokens": f.max_tokens,
        "priority": f.priority,
        "completions": f.completions,
        "tenant": f.tenant,
    }


def outcome(o: Outcome) -> dict[str, object]:
    return {
        "kind": o.kind.value,
        "decision_id": o.decision_id,
        "backend": o.backend,
        "status": o.status,
        "sent": o.sent,
        "ttft": o.ttft,
        "duration": o.duration,
        "cut": o.cut,
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "response_id": o.response_id,
        "cached_tokens": o.cached_tokens,
        "client_key": o.client_key,
        "client_addr": o.client_addr,
        "tenant": o.tenant,
    }


def reply(r: object) -> dict[str, object]:
    if isinstance(r, DecisionReply):
        return {
            "kind": "decision",
            "decision_id": r.decision_id,
            "candidates": [list(c) for c in r.candidates],
            "route": r.route,
            "priority": r.priority,
            "prefill": [list(c) for c in r.prefill],
            "first_byte_ms": list(r.first_byte_ms),
            "max_tokens": r.max_tokens,
        }
    if isinstance(r, QueuedReply):
        return {"kind": "queued", "decision_id": r.decision_id}
    if isinstance(r, ErrorReply):
        return {"kind": "error", "code": r.code.value, "message": r.message, "retry_after": r.retry_after}
    if isinstance(r, KeysReply):
        return {
            "kind": "keys",
            "version": r.version,
            "keys": dict(r.keys),
            "priorities": dict(r.priorities),
            "rates": {name: list(rate) for name, rate in r.rates.items()},
        }
    if isinstance(r, PeersReply):
        return {
            "kind": "peers",
            "version": r.version,
            "peers": [list(p) for p in r.peers],
            "known": r.known,
            "fingerprint": r.fingerprint,
            "auth": r.auth,
            "limits": r.limits,
        }
    assert isinstance(r, ModelsReply)
    return {"kind": "models", "cards": [dict(c) for c in r.cards]}


def main() -> None:
    out = {
        "version": protocol.VERSION,
        "decide": [
            {
                "id": f"1a2b.5f3c.{i}",
                "features": features(f),
                "body": body,
                "wire": protocol.encode_message(Decide(f"1a2b.5f3c.{i}", f, body)),
            }
            for i, (f, body) in enumerate(DECIDES)
        ],
        "report": [
            {"outcomes": [outcome(o) for o in batch], "wire": protocol.encode_message(Report(batch))}
            for batch in OUTCOMES
        ],
        "peers": {
            "fingerprint": FINGERPRINT,
            "wire": protocol.encode_message(PeersQuery(FINGERPRINT)),
        },
        "models": {"wire": protocol.encode_message(ModelsQuery())},
        "keys": {"wire": protocol.encode_message(KeysQuery())},
        "replies": [{"meaning": reply(r), "wire": protocol.encode_reply(r)} for r in REPLIES],
    }
    path = Path(__file__).with_name("protocol.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
