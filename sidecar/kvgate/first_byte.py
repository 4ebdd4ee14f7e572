"""How long one try may wait for its response's first byte: the request's expected time to first
token on that backend, learned from the backend's own answers, times a margin, between a floor and a
ceiling (``gateway.first_byte_*``).

Nginx has one read timeout per try. When it fires before any byte reached the client, the next
candidate is tried; a fixed 60 s made every request that met a hung backend wait 60 s, while the same
backend usually answers in well under a second. So each decision carries a budget per candidate:

    margin x (a + b x tokens + d x attention), clamped to [floor, ceiling]

where ``tokens`` is the prefill ahead of the request's first token there (uncached prompt tokens this
replica has routed to it and not yet seen answered, plus the part of this prompt it does not hold),
``attention`` the same prefills' quadratic part (``attention_of``: each uncached token times the
context it attends to), and ``a``, ``b``, ``d`` are fitted per backend, by least squares with
exponential decay and no negative cost, to the time from each decision to its first-byte report
against the work the decision saw. The oldest prefill queued there is counted less the share of it
the fit says is done (``progress``, read by the ledger): a request that comes half way through a
16,000-token prefill waits for half of it. Attention is a small share of a prefill on a GPU at 8B scale (the
fit leaves it out there: ``ATTENTION_SHARE``) and most of a long prefill on a small model or a CPU:
with tokens alone the prediction for a 16k-token prompt there came out a fraction of what it took.

The same read timeout also bounds every later silence of a stream (vLLM sends a stream's headers at
once and its first event with the first token), where it can only cut a stream the client already
has: Nginx gives a stream at least ``gateway.first_byte_stream_min_ms`` whatever this budget says
(lua/kvgate/access.lua). The budget is short only where the prediction can be trusted: a backend
with fewer than ``MIN_SAMPLES`` answers, or whose load is unknown, saturated or preempting (KV cache
near full), gets the ceiling.

A busy backend's fit forgets by answers (``DECAY``); a quiet one's also by time. Placement moves
requests away from a backend its fit expects late, so a fit learned in a slow spell (a neighbour's
restart on shared cores, a long batch) would keep that backend out of the moves for as long as
nothing corrects it, and nothing does once the moves avoid it. Past ``QUIET_S`` without an answer,
the past weighs half as much every ``HALF_LIFE_S``: the next answers outweigh it, and a fit left
with less than ``MIN_WEIGHT`` is not used to place requests (the policy's own pick stands) until
they come. A backend still answering short prompts is not quiet, and short prompts say little of
its cost per token, so one answer far off the line (a request preempted for KV blocks) must not
set that cost: it enters the fit as at most ``OUTLIER`` times what was expected. A restarted engine
starts a new fit (``restart``): the old one described another process.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.config import GatewayConfig

MIN_SAMPLES = 5  # answers a backend must have given before its prediction is used
DECAY = 0.97  # each new answer's weight against the past: the fit follows about the last 30
# A backend answering every few seconds forgets by answers alone: the trace's replays in virtual
# time, where each backend answers about once a second, are the same with and without the clock.
QUIET_S = 10.0
HALF_LIFE_S = 60.0  # past QUIET_S of silence, the weight of everything learned halves this often
MIN_WEIGHT = 2.0  # a fit weighing less (about two recent answers) does not place requests
MAX_SECONDS_PER_TOKEN = 0.01  # 100 tokens/s: slower than any real prefill; bounds a noisy slope
MAX_SECONDS_PER_ATTENTION = 0.01  # per token per 1,000 tokens of context: the same bound
# Attention enters the fit only when the line with it predicts the last RECENT answers better than
# the line on tokens alone, by their median relative error (the error placement and the SLO live
# with), and accounts for at least ATTENTION_SHARE of the mean first byte: where a prefill's cost
# follows its tokens (a GPU at 8B scale) it is mostly a second copy of them that fits the queues'
# noise. Without the second test the quiet tenant's p90 of `kvgate-bench fairness` rose by 3-11 %.
# The first replaced a test of the variance explained, which the longest prompts' seconds decide: on
# long documents beside short chats (two tiny-model profiles) it kept the line on tokens, whose base
# then put a 100-token chat at 30-50 ms against 11 ms served.
RECENT = 64
ATTENTION_SHARE = 0.5
# A fit whose cost of work explains less of the mean first byte than this is blind to the queue
# (``sees_queue``). On two real vLLM servers after a restart both fits had a slope under 1e-7 s per
# token: positive, and no guard against sending one of them every request of a burst.
QUEUE_SHARE = 0.1
BLIND_REACH = 2.0  # a blind fit's budget holds up to this many times the mean work it has seen
# An answer enters the fit as at most OUTLIER times what the fit expected of it (of LINE_FLOOR_S at
# least: a line near 0 for a short prompt must not hold its answers near 0 too). One request
# preempted for KV blocks (1.15 s where 0.10 s was expected, two tiny-model profiles) raised its
# backend's cost per token by 70 %; placement then kept long prompts off that backend, so no answer
# came to correct it, and the flood of `kvgate-bench fairness` waited 25 s at the gateway beside a
# backend 5 % used. A backend that really slowed down is still followed: each answer may raise the
# fit by up to OUTLIER times its share. 4, the first-byte margin's default: 2 and 3 made the mixed
# workload's placement worse at 2x (docs/benchmarks.md, "One slow answer").
OUTLIER = 4.0
LINE_FLOOR_S = 0.01  # about the fastest first byte a real server gives (tiny model, CPU: 11-18 ms)
# No prefill is counted done before its first byte comes, however long it has run (``progress``).
PROGRESS_CAP = 0.9


Work = tuple[int, float]  # prefill tokens and their attention (``attention_of``)


def attention_of(uncached: int, prompt: int) -> float:
    """The quadratic part of prefilling a prompt's last ``uncached`` tokens: each of them times the
    context it attends to (the cached part plus half the uncached), in thousands of tokens."""
    return uncached * (max(prompt, uncached) - uncached / 2) / 1000.0


@dataclass(slots=True)
class _Fit:
    """Decayed sums of (work tokens t, their attention q, seconds to the first byte y) for one
    backend."""

    w: float = 0.0
    t: float = 0.0
    q: float = 0.0
    y: float = 0.0
    tt: float = 0.0
    qq: float = 0.0
    tq: float = 0.0
    ty: float = 0.0
    qy: float = 0.0
    # the last RECENT answers as they came, (t, q, y): the candidates' median error (``_missed``)
    recent: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=RECENT))
    n: int = 0
    at: float = 0.0  # when the last answer came (the ledger's clock)
    # model() until the next answer: every decision reads each backend's fit for its expectation
    # and whether it sees the queue, and each candidate's budget reads it again.
    fitted: tuple[float, float, float] | None = None

    def add(self, t: float, q: float, y: float, at: float) -> None:
        self.fitted = None
        d = DECAY * self.aged(at)  # a first answer has no past to weigh
        self.at = at
        self.w = self.w * d + 1.0
        self.t, self.q, self.y = self.t * d + t, self.q * d + q, self.y * d + y
        self.tt, self.qq, self.tq = self.tt * d + t * t, self.qq * d + q * q, self.tq * d + t * q
        self.ty, self.qy = self.ty * d + t * y, self.qy * d + q * y
        self.recent.append((t, q, y))
        self.n += 1

    def aged(self, now: float) -> float:
        """What the past still weighs at ``now``: 1 until ``QUIET_S`` after the last answer, then
        halving every ``HALF_LIFE_S``. Scaling every sum alike leaves the fitted line as it was;
        it only gives the next answers more say, and ``weight`` less trust."""
        return float(0.5 ** (max(0.0, now - self.at - QUIET_S) / HALF_LIFE_S))

    def weight(self, now: float) -> float:
        return self.w * self.aged(now)

    def model(self) -> tuple[float, float, float]:
        """(seconds at no work, seconds per token, seconds per token per 1,000 tokens of context),
        all at least 0. The line on tokens, unless adding attention (alone or beside tokens, with no
        negative cost) takes at least ``ATTENTION_SHARE`` of the mean first byte and predicts the
        recent answers better (``_missed``)."""
        if self.fitted is None:
            self.fitted = self._solve()
        return self.fitted

    def _solve(self) -> tuple[float, float, float]:
        w = self.w
        mt, mq, my = self.t / w, self.q / w, self.y / w
        stt, sqq, stq = self.tt / w - mt * mt, self.qq / w - mq * mq, self.tq / w - mt * mq
        sty, sqy = self.ty / w - mt * my, self.qy / w - mq * my
        if stt <= (0.05 * mt) ** 2 + 1.0:  # every answer had about the same work: a rate through 0
            slope = my / mt if mt > 0 else 0.0
            return (my if mt <= 0 else 0.0), min(slope, MAX_SECONDS_PER_TOKEN), 0.0
        slopes = [(sty / stt, 0.0) if sty > 0 else (0.0, 0.0)]  # (b, d): the line on tokens first
        if sqq > (0.05 * mq) ** 2 + 1e-9 and sqy > 0:
            slopes.append((0.0, sqy / sqq))
            det = stt * sqq - stq * stq
            if det > 1e-9 * stt * sqq:  # not one the other's multiple
                b, d = (sty * sqq - sqy * stq) / det, (sqy * stt - sty * stq) / det
                if b >= 0 and d >= 0:
                    slopes.append((b, d))
        fits: list[tuple[float, float, float]] = []
        for b, d in slopes:
            b, d = min(b, MAX_SECONDS_PER_TOKEN), min(d, MAX_SECONDS_PER_ATTENTION)
            if not fits or d * mq >= ATTENTION_SHARE * my:
                fits.append((max(0.0, my - b * mt - d * mq), b, d))
        return fits[0] if len(fits) == 1 else min(fits, key=self._missed)

    def _missed(self, fit: tuple[float, float, float]) -> float:
        """The median of ``fit``'s relative errors on the last ``RECENT`` answers."""
        a, b, d = fit
        errors = sorted(abs(a + b * t + d * q - y) / max(y, 1e-3) for t, q, y in self.recent)
        return errors[len(errors) // 2]


class FirstByteBudget:
    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # the ledger's: virtual replays run the fits on their own clock
        self._fits: dict[str, _Fit] = {}

    def learn(self, backend: str, work: int, seconds: float, attention: float = 0.0) -> None:
        """A decision that saw ``work`` tokens ahead on ``backend`` (``attention``: their quadratic
        part) got its first byte ``seconds`` after it was made (now)."""
        if not (seconds >= 0.0 and math.isfinite(seconds) and math.isfinite(attention)):
            return
        fit = self._fits.setdefault(backend, _Fit())
        if (line := _line(fit, work, attention)) is not None:
            seconds = min(seconds, OUTLIER * max(line, LINE_FLOOR_S))
        fit.add(float(work), max(0.0, attention), seconds, self.clock())

    def restart(self, backend: str) -> None:
        """``backend``'s engine started again: its fit starts over."""
        self._fits.pop(backend, None)

    def predict(self, backend: str, work: int, attention: float = 0.0) -> float | None:
        """Expected seconds to the first byte, for placement: None while the backend has answered
        too rarely, or so long ago that its fit weighs less than ``MIN_WEIGHT``."""
        fit = self._fits.get(backend)
        if fit is None or fit.weight(self.clock()) < MIN_WEIGHT:
            return None
        return _line(fit, work, attention)

    def progress(self, backend: str, tokens: int, attention: float, elapsed: float) -> float:
        """The share of a prefill of ``tokens`` (``attention``: their quadratic part) that
        ``backend`` has done ``elapsed`` seconds after it could start: the seconds its fit says
        that work costs, spent at that rate, up to ``PROGRESS_CAP``. 0 before the fit is used."""
        fit = self._fits.get(backend)
        if fit is None or fit.n < MIN_SAMPLES or elapsed <= 0.0:
            return 0.0
        _, b, d = fit.model()
        cost = b * tokens + d * attention
        return min(PROGRESS_CAP, elapsed / cost) if cost > 0.0 else 0.0

    def sees_queue(self, backend: str) -> bool:
        """Whether ``backend``'s prediction grows with the prefill queued ahead: whether the work
        its answers saw explains at least ``QUEUE_SHARE`` of their mean first byte. A fit from
        answers whose first byte did not follow their work (prompts of one size, a noisy host) has
        no cost per token worth the name, and predicts about the same seconds behind one request as
        behind twenty."""
        fit = self._fits.get(backend)
        if fit is None or fit.n < MIN_SAMPLES or fit.y <= 0.0:
            return False
        _, b, d = fit.model()
        return (b * fit.t + d * fit.q) / fit.y >= QUEUE_SHARE

    def budget_ms(self, backend: str, work: int, trusted: bool, attention: float = 0.0) -> int:
        """The first-byte timeout of one try on ``backend``; ``trusted``: its load is known and it is
        neither saturated nor short of KV cache. A fit blind to the queue (``sees_queue``) is not
        trusted with more than ``BLIND_REACH`` times the mean work its answers saw: it would give a
        long prompt the floor (``first_byte_min_ms``), and a prefill longer than that would time
        out on every candidate in turn."""
        c = self.config
        fit = self._fits.get(backend)
        within = fit is not None and (self.sees_queue(backend) or work * fit.w <= BLIND_REACH * fit.t)
        # A quiet backend's fit still bounds its budget: its answers, however old, say more than
        # the ceiling does.
        expected = _line(fit, work, attention) if fit is not None and trusted and within else None
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
        a, b, d = fit.model()
        return {
            "samples": fit.n,
            "base_s": _figure(a),
            "s_per_1k_tokens": _figure(b * 1000),
            "s_per_1k_tokens_per_1k_context": _figure(d * 1000),
            "mean_work_tokens": round(fit.t / fit.w),
            "sees_queue": self.sees_queue(backend),
            "weight": _figure(fit.weight(self.clock())),
        }


def _line(fit: _Fit, work: int, attention: float) -> float | None:
    """The fit's seconds to the first byte behind ``work``; None before ``MIN_SAMPLES`` answers."""
    if fit.n < MIN_SAMPLES:
        return None
    a, b, d = fit.model()
    return a + b * work + d * attention


def _figure(x: float) -> float:
    """Three significant digits: a slope of 1e-5 s per 1,000 tokens is not 0.0 (rounding to four
    places showed blind and seeing fits alike)."""
    return float(f"{x:.3g}")
