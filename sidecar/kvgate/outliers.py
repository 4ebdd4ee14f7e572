"""Passive health: outlier detection from the outcomes Nginx reports, the way Envoy does it.

A backend that fails ``consecutive`` requests in a row, by its own fault, is ejected for a base time
that grows with each ejection (``base x ejections``, at most ``max``). When the time is up it is
readmitted on probation: its next request is the probe, one failure ejects it again at once, one
success ends the probation. At most a share of the fleet is ejected at a time, and never all of it: a
fleet that fails everywhere is routed anyway, and the failure is the backends' to show.

Only failures the backend caused count: a refused or reset connection, a timeout waiting for it, a 5xx
it answered, a response it cut short. A client that goes away (Nginx's 499) is neither a failure nor
a success. Active health (``/health`` and ``/metrics`` scrapes) is separate, in the registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.config import OutlierConfig

CLIENT_CLOSED = 499  # Nginx's status for a client that closed the connection first


def failure_reason(status: int, cut: bool) -> str | None:
    """Why this outcome is the backend's failure, or None when it is not one."""
    if cut:
        return "cut stream"
    if status == 0:
        return "no response"
    if status == CLIENT_CLOSED:
        return None
    if status == 504:
        return "timeout"
    if status >= 500:
        return f"status {status}"
    return None


def refused(status: int) -> bool:
    """The backend answered with a client error (a prompt too long, a bad parameter): it ran
    nothing for the request. Nginx's 499 is the client's leaving, not the backend's answer."""
    return 400 <= status < 500 and status != CLIENT_CLOSED


@dataclass(slots=True)
class OutlierState:
    """One backend's record."""

    consecutive: int = 0  # backend-caused failures in a row
    ejections: int = 0  # how many times ejected recently (sets the next ejection's length)
    ejected_until: float | None = None
    probation: bool = False  # readmitted after an ejection; the next outcome decides
    last_reason: str | None = None
    last_ejection_end: float = -math.inf


class OutlierDetector:
    def __init__(self, config: OutlierConfig) -> None:
        self.config = config

    def ejection_time(self, state: OutlierState) -> float:
        return min(self.config.max_ejection_s, self.config.base_ejection_s * max(1, state.ejections))

    def max_ejected(self, fleet: int) -> int:
        """How many of ``fleet`` backends may be out at once: the configured share, at least one, never
        all of them."""
        share = max(1, math.floor(fleet * self.config.max_ejection_percent / 100))
        return max(0, min(share, fleet - 1))

    def record(
        self, state: OutlierState, reason: str | None, now: float, ejected_now: int, fleet: int
    ) -> bool:
        """Apply one outcome (``reason`` None: a success). True when the backend must be ejected now."""
        if not self.config.enabled:
            return False
        if reason is None:
            state.consecutive = 0
            state.probation = False
            return False
        state.consecutive += 1
        state.last_reason = reason
        if state.ejected_until is not None:
            return False  # already out (a request routed before the ejection)
        if not state.probation and state.consecutive < self.config.consecutive:
            return False
        if ejected_now >= self.max_ejected(fleet):
            return False
        if now - state.last_ejection_end > self.config.max_ejection_s:
            state.ejections = 0  # healthy for long enough: start over at the base time
        state.ejections += 1
        state.ejected_until = now + self.ejection_time(state)
        state.probation = False
        return True

    def expire(self, state: OutlierState, now: float) -> bool:
        """True when the ejection is over: the backend comes back on probation."""
        if state.ejected_until is None or now < state.ejected_until:
            return False
        state.ejected_until = None
        state.last_ejection_end = now
        state.probation = True
        state.consecutive = 0
        return True
