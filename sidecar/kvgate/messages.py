"""The messages of the wire protocol between Nginx's Lua hook and the sidecar, as Python types: what
each side asks and answers (``kvgate.protocol`` turns them into lines and back, and documents the
wire format), and the outcome reports every decision ends in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from kvgate.features import Features


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"
    UNKNOWN_MODEL = "unknown_model"
    PROTOCOL_VERSION = "protocol_version"
    RATE_LIMITED = "rate_limited"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    SLO_SHED = "slo_shed"  # the request cannot meet its TTFT objective and may be refused


class Candidate(NamedTuple):
    id: str
    address: str  # host:port, what Nginx's balancer needs


class OutcomeKind(str, Enum):
    FIRST = "first"  # the response's first body byte came back: the request's prefill is done
    END = "end"  # the request ended (the decision's one final report)
    TRY = "try"  # an earlier candidate failed before the one that answered
    DROP = "drop"  # Nginx did not use the decision (late answer, fail-open, client gone first)


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    decision_id: str | None = None  # None for tries and for fail-open requests
    backend: str = ""
    status: int = 0  # 0 when no response came back (connection failure)
    sent: bool = False  # whether response bytes reached the client
    ttft: float | None = None  # streams: first body byte, seconds from the request's start
    duration: float | None = None  # seconds from the request's start to its end
    cut: bool = False  # the backend closed the response before its end
    prompt_tokens: int | None = None  # the response's usage, when Nginx read it (limits on)
    completion_tokens: int | None = None
    response_id: str | None = None  # /v1/responses: the id its backend now stores
    cached_tokens: int | None = None  # the prompt tokens its backend served from its prefix cache
    # A fail-open end's tenant (no decision holds it): its API key's name and its client's address,
    # as a decision's features carry them, so that what it used is counted after the fact.
    client_key: str | None = None
    client_addr: str | None = None
    tenant: str | None = None  # and its tenant header's value (queue.tenant_header)

    @classmethod
    def first(cls, decision_id: str, backend: str, response_id: str | None = None) -> Outcome:
        return cls(OutcomeKind.FIRST, decision_id, backend, response_id=response_id)

    @classmethod
    def end(
        cls,
        decision_id: str | None,
        backend: str,
        status: int,
        sent: bool = True,
        ttft: float | None = None,
        duration: float | None = None,
        cut: bool = False,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        response_id: str | None = None,
        cached_tokens: int | None = None,
        client_key: str | None = None,
        client_addr: str | None = None,
        tenant: str | None = None,
    ) -> Outcome:
        return cls(
            OutcomeKind.END,
            decision_id,
            backend,
            status,
            sent,
            ttft,
            duration,
            cut,
            prompt_tokens,
            completion_tokens,
            response_id,
            cached_tokens,
            client_key,
            client_addr,
            tenant,
        )

    @classmethod
    def tried(cls, backend: str, status: int) -> Outcome:
        return cls(OutcomeKind.TRY, None, backend, status)

    @classmethod
    def drop(cls, decision_id: str) -> Outcome:
        return cls(OutcomeKind.DROP, decision_id)


# -- messages Lua sends --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decide:
    decision_id: str
    features: Features
    body: str | None = None  # the request's body, sent when the exact index needs its token ids


@dataclass(frozen=True, slots=True)
class Report:
    outcomes: tuple[Outcome, ...]


@dataclass(frozen=True, slots=True)
class PeersQuery:
    fingerprint: str | None = None  # of the settings Nginx was rendered with (kvgate.agreement)


@dataclass(frozen=True, slots=True)
class ModelsQuery:
    pass


@dataclass(frozen=True, slots=True)
class KeysQuery:
    pass


Message = Decide | Report | PeersQuery | ModelsQuery | KeysQuery


# -- replies the sidecar sends -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DecisionReply:
    decision_id: str
    candidates: tuple[Candidate, ...]  # primary first; empty when no backend is eligible
    route: str  # the display label Nginx puts in X-Kvgate-Route
    priority: int | None = None  # to write into the request body, for vLLM's priority scheduling
    prefill: tuple[Candidate, ...] = ()  # disaggregated: the prefill leg's candidates
    first_byte_ms: tuple[int, ...] = ()  # per candidate: how long a try waits for its first byte
    max_tokens: int | None = None  # to write into the body: the request had none, a token limit applies


@dataclass(frozen=True, slots=True)
class QueuedReply:
    """The request waits in the gateway queue; its decision follows on the same connection."""

    decision_id: str


@dataclass(frozen=True, slots=True)
class ErrorReply:
    code: ErrorCode
    message: str
    retry_after: int | None = None  # seconds, for rate_limited, queue_* and slo_shed


@dataclass(frozen=True, slots=True)
class PeersReply:
    version: int
    peers: tuple[Candidate, ...]
    known: int = 0  # backends the sidecar knows, eligible or not: fewer peers means a degraded fleet
    fingerprint: str = ""  # of the settings the sidecar runs (kvgate.agreement)
    auth: bool = False  # the sidecar's auth and rate limits: where Nginx's differ, it fails closed
    limits: bool = False


@dataclass(frozen=True, slots=True)
class ModelsReply:
    cards: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True, slots=True)
class KeysReply:
    """The API keys Nginx checks, by hash (never the keys themselves)."""

    version: int
    keys: Mapping[str, str]  # sha256 hex -> key name
    # key name -> its priority class, where not 0: what Nginx forwards when it routes on its own
    priorities: Mapping[str, int] = field(default_factory=dict)
    # key name -> (requests, tokens) a minute, where limited: what Nginx holds it to on its own
    rates: Mapping[str, tuple[int, int]] = field(default_factory=dict)


Reply = DecisionReply | QueuedReply | ErrorReply | PeersReply | ModelsReply | KeysReply
