"""How long one try may wait for its response's first byte: the request's expected time to first
token on that backend, learned from the backend's own answers, times a margin, between a floor and a
ceiling (``gateway.first_byte_*``).

Nginx has one read timeout per try. When it fires before any byte reached the client, the next
candidate is tried; a fixed 60 s made every request that met a hung backend wait 60 s, while the same
backend usually answers in well under a second. So each decision carries a budget per candidate:

    margin x (a + b x work), clamped to [floor, ceiling]

where ``work`` is the prefill ahead of the request's first token there (uncached prompt tokens this
replica has routed to it and not yet seen answered, plus the part of this prompt it does not hold) and
``a``, ``b`` are fitted per backend, by least squares with exponential decay, to the time from each
decision to its first-byte report against the work the decision saw.

The same read timeout also bounds every later silence of a stream (vLLM sends a stream's headers at
once and its first event with the first token), where it can only cut a stream the client already
has: Nginx gives a stream at least ``gateway.first_byte_stream_min_ms`` whatever this budget says
(lua/kvgate/access.lua). The budget is short only where the prediction can be trusted: a backend
with fewer than ``MIN_SAMPLES`` answers, or whose load is unknown, saturated or preempting (KV cache
near full), gets the ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.config import GatewayConfig

MIN_SAMPLES = 5  # answers a backend must have given before its prediction is used
DECAY = 0.97  # each new answer's weight against the past: the fit follows about the last 30
MAX_SECONDS_PER_TOKEN = 0.01  # 100 tokens/s: slower than any real prefill; bounds a noisy slope


@dataclass(slots=True)
class _Fit:
    """Decayed sums of (work tokens, seconds to the first byte) for one backend."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    n: int = 0

    def add(self, x: float, y: float) -> None:
        self.w = self.w * DECAY + 1.0
        self.x = self.x * DECAY + x
        self.y = self.y * DECAY + y
        self.xx = self.xx * DECAY + x * x
        self.xy = self.xy * DECAY + x * y
        self.n += 1

    def line(self) -> tuple[float, float]:
        """(seconds at no work, seconds per token of work), both at least 0."""
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var <= (0.05 * mx) ** 2 + 1.0:  # every answer had about the same work: a rate through 0
            slope = my / mx if mx > 0 else 0.0
            return (my if mx <= 0 else 0.0), min(slope, MAX_SECONDS_PER_TOKEN)
        slope = min(max(0.0, (self.xy / self.w - mx * my) / var), MAX_SECONDS_PER_TOKEN)
        return max(0.0, my - slope * mx), slope


class FirstByteBudget:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._fits: dict[str, _Fit] = {}

    def learn(self, backend: str, work: int, seconds: float) -> None:
        """A decision that saw ``work`` tokens ahead on ``backend`` got its first byte ``seconds``
        after it was made."""
        if not (seconds >= 0.0 and math.isfinite(seconds)):
            return
        self._fits.setdefault(backend, _Fit()).add(float(work), seconds)

    def predict(self, backend: str, work: int) -> float | None:
        """Expected seconds to the first byte, or None while the backend has answered too rarely."""
        fit = self._fits.get(backend)
        if fit is None or fit.n < MIN_SAMPLES:
            return None
        a, b = fit.line()
        return a + b * work

    def budget_ms(self, backend: str, work: int, trusted: bool) -> int:
        """The first-byte timeout of one try on ``backend``; ``trusted``: its load is known and it is
        neither saturated nor short of KV cache."""
        c = self.config
        expected = self.predict(backend, work) if trusted else None
        if expected is None:
            return c.first_byte_timeout_ms
        ms = round(c.first_byte_margin * expected * 1000)
        return max(c.first_byte_min_ms, min(c.first_byte_timeout_ms, ms))

    def __len__(self) -> int:
        return len(self._fits)

    def forget(self, keep: set[str]) -> None:
        """Backends that left the registry take their fits with them."""
        for b in [b for b in self._fits if b not in keep]:
            del self._fits[b]

    def describe(self, backend: str) -> dict[str, float | int] | None:
        fit = self._fits.get(backend)
        if fit is None:
            return None
        a, b = fit.line()
        return {"samples": fit.n, "base_s": round(a, 4), "s_per_1k_tokens": round(b * 1000, 4)}
