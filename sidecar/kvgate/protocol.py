"""The wire protocol between Nginx's Lua hook and the sidecar: the one Python home of its keys.

One JSON object per line over a unix socket, both ways; ``lua/kvgate/protocol.lua`` is the Lua twin
and ``tests/golden/protocol.json`` holds messages that both sides must encode and decode alike. Every
message carries the protocol version ``pv``: a peer speaking another version gets an error line and
both sides log it loudly, so a Lua and a sidecar from different releases never misread each other.

Lua -> sidecar (decide, peers and models are answered with one line; report is not, so the log phase
never waits)::

    {"pv":4,"op":"decide","i":id,"f":{"m":model,"k":key,"ks":key source,"h":[chunk hash,...],"b":bytes,
                                      "ck":API key name,"ca":client address,"mt":max tokens,
                                      "n":completions asked for, n x prompts (absent: 1),
                                      "pr":priority the client asked for,
                                      "tn":the tenant its tenant header names}}
    {"pv":4,"op":"report","o":[outcome,...]}
    {"pv":4,"op":"peers","fp":the fingerprint of the settings Nginx was rendered with (agreement.py)}
    {"pv":4,"op":"models"}
    {"pv":4,"op":"keys"}

sidecar -> Lua::

    {"pv":4,"i":id,"c":[[backend id,"host:port"],...],"r":route label,
     "pr":priority to write into the body (forwarded to vLLM),
     "pc":[[backend id,"host:port"],...] prefill candidates (disaggregated: c then decodes),
     "fb":[ms,...] each candidate's first-byte timeout (kvgate.first_byte),
     "mt":max tokens to write into the body (a token limit's headroom; the request had none)}   a decision
    {"pv":4,"i":id,"q":1}   the request waits in the gateway queue: the same connection carries this
                            line again every heartbeat, then the decision or an error
    {"pv":4,"e":error code,"msg":text,"ra":retry after s}                an error
    {"pv":4,"v":peers version,"peers":[{"id":backend id,"addr":"host:port"},...],"n":backends known,
     "fp":the sidecar's settings fingerprint,"au":auth on,"li":rate limits on}
    {"pv":4,"data":[model card,...]}
    {"pv":4,"v":keys version,"keys":{sha256 hex:key name,...},
     "kp":{key name:priority,...} the keys whose class is not 0 (fail-open forwards it),
     "kl":{key name:[requests,tokens],...} the limited keys' rates a minute (fail-open holds them)}

Nginx names each decision (``i``, unique per gateway) before asking, so it can end a decision it will
not use (a late answer, fail-open, a client gone before dispatch) without having heard the answer.
Every decision ends in exactly one outcome of kind ``end`` or ``drop``; ``first`` marks its first
response byte and ``try`` a failed attempt on an earlier candidate::

    {"k":"first","i":id,"b":backend,"r":the id of a /v1/responses response, sent at once: the next turn
     may come within milliseconds, through any replica}
    {"k":"end","i":id,"b":backend,"s":status,"x":bytes sent,"t":ttft s (streams),"d":duration s,"c":cut,
     "pt":prompt tokens,"ct":completion tokens,"kt":cached prompt tokens (from the response's usage,
     when Nginx reads it: rate limits, or the exact index),
     "r":the id of a /v1/responses response (its backend keeps it),
     "ck","ca","tn": a fail-open request's API key name, client address and tenant, as in decide}
    {"k":"try","b":backend,"s":status}
    {"k":"drop","i":id}

A fail-open request has no decision: its ``end`` carries no ``i``, and carries its tenant instead
(``ck``, ``ca``, ``tn``), which is charged for the usage it reports (``kvgate.outcomes``).

Over 300 lines: the first 60 are the wire format's reference, and each message kind has its
decoder and encoder, mirroring ``lua/kvgate/protocol.lua``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.features import Features
from kvgate.messages import (
    Candidate,
    Decide,
    DecisionReply,
    ErrorCode,
    ErrorReply,
    KeysQuery,
    KeysReply,
    Message,
    ModelsQuery,
    ModelsReply,
    Outcome,
    OutcomeKind,
    PeersQuery,
    PeersReply,
    QueuedReply,
    Reply,
    Report,
)

VERSION = 4
MAX_ID = 64  # decision ids are Nginx's: worker, start time and a counter


class ProtocolError(ValueError):
    """A line that is not a message of this protocol; answered with an error line unless its ``op``
    expects no answer (a report: Lua would read the error as the answer to its next call)."""

    def __init__(self, code: ErrorCode, message: str, op: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.op = op

    @property
    def answered(self) -> bool:
        return self.op != "report"


# -- decoding ------------------------------------------------------------------------------------
def _id(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        raise ValueError(f"{name} must be a decision id (a string of 1..{MAX_ID} characters)")
    return value


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        return None  # absent, or not a duration (NaN, negative, absurd)
    return float(value)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a number")
    if isinstance(value, float) and not -(2**63) <= value <= 2**63:
        raise ValueError(f"{name} is out of range")
    return int(value)


def _text(value: Any, name: str) -> str | None:
    """Client text, or None. JSON can carry a lone surrogate, which is no character: it must never
    reach Redis, a hash or a C extension, so such text is refused here."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text") from None
    return value


def decode_features(d: Any) -> Features:
    if not isinstance(d, Mapping):
        raise ValueError("f must be an object of features")
    hashes = d.get("h") or ()
    # cjson encodes an empty Lua table as {}: an empty mapping is an empty list here.
    if isinstance(hashes, Mapping) and not hashes:
        hashes = ()
    if not isinstance(hashes, list | tuple) or not all(isinstance(h, str) for h in hashes):
        raise ValueError("h must be a list of hash strings")
    mt, n, pr = d.get("mt"), d.get("n"), d.get("pr")
    return Features(
        model=_text(d.get("m"), "m"),
        key=_text(d.get("k"), "k"),
        key_source=str(_text(d.get("ks"), "ks") or "none"),
        hashes=tuple(hashes),
        prompt_bytes=max(0, _int(d.get("b") or 0, "b")),
        client_key=_text(d.get("ck"), "ck"),
        client_addr=_text(d.get("ca"), "ca"),
        tenant=_text(d.get("tn"), "tn"),
        max_tokens=None if mt is None else max(0, _int(mt, "mt")),
        completions=1 if n is None else max(1, _int(n, "n")),
        priority=None if pr is None else max(-(2**31), min(2**31 - 1, _int(pr, "pr"))),
    )


def decode_outcome(d: Any) -> Outcome:
    if not isinstance(d, Mapping):
        raise ValueError("an outcome must be an object")
    try:
        kind = OutcomeKind(d.get("k"))
    except ValueError:
        raise ValueError(f"unknown outcome kind {d.get('k')!r}") from None
    if kind is OutcomeKind.DROP:
        return Outcome.drop(_id(d.get("i"), "i"))
    backend = _text(d.get("b"), "b") or ""
    if kind is OutcomeKind.FIRST:
        return Outcome.first(_id(d.get("i"), "i"), backend, _text(d.get("r"), "r"))
    status = _int(d.get("s") or 0, "s")
    if kind is OutcomeKind.TRY:
        return Outcome.tried(backend, status)
    decision_id = None if d.get("i") is None else _id(d.get("i"), "i")
    pt, ct, kt = d.get("pt"), d.get("ct"), d.get("kt")
    return Outcome.end(
        decision_id,
        backend,
        status,
        bool(d.get("x")),
        _seconds(d.get("t")),
        _seconds(d.get("d")),
        d.get("c") is True,
        None if pt is None else max(0, _int(pt, "pt")),
        None if ct is None else max(0, _int(ct, "ct")),
        _text(d.get("r"), "r"),
        None if kt is None else max(0, _int(kt, "kt")),
        _text(d.get("ck"), "ck"),
        _text(d.get("ca"), "ca"),
        _text(d.get("tn"), "tn"),
    )


def decode_message(line: bytes) -> Message:
    """One line from Lua; raises ``ProtocolError`` for anything that is not a message of ours."""
    try:
        msg = json.loads(line)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise ProtocolError(ErrorCode.BAD_REQUEST, "not a UTF-8 JSON line") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message is a JSON object")
    op = msg.get("op")
    if msg.get("pv") != VERSION:
        raise ProtocolError(
            ErrorCode.PROTOCOL_VERSION,
            f"protocol version mismatch: the sidecar speaks {VERSION}, the message says {msg.get('pv')!r}",
            op,
        )
    try:
        if op == "decide":
            f = msg.get("f")
            body = f.get("tb") if isinstance(f, Mapping) else None
            return Decide(_id(msg.get("i"), "i"), decode_features(f), body if isinstance(body, str) else None)
        if op == "report":
            items = msg.get("o")
            if not isinstance(items, list):
                raise ValueError("report needs o: [outcomes]")
            return Report(tuple(decode_outcome(o) for o in items))
    except (ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"malformed {op}: {exc}", op) from None
    if op == "peers":
        fp = msg.get("fp")
        return PeersQuery(fp if isinstance(fp, str) and 0 < len(fp) <= 64 else None)
    if op == "models":
        return ModelsQuery()
    if op == "keys":
        return KeysQuery()
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown op {op!r}", op)


# -- encoding ------------------------------------------------------------------------------------
def encode_features(f: Features) -> dict[str, Any]:
    # Absent rather than null or empty, as Lua's cjson writes them (it cannot tell [] from {}).
    out: dict[str, Any] = {"ks": f.key_source, "b": f.prompt_bytes}
    if f.model is not None:
        out["m"] = f.model
    if f.key is not None:
        out["k"] = f.key
    if f.hashes:
        out["h"] = list(f.hashes)
    if f.client_key is not None:
        out["ck"] = f.client_key
    if f.client_addr is not None:
        out["ca"] = f.client_addr
    if f.tenant is not None:
        out["tn"] = f.tenant
    if f.max_tokens is not None:
        out["mt"] = f.max_tokens
    if f.completions != 1:
        out["n"] = f.completions
    if f.priority is not None:
        out["pr"] = f.priority
    return out


def encode_outcome(o: Outcome) -> dict[str, Any]:
    out: dict[str, Any] = {"k": o.kind.value}
    if o.decision_id is not None:
        out["i"] = o.decision_id
    if o.kind is OutcomeKind.DROP:
        return out
    out["b"] = o.backend
    if o.kind is OutcomeKind.FIRST:
        if o.response_id is not None:
            out["r"] = o.response_id
        return out
    out["s"] = o.status
    if o.kind is OutcomeKind.TRY:
        return out
    out["x"] = o.sent
    if o.ttft is not None:
        out["t"] = o.ttft
    if o.duration is not None:
        out["d"] = o.duration
    if o.cut:
        out["c"] = True
    if o.prompt_tokens is not None:
        out["pt"] = o.prompt_tokens
    if o.completion_tokens is not None:
        out["ct"] = o.completion_tokens
    if o.response_id is not None:
        out["r"] = o.response_id
    if o.cached_tokens is not None:
        out["kt"] = o.cached_tokens
    if o.client_key is not None:
        out["ck"] = o.client_key
    if o.client_addr is not None:
        out["ca"] = o.client_addr
    if o.tenant is not None:
        out["tn"] = o.tenant
    return out


def encode_message(msg: Message) -> dict[str, Any]:
    """What Lua sends, for tools and tests that speak to the sidecar as Nginx does."""
    if isinstance(msg, Decide):
        f = encode_features(msg.features)
        if msg.body is not None:
            f["tb"] = msg.body
        return {"pv": VERSION, "op": "decide", "i": msg.decision_id, "f": f}
    if isinstance(msg, Report):
        return {"pv": VERSION, "op": "report", "o": [encode_outcome(o) for o in msg.outcomes]}
    if isinstance(msg, PeersQuery):
        out: dict[str, Any] = {"pv": VERSION, "op": "peers"}
        if msg.fingerprint is not None:
            out["fp"] = msg.fingerprint
        return out
    if isinstance(msg, KeysQuery):
        return {"pv": VERSION, "op": "keys"}
    return {"pv": VERSION, "op": "models"}


def encode_reply(reply: Reply) -> dict[str, Any]:
    if isinstance(reply, DecisionReply):
        out: dict[str, Any] = {
            "pv": VERSION,
            "i": reply.decision_id,
            "c": [[c.id, c.address] for c in reply.candidates],
            "r": reply.route,
        }
        if reply.priority is not None:
            out["pr"] = reply.priority
        if reply.prefill:
            out["pc"] = [[c.id, c.address] for c in reply.prefill]
        if reply.first_byte_ms:
            out["fb"] = list(reply.first_byte_ms)
        if reply.max_tokens is not None:
            out["mt"] = reply.max_tokens
        return out
    if isinstance(reply, QueuedReply):
        return {"pv": VERSION, "i": reply.decision_id, "q": 1}
    if isinstance(reply, ErrorReply):
        err: dict[str, Any] = {"pv": VERSION, "e": reply.code.value, "msg": reply.message}
        if reply.retry_after is not None:
            err["ra"] = reply.retry_after
        return err
    if isinstance(reply, KeysReply):
        keys: dict[str, Any] = {"pv": VERSION, "v": reply.version, "keys": dict(reply.keys)}
        if reply.priorities:
            keys["kp"] = dict(reply.priorities)
        if reply.rates:
            keys["kl"] = {name: list(rate) for name, rate in reply.rates.items()}
        return keys
    if isinstance(reply, PeersReply):
        return {
            "pv": VERSION,
            "v": reply.version,
            "peers": [{"id": p.id, "addr": p.address} for p in reply.peers],
            "n": reply.known,
            "fp": reply.fingerprint,
            "au": reply.auth,
            "li": reply.limits,
        }
    return {"pv": VERSION, "data": [dict(c) for c in reply.cards]}


def decode_reply(d: Mapping[str, Any]) -> Reply:
    """A sidecar reply, for tools and tests (Nginx decodes them in ``protocol.lua``)."""
    if d.get("pv") != VERSION:
        raise ProtocolError(ErrorCode.PROTOCOL_VERSION, f"reply speaks protocol {d.get('pv')!r}")
    if "e" in d:
        return ErrorReply(ErrorCode(d["e"]), str(d.get("msg", "")), d.get("ra"))
    if "keys" in d:
        rates = {name: (int(r), int(t)) for name, (r, t) in d.get("kl", {}).items()}
        return KeysReply(int(d["v"]), dict(d["keys"]), dict(d.get("kp", {})), rates)
    if "q" in d:
        return QueuedReply(str(d["i"]))
    if "c" in d:
        pairs: Sequence[Sequence[str]] = d["c"]
        prefill: Sequence[Sequence[str]] = d.get("pc", ())
        return DecisionReply(
            str(d["i"]),
            tuple(Candidate(a, b) for a, b in pairs),
            str(d["r"]),
            d.get("pr"),
            tuple(Candidate(a, b) for a, b in prefill),
            tuple(int(ms) for ms in d.get("fb", ())),
            d.get("mt"),
        )
    if "peers" in d:
        return PeersReply(
            int(d["v"]),
            tuple(Candidate(p["id"], p["addr"]) for p in d["peers"]),
            int(d.get("n", 0)),
            str(d.get("fp", "")),
            bool(d.get("au")),
            bool(d.get("li")),
        )
    return ModelsReply(tuple(d["data"]))


def line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
