"""The in-flight ledger: each decision Nginx has not yet reported the end of, where it went and the
prefill it still owes, summed per backend for the policies (``Snapshot.inflight``, ``inflight_tokens``).

A decision is counted when it is committed (``start``), moves when its session turns out bound
elsewhere (``move``), owes no prefill once its first byte is back (``prefill_done``) and leaves at its
end or drop (``finish``, ``drop``); ``_uncount`` is the one place its counts come down (``served``
also takes it out of ``unreported`` once its prompt has been counted). A drop that
overtakes its decision keeps that decision from ever counting; a decision never reported (a gateway
that crashed) stops counting after ``INFLIGHT_EXPIRY_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvgate.first_byte import Work

INFLIGHT_EXPIRY_S = 600.0  # a decision never reported (gateway crash) stops counting after this
DROP_MEMORY_S = 10.0  # a drop that overtook its decision keeps that decision from counting
DROP_MEMORY_MAX = 100_000


@dataclass(slots=True)
class _Entry:
    backend: str
    tokens: int  # uncached prompt tokens still to prefill (0 once the first byte came back)
    at: float
    model: str | None = None
    prompt_bytes: int = 0  # the prompt's size, until the backend has counted its tokens (then 0)
    attention: float = 0.0  # their quadratic part (kvgate.first_byte.attention_of)
    work: int = 0  # prefill tokens ahead of its first token when routed (others' queued and its own)
    work_attention: float = 0.0  # and their quadratic part
    predicted: float | None = None  # its expected seconds to the first byte, when routed
    decision_id: str = ""
    requests: int = 1  # the engine requests it runs: one per completion (``n``)
    output: int = 0  # tokens its completions are expected to write (``GatewayQueue.output``)
    kv: int = 0  # KV cache tokens it may newly take there: its uncached prompt and its output


class FirstByte(NamedTuple):
    """A decision's first byte came back: what ``kvgate.first_byte`` learns from."""

    backend: str
    work: int  # prefill tokens ahead of it when it was routed there
    seconds: float  # from the decision to its first-byte report
    predicted: float | None = None  # what was expected when it was routed (kvgate.first_byte)
    attention: float = 0.0  # the quadratic part of ``work``


class Served(NamedTuple):
    """A prompt the backend has now counted (its first token came back): what the token estimate
    learns from."""

    backend: str
    model: str | None
    prompt_bytes: int


class InflightLedger:
    def __init__(self, known: Callable[[str], bool]) -> None:
        self._known = known  # whether a backend is still a member (a decision may outlive it)
        # When a decision was made and its first byte came: the virtual replay sets its own clock,
        # so the first-byte model (kvgate.first_byte) learns in its time.
        self.clock: Callable[[], float] = time.monotonic
        self._entries: dict[str, _Entry] = {}
        self._dropped: dict[str, float] = {}  # decision id -> when its drop came
        self.counts: dict[str, int] = {}  # backend -> requests routed, not reported
        self.tokens: dict[str, int] = {}  # backend -> their uncached tokens
        self.kv: dict[str, int] = {}  # backend -> the KV cache tokens they may newly take there
        self.attention: dict[str, float] = {}  # backend -> those tokens' quadratic part
        # backend -> decisions whose prompt it may have counted without this replica knowing yet
        # (no first byte reported): the token estimate waits for none (``kvgate.tokens``)
        self.unreported: dict[str, int] = {}
        # backend -> decisions still owing prefill there, oldest first: an engine prefills about in
        # the order requests come, so the oldest is the one in progress
        self._queued: dict[str, dict[str, _Entry]] = {}
        self._head_since: dict[str, float] = {}  # backend -> when its oldest's prefill could start
        # The share of a prefill of (tokens, attention) a backend has done in so many seconds
        # (``FirstByteBudget.progress``); None: none counted.
        self.progress: Callable[[str, int, float, float], float] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def start(
        self,
        decision_id: str,
        bid: str,
        tokens: int,
        now: float,
        model: str | None = None,
        prompt_bytes: int = 0,
        attention: float = 0.0,
        requests: int = 1,
        output: int = 0,
    ) -> bool:
        """Count a decision in flight on ``bid`` with ``tokens`` uncached prompt tokens (``attention``:
        their quadratic part) as ``requests`` engine requests (vLLM runs one per completion) that
        may write ``output`` tokens; False when Nginx dropped it already (its drop report overtook
        the decision)."""
        if self._dropped.pop(decision_id, None) is not None or not self._known(bid):
            return False
        entry = _Entry(
            bid,
            tokens,
            now,
            model,
            prompt_bytes,
            attention,
            decision_id=decision_id,
            requests=requests,
            output=output,
            kv=tokens + output,
        )
        entry.work, entry.work_attention = self.ahead(bid, tokens, attention)
        self._count(entry)
        self._entries[decision_id] = entry
        return True

    def _count(self, entry: _Entry) -> None:
        b = entry.backend
        self.counts[b] = self.counts.get(b, 0) + entry.requests
        self.kv[b] = self.kv.get(b, 0) + entry.kv
        self.tokens[b] = self.tokens.get(b, 0) + entry.tokens
        self.attention[b] = self.attention.get(b, 0.0) + entry.attention
        if entry.prompt_bytes:
            self.unreported[b] = self.unreported.get(b, 0) + 1
        if entry.tokens > 0:
            queue = self._queued.setdefault(b, {})
            if not queue:  # nothing ahead of it: its prefill can start now
                self._head_since[b] = entry.at
            queue[entry.decision_id] = entry

    def _uncount(self, entry: _Entry) -> None:
        """Where the counts ``_count`` raised come down: a decision that ended, or moved."""
        b = entry.backend
        self.counts[b] = max(0, self.counts.get(b, 0) - entry.requests)
        self.kv[b] = max(0, self.kv.get(b, 0) - entry.kv)
        self._reported(entry)
        self._unqueue(entry)

    def _reported(self, entry: _Entry) -> None:
        if entry.prompt_bytes:
            self.unreported[entry.backend] = max(0, self.unreported.get(entry.backend, 0) - 1)

    def _unqueue(self, entry: _Entry) -> None:
        """Its prefill no longer waits on its backend (it ended, moved, or its first byte came)."""
        b = entry.backend
        queue = self._queued.get(b)
        if queue is not None and entry.decision_id in queue:
            oldest = next(iter(queue)) == entry.decision_id
            del queue[entry.decision_id]
            if not queue:
                del self._queued[b]
                self._head_since.pop(b, None)
            elif oldest:  # its prefill is over (or gone): the next one's can start now
                self._head_since[b] = max(self.clock(), next(iter(queue.values())).at)
        self.tokens[b] = max(0, self.tokens.get(b, 0) - entry.tokens)
        left = self.attention.get(b, 0.0) - entry.attention
        self.attention[b] = left if left > 1e-6 else 0.0  # float sums: no residue below zero
        entry.tokens, entry.attention = 0, 0.0

    def ahead(self, bid: str, tokens: int = 0, attention: float = 0.0) -> Work:
        """The prefill queued on ``bid`` (tokens, their quadratic part), plus a request's own. The
        oldest of those prefills is counted less the share ``progress`` says it has done."""
        t, q = self.tokens.get(bid, 0), self.attention.get(bid, 0.0)
        queue = self._queued.get(bid)
        if queue and self.progress is not None:
            head = next(iter(queue.values()))
            done = self.progress(
                bid, head.tokens, head.attention, self.clock() - self._head_since.get(bid, head.at)
            )
            t, q = t - round(done * head.tokens), q - done * head.attention
        return t + tokens, max(0.0, q) + attention

    def move(self, decision_id: str, bid: str, tokens: int, attention: float = 0.0) -> None:
        """The decision now goes to ``bid`` with ``tokens`` uncached prompt tokens (the session it
        belongs to turned out bound there). Nothing when it ended meanwhile (dropped by Nginx)."""
        entry = self._entries.get(decision_id)
        if entry is None or not self._known(bid):
            return
        self._uncount(entry)
        entry.backend, entry.tokens, entry.attention = bid, tokens, attention
        entry.kv = tokens + entry.output
        entry.work, entry.work_attention = self.ahead(bid, tokens, attention)
        self._count(entry)

    def served(self, decision_id: str) -> Served | None:
        """The request's prompt, once: its first byte (or its whole JSON answer) came back, so the
        backend has counted its prompt tokens. None when unknown or already taken."""
        entry = self._entries.get(decision_id)
        if entry is None or entry.prompt_bytes == 0:
            return None
        out = Served(entry.backend, entry.model, entry.prompt_bytes)
        self._reported(entry)
        entry.prompt_bytes = 0
        return out

    def finish(self, decision_id: str) -> None:
        entry = self._entries.pop(decision_id, None)
        if entry is not None:
            self._uncount(entry)

    def overtaken(self, decision_id: str) -> bool:
        """Whether Nginx dropped this decision before it was made (its drop report came first: the
        sidecar answered too late, and the request fell open); forgets the drop."""
        return self._dropped.pop(decision_id, None) is not None

    def drop(self, decision_id: str, now: float) -> None:
        """Nginx will not use this decision: stop counting it, or never start if it comes later."""
        if decision_id in self._entries:
            self.finish(decision_id)
            return
        self._dropped[decision_id] = now
        if len(self._dropped) > DROP_MEMORY_MAX:
            del self._dropped[next(iter(self._dropped))]

    def prefill_done(self, decision_id: str, backend: str, now: float) -> FirstByte | None:
        """The first byte came back from ``backend``: this request no longer waits for prefill. The
        time it took, when the backend it was routed to answered (not a fallback after a failure)."""
        entry = self._entries.get(decision_id)
        if entry is None or entry.work < 0:
            return None
        b = entry.backend
        self._unqueue(entry)
        work, entry.work = entry.work, -1  # once per request
        seconds = now - entry.at
        return FirstByte(b, work, seconds, entry.predicted, entry.work_attention) if backend == b else None

    def expect(self, decision_id: str, predict: Callable[[str, int, float], float | None]) -> float | None:
        """The decision's expected seconds to its first byte on its backend, from the prefill ahead
        of it there (``predict(backend, tokens, attention)``), kept to be set against what comes."""
        entry = self._entries.get(decision_id)
        if entry is None or entry.work < 0:
            return None
        entry.predicted = predict(entry.backend, entry.work, entry.work_attention)
        return entry.predicted

    def expire(self, now: float) -> None:
        for did in [d for d, e in self._entries.items() if now - e.at > INFLIGHT_EXPIRY_S]:
            self.finish(did)
        for did in [d for d, at in self._dropped.items() if now - at > DROP_MEMORY_S]:
            del self._dropped[did]
