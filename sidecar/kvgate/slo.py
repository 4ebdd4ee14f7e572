"""Admission by service-level objective: serve a request where it can still meet its TTFT objective,
hold it at the gateway while it can still make it, refuse it (429) when it cannot and may be refused.

The judgement is pure (``judge``): it reads, per backend of the request's snapshot, the expected
seconds to its first byte now (the prefill this replica has queued there plus the part of the prompt
that backend does not hold) and on that backend idle (the prompt's own part alone), both from the
first-byte model (``kvgate.first_byte``), which the planner gathers. A backend it has too few answers
from has no prediction; with none at all the request goes as planned (nothing is known to break).

``SloGate`` keeps each routed request's objective until its end, to count how many met it: the
goodput the gateway itself sees, beside the shed count (``kvgate_slo_requests_total``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from kvgate.config import Objective, SloConfig
from kvgate.features import Features
from kvgate.messages import Outcome, OutcomeKind
from kvgate.metrics import SidecarMetrics

MAX_PROMISED = 100_000  # routed requests whose objective awaits their end (bounded: reports can be lost)
MAX_RETRY_AFTER_S = 60


class Verdict(str, Enum):
    GO = "go"  # its planned backend is expected to meet the objective (or nothing is known)
    MOVED = "moved"  # the planned backend would break it and another would not: it goes there
    WAIT = "wait"  # none would now, an idle one would: it waits in the gateway queue
    SHED = "shed"  # it can no longer make it and may be refused: 429 with Retry-After
    LATE = "late"  # it can no longer make it and may not be refused: sent as planned


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    backend: str | None = None  # MOVED: where it goes instead
    retry_after: int = 1  # SHED: seconds until the backlog that breaks it should have drained
    expected: float = 0.0  # SHED: the best expected seconds to its first byte, from now


class SloShed(Exception):
    """A sheddable request that cannot meet its TTFT objective: refused with 429 and Retry-After."""

    def __init__(self, retry_after: int, predicted: float, objective: float) -> None:
        """``predicted``: seconds from the request's arrival, as its objective counts them."""
        # In whole milliseconds, rounded up: tenths of a second read "expected 1.0s, past its
        # objective of 1.0s" for a request 40 ms past it.
        super().__init__(
            f"its first token is expected {math.ceil(predicted * 1000 - 1e-6):,} ms after it arrived, "
            f"past its objective of {round(objective * 1000):,} ms"
        )
        self.retry_after = retry_after


def judge(
    ttft_s: float,
    waited: float,
    predictions: Mapping[str, tuple[float, float]],
    planned: str,
    sheddable: bool,
    can_wait: bool,
    movable: bool = True,
) -> Judgement:
    """The verdict for a request with a TTFT objective of ``ttft_s`` that has ``waited`` seconds
    already; ``predictions``: backend -> (expected seconds to its first byte now, there idle);
    ``movable``: it may go elsewhere than ``planned`` (not a session that stays where it is bound)."""
    left = ttft_s - waited
    here = predictions.get(planned)
    if here is None or here[0] <= left:
        return Judgement(Verdict.GO)
    options = predictions if movable else {planned: here}
    best = min(options, key=lambda b: options[b][0])
    expected = options[best][0]
    if expected <= left:
        return Judgement(Verdict.MOVED, best)
    if can_wait and min(p[1] for p in options.values()) <= left:
        return Judgement(Verdict.WAIT)
    if sheddable:
        retry = max(1, min(MAX_RETRY_AFTER_S, math.ceil(expected - left)))
        return Judgement(Verdict.SHED, retry_after=retry, expected=expected)
    return Judgement(Verdict.LATE)


class SloGate:
    """The objectives in force, and each routed request's until its end (to count the ones met)."""

    def __init__(self, config: SloConfig, metrics: SidecarMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._promised: OrderedDict[str, Objective] = OrderedDict()

    def __len__(self) -> int:
        return len(self._promised)

    def objective(self, f: Features) -> Objective | None:
        return self.config.objective(f.model, f.client_key) if self.config.enabled else None

    def sheddable(self, priority: int) -> bool:
        return priority >= self.config.sheddable_priority

    def judged(self, j: Judgement) -> None:
        self.metrics.of(self.metrics.slo_verdicts, j.verdict.value).inc()
        if j.verdict is Verdict.SHED:
            self.metrics.of(self.metrics.slo_requests, "shed").inc()

    def promise(self, decision_id: str, objective: Objective) -> None:
        """A request with an objective was routed: its end says whether it met it."""
        self._promised[decision_id] = objective
        if len(self._promised) > MAX_PROMISED:
            self._promised.popitem(last=False)

    def settle(self, o: Outcome) -> None:
        """A decision ended, or was dropped (which counts nothing: it never ran). A request that
        failed missed its objective; a JSON answer's first token came with its end."""
        if o.decision_id is None:
            return
        objective = self._promised.pop(o.decision_id, None)
        if objective is None or o.kind is OutcomeKind.DROP:
            return
        first = o.ttft if o.ttft is not None else o.duration
        met = o.status == 200 and not o.cut and first is not None and first <= (objective.ttft_s or 0.0)
        tokens = o.completion_tokens
        if (
            met
            and objective.itl_s is not None
            and o.ttft is not None
            and o.duration
            and tokens
            and tokens > 1
        ):
            met = (o.duration - o.ttft) / (tokens - 1) <= objective.itl_s
        self.metrics.of(self.metrics.slo_requests, "met" if met else "missed").inc()
