"""Routing policies: pure functions of (request, cluster snapshot) with no I/O.

The decision service looks up what a policy needs (the session binding from Redis, the prefix index's
matches), calls the policy, then performs the writes the decision asks for. The benchmark calls the same
functions in virtual time. Every policy returns an ordered candidate list (primary, then distinct
fallbacks) and a short reason code that Nginx puts in ``X-Kvgate-Route``.

``kvgate`` (the default) combines three signals, in order:

1. **session**: the key's bound backend, while it is eligible, not saturated and under its load bound
   (sticky until saturated);
2. **prefix**: the backends that probably hold a prefix of this prompt beyond the part many requests
   share (a common system prompt is no signal) are candidates, credited with the tokens they hold;
3. **ring + load**: else walk the consistent-hash ring from the key, past nodes above ``c x`` their
   weighted fair share (bounded loads, so hot keys spill over instead of piling up), and among the
   first ``CHOICES`` under-bound nodes and the prefix holders pick the one whose first token should
   come soonest: least prefill work queued there plus the part of this prompt it does not hold.
   Past saturation, when no node is under its bound, that choice is made among all of them.

The snapshot they read (room, saturation, the bounded-load share) is ``kvgate.snapshot``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvgate.config import PolicyName
from kvgate.features import CHUNK_BYTES, Features
from kvgate.snapshot import Snapshot

CHOICES = 4  # ring successors a new key may choose between (power of d choices on the ring)


class Reason(str, Enum):
    """Why the primary candidate was chosen."""

    SESSION = "session"  # the session's bound backend
    PREFIX = "prefix"  # the backend holding the deepest prefix of the prompt
    RING = "ring"  # the key's owner on the consistent-hash ring
    LOAD = "load"  # another ring successor, with less prefill work ahead
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOAD = "least_load"
    SLO = "slo"  # the planned backend would break the request's TTFT objective (kvgate.slo)
    TTFT = "ttft"  # another backend is expected to give the first byte sooner (kvgate.expected)
    NO_BACKEND = "no_backend"


class SessionAction(str, Enum):
    """What the decision means for the session key's binding."""

    NONE = "none"  # no key, or a policy without sessions
    KEEP = "keep"  # the binding in force was followed
    BIND = "bind"  # a new key: bind it to the primary
    REBIND = "rebind"  # the bound backend is gone or saturated: move the binding


class RebindCause(str, Enum):
    GONE = "gone"  # unhealthy, drained or removed
    SATURATED = "saturated"


@dataclass(frozen=True, slots=True)
class Request:
    features: Features
    seq: int  # decision sequence number: drives round robin and random
    bound: str | None = None  # the session key's current binding, if any
    prefix_depth: Mapping[str, int] = field(default_factory=dict)  # prefix-index matches
    shared_depth: int = 0  # leading chunks common to many requests (a system prompt)

    def holders(self) -> dict[str, int]:
        """The nodes holding more of this prompt than the part many requests share, with their
        depth: only that part says where *this* conversation's cache sits."""
        return {n: d for n, d in self.prefix_depth.items() if d > self.shared_depth}


@dataclass(frozen=True, slots=True)
class Decision:
    candidates: tuple[str, ...]
    reason: Reason
    session: SessionAction = SessionAction.NONE
    rebind_cause: RebindCause | None = None

    @property
    def label(self) -> str:
        """The display form, in ``X-Kvgate-Route`` and metrics: ``prefix``, ``load/rebind-saturated``."""
        if self.session is SessionAction.REBIND and self.rebind_cause is not None:
            return f"{self.reason.value}/rebind-{self.rebind_cause.value}"
        return self.reason.value


def uncached_tokens(features: Features, depth_chunks: int) -> int:
    """Prompt tokens a backend holding ``depth_chunks`` leading chunks of this prompt must prefill."""
    est = features.est_tokens
    return est - min(est, int(depth_chunks * CHUNK_BYTES / features.bytes_per_token))


def _ring_key(req: Request) -> str:
    f = req.features
    if f.key:
        return f.key
    if f.hashes:
        return f.hashes[0]
    return f"seq:{req.seq}"


def _with_fallbacks(primary: list[str], rest: list[str], limit: int) -> tuple[str, ...]:
    out: list[str] = []
    for n in primary + rest:
        if n not in out:
            out.append(n)
        if len(out) == limit:
            break
    return tuple(out)


def _load_order(snap: Snapshot) -> list[str]:
    return sorted(
        snap.nodes,
        key=lambda n: (
            snap.requests(n) / snap.nodes[n].weight,
            snap.inflight_tokens.get(n, 0),
            n,
        ),
    )


def round_robin(req: Request, snap: Snapshot, limit: int) -> Decision:
    order = sorted(snap.nodes)
    i = req.seq % len(order)
    return Decision(tuple((order[i:] + order[:i])[:limit]), Reason.ROUND_ROBIN)


def random_pick(req: Request, snap: Snapshot, limit: int) -> Decision:
    order = sorted(snap.nodes)
    random.Random(req.seq).shuffle(order)
    return Decision(tuple(order[:limit]), Reason.RANDOM)


def least_load(req: Request, snap: Snapshot, limit: int) -> Decision:
    return Decision(tuple(_load_order(snap)[:limit]), Reason.LEAST_LOAD)


def consistent_hash(req: Request, snap: Snapshot, limit: int) -> Decision:
    return Decision(tuple(itertools.islice(snap.walk(_ring_key(req)), limit)), Reason.RING)


def _best_prefix(req: Request, snap: Snapshot, admits: Callable[[str], bool]) -> list[str]:
    """Under-bound nodes holding the deepest prefix, unless every node holds that depth."""
    depths = {n: d for n, d in req.holders().items() if n in snap.nodes}
    if not depths:
        return []
    best = max(depths.values())
    holders = [n for n, d in depths.items() if d == best]
    if len(holders) == len(snap.nodes) and len(snap.nodes) > 1:
        return []  # the shared part of every prompt (a system prompt): no signal
    ok = [n for n in holders if admits(n)]
    if not ok:
        return []
    if len(ok) == 1:
        return ok
    # Ring order among the holders; stop walking once every holder is placed.
    wanted = set(ok)
    ordered: list[str] = []
    for n in snap.walk(_ring_key(req)):
        if n in wanted:
            ordered.append(n)
            if len(ordered) == len(wanted):
                break
    return ordered


def prefix(req: Request, snap: Snapshot, limit: int) -> Decision:
    best = _best_prefix(req, snap, lambda n: not snap.saturated(n))
    if best:
        return Decision(_with_fallbacks(best, _load_order(snap), limit), Reason.PREFIX)
    return Decision(tuple(_load_order(snap)[:limit]), Reason.LEAST_LOAD)


def _bounded_walk(
    snap: Snapshot, key: str, admits: Callable[[str], bool], limit: int
) -> tuple[list[str], str]:
    """Up to ``limit`` under-bound nodes in ring order, then the over-bound ones met on the way;
    plus the key's owner. Stops early, so a 1,000-node ring costs a few nodes, not all of them."""
    ok: list[str] = []
    over: list[str] = []
    owner = ""
    for n in snap.walk(key):
        owner = owner or n
        (ok if admits(n) else over).append(n)
        if len(ok) >= limit:
            break
    return ok + over, owner


def _prefill_cost(req: Request, snap: Snapshot, node: str) -> int:
    """Prefill work ahead of this request's first token on ``node``: tokens already queued there for
    prefill, plus the part of this prompt the node probably does not hold. A shared prefix (a system
    prompt, a popular document) is credited too: it is real saved work, and the load bound keeps its
    first holder from taking more than ``c x`` its share until the others hold it as well."""
    return snap.inflight_tokens.get(node, 0) + uncached_tokens(req.features, req.prefix_depth.get(node, 0))


def _holder_admits(req: Request, snap: Snapshot) -> Callable[[str], bool]:
    """The bound for the nodes holding this prompt's deepest prefix: from ``load_factor`` towards
    ``holder_load_factor`` with the fourth power of the share of the prompt they hold. Sending the
    request elsewhere costs that share's prefill now and, under cache pressure, a second copy of it
    that evicts what another request would have reused (a tenant's long context, a document asked
    about again). Steep, because a holder of part of a prompt still prefills the rest behind its
    crowd: at half the prompt the bound has moved 1/16 of the way, at 95 % 81 % of it."""
    best = max((d for n, d in req.prefix_depth.items() if n in snap.nodes), default=0)
    return snap.bound_admits(_holder_factor(req, snap, best))


def placement_admits(req: Request, snap: Snapshot) -> Callable[[str], bool]:
    """Each node's own holder bound, from the share of this prompt it holds: what a move to a
    backend expected sooner keeps when that expectation cannot see the queue there
    (``kvgate.planner``)."""
    return snap.bound_admits(lambda n: _holder_factor(req, snap, req.prefix_depth.get(n, 0)))


def _holder_factor(req: Request, snap: Snapshot, depth: int) -> float:
    """c for a node holding ``depth`` chunks of this prompt: ``load_factor`` plus the fourth power
    of the share held times the way to ``holder_load_factor``."""
    est = req.features.est_tokens
    held = 1.0 - uncached_tokens(req.features, depth) / est if est > 0 else 0.0
    low = snap.limits.load_factor
    high = max(low, snap.limits.holder_load_factor)
    return low + (high - low) * held**4


def kvgate(req: Request, snap: Snapshot, limit: int) -> Decision:
    admits = snap.bound_admits()
    key = _ring_key(req)
    walk, owner = _bounded_walk(snap, key, admits, max(limit, CHOICES))
    bound = req.bound
    # Sticky until saturated: a bound session stays put unless its node queues or runs out of KV
    # cache; the fair-share bound only steers where new keys land. A /v1/responses conversation is
    # stuck for good: its previous response is stored on that backend and nowhere else.
    strict = req.features.key_source == "response"
    if bound is not None and bound in snap.nodes and (strict or not snap.saturated(bound)):
        return Decision(_with_fallbacks([bound], walk, limit), Reason.SESSION, SessionAction.KEEP)
    # A new key weighs cache against load: among the first under-bound nodes of its ring walk and the
    # nodes holding a deeper-than-shared prefix of it, the one whose first token comes soonest.
    candidates = [n for n in walk if admits(n)][:CHOICES]
    candidates += [n for n in _best_prefix(req, snap, _holder_admits(req, snap)) if n not in candidates]
    if not candidates:
        # Every node is over its bound or saturated: the key's owner would pile the fleet's overflow
        # on whichever node the ring favours; the least prefill work ahead spreads it.
        candidates = walk
    rank = {n: i for i, n in enumerate(walk)}
    primary = min(candidates, key=lambda n: (_prefill_cost(req, snap, n), rank.get(n, len(rank))))
    depth = req.prefix_depth.get(primary, 0)
    if depth > req.shared_depth and depth > min(req.prefix_depth.get(n, 0) for n in candidates):
        reason = Reason.PREFIX  # the cache it holds decided
    elif primary == owner:
        reason = Reason.RING
    else:
        reason = Reason.LOAD
    fallbacks = _with_fallbacks([primary], walk, limit)
    if bound == primary:
        # Saturated, but nowhere has more room: staying is no rebind (nothing to write, nothing moved).
        return Decision(fallbacks, Reason.SESSION, SessionAction.KEEP)
    if bound is not None:
        cause = RebindCause.GONE if bound not in snap.nodes else RebindCause.SATURATED
        return Decision(fallbacks, reason, SessionAction.REBIND, cause)
    if req.features.key is not None:
        return Decision(fallbacks, reason, SessionAction.BIND)
    return Decision(fallbacks, reason)


POLICIES: dict[PolicyName, Callable[[Request, Snapshot, int], Decision]] = {
    PolicyName.ROUND_ROBIN: round_robin,
    PolicyName.RANDOM: random_pick,
    PolicyName.LEAST_LOAD: least_load,
    PolicyName.CONSISTENT_HASH: consistent_hash,
    PolicyName.PREFIX: prefix,
    PolicyName.KVGATE: kvgate,
}


def decide(name: PolicyName, req: Request, snap: Snapshot, limit: int) -> Decision:
    if not snap.nodes:
        return Decision((), Reason.NO_BACKEND)
    return POLICIES[name](req, snap, limit)
