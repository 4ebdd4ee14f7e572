"""Each backend's expected time to a request's first byte, and the placement that follows it.

What the gateway knows of a backend adds up to one figure per request: the prefill this replica has
queued there, plus the part of the prompt that backend does not hold (the prefix index, scaled by
what its engine actually serves: ``kvgate.realized``), through that backend's learned first-byte fit
(``kvgate.first_byte``: seconds = a + b x tokens + d x their attention). Prefix affinity is a term
of it, not a rule: a backend holding the prompt has less of it to prefill. The SLO's judgement
reads these figures (``kvgate.slo``), and so does placement: the policy's pick gives way to the
backend expected first when that one is expected at least ``routing.ttft_margin`` sooner (the fit
is an estimate; a small margin keeps a pick that is as good within its error, so that load and
sessions keep their say).

Pure functions: the planner (``kvgate.planner``) gives them its view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from kvgate.first_byte import Work
from kvgate.policies import Decision, Reason


def expected(
    nodes: Iterable[str],
    queued: Callable[[str], Work],
    own: Callable[[str], Work],
    predict: Callable[[str, int, float], float | None],
) -> dict[str, tuple[float, float]]:
    """Per backend with a fit: the expected seconds to the first byte now (behind the prefill
    ``queued`` there) and idle (its ``own`` uncached part alone)."""
    out: dict[str, tuple[float, float]] = {}
    for n in nodes:
        (qt, qa), (mt, ma) = queued(n), own(n)
        now, idle = predict(n, qt + mt, qa + ma), predict(n, mt, ma)
        if now is not None and idle is not None:
            out[n] = (now, idle)
    return out


def fastest(decision: Decision, now: Mapping[str, float], margin: float) -> Decision:
    """``decision`` with the backend expected first in front (``Reason.TTFT``) when its pick is
    expected at least ``margin`` (a share) later; as it was when the pick has no prediction."""
    first = decision.candidates[0]
    if first not in now:
        return decision
    best = min(now, key=now.__getitem__)
    if best == first or now[best] > (1.0 - margin) * now[first]:
        return decision
    return to_front(decision, best, Reason.TTFT)


def to_front(decision: Decision, backend: str, reason: Reason) -> Decision:
    """``decision`` with ``backend`` tried first, for ``reason``: as many candidates as before."""
    rest = tuple(c for c in decision.candidates if c != backend)
    return dataclasses.replace(
        decision, candidates=(backend, *rest)[: len(decision.candidates)], reason=reason
    )
