"""Fault injection for one simulated instance, set by CLI flags or the ``/sim/faults`` admin endpoint.

Each field is one failure a gateway must survive. The state is a frozen value that the admin endpoint
replaces whole, so a handler reads one consistent set of faults for the whole request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METRICS_MODES = ("ok", "garbage", "slow", "empty", "absent")  # absent: no /metrics route (404)


@dataclass(frozen=True, slots=True)
class Faults:
    unhealthy: bool = False  # /health answers 503
    latency_ms: float = 0.0  # added before every API request is processed
    hang: bool = False  # accept API requests and /health and never answer
    fail_rate: float = 0.0  # fraction of completion requests that fail with fail_status
    fail_status: int = 500
    abort_after_tokens: int | None = None  # cut streams (the TCP connection) after K tokens
    metrics: str = "ok"  # ok | garbage | slow | empty | absent
    metrics_delay_ms: float = 2000.0  # how slow "slow" metrics are
    health_delay_ms: float = 0.0  # /health answers this late (a busy API server's event loop)
    refuse_for_s: float = 0.0  # stop listening for this long (connections refused), then resume

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Faults | None = None) -> Faults:
        """Validated update of ``base`` (default: no faults) with the fields in ``data``."""
        base = base or cls()
        known = {f.name: f for f in dataclasses.fields(cls)}
        changes: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(known))}")
            changes[key] = value
        out = dataclasses.replace(base, **changes)
        if not isinstance(out.unhealthy, bool) or not isinstance(out.hang, bool):
            raise ValueError("unhealthy and hang must be true or false")
        if not 0.0 <= float(out.fail_rate) <= 1.0:
            raise ValueError("fail_rate must be between 0 and 1")
        if out.fail_status not in (500, 502, 503, 429):
            raise ValueError("fail_status must be one of 429, 500, 502, 503")
        if out.metrics not in METRICS_MODES:
            raise ValueError(f"metrics must be one of {', '.join(METRICS_MODES)}")
        if out.abort_after_tokens is not None and int(out.abort_after_tokens) < 0:
            raise ValueError("abort_after_tokens must be >= 0 or null")
        delays = (out.latency_ms, out.refuse_for_s, out.metrics_delay_ms, out.health_delay_ms)
        if any(float(d) < 0 for d in delays):
            raise ValueError("latency_ms, metrics_delay_ms, health_delay_ms and refuse_for_s must be >= 0")
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
