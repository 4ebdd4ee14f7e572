"""Rate limits by requests and tokens per API key and per client address, shared through Redis.

Counting is per one-minute window (fixed windows, so a client can use at most twice its rate across
a window edge). A decision checks and counts locally, with no Redis round trip; every ``sync_s`` the
sidecar adds what it counted to ``<prefix>:rl:<window>:<identity>`` in Redis (HINCRBY returns the
total of every replica) and takes that total as its view. So a replica sees the others' use up to one
sync interval late: with R replicas a limit can be overshot by about R x sync_s worth of traffic.

Tokens are prompt tokens (estimated from the prompt's bytes) plus ``max_tokens`` at admission, and are
corrected to what the backend's ``usage`` said when the request ends (Nginx asks vLLM for a stream's
usage and strips it when the client did not ask). A request without ``max_tokens`` under a token
limit is given one (``headroom``): it can never generate more than its key had left. Identities seen
in a window are bounded (``MAX_IDENTITIES``): a client cannot grow this map by cycling addresses.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass

from kvgate.config import AuthConfig, LimitsConfig, Rate
from kvgate.redis_client import REDIS_ERRORS, RedisClient

logger = logging.getLogger(__name__)
WINDOW_S = 60.0
MAX_IDENTITIES = 100_000
DEFAULT_OUTPUT_TOKENS = 256  # a request without max_tokens and no token limit is counted for this many


@dataclass(slots=True)
class _Use:
    window: int
    requests: float = 0.0  # everyone's, as of the last sync, plus ours since
    tokens: float = 0.0
    unsynced_requests: float = 0.0
    unsynced_tokens: float = 0.0


class RateLimiter:
    def __init__(
        self, limits: LimitsConfig, auth: AuthConfig, client: RedisClient | None, prefix: str
    ) -> None:
        self.limits = limits
        self.key_rates = {k.name: k.rate for k in auth.keys if k.rate is not None}
        self.client = client
        self.prefix = prefix
        self._use: OrderedDict[str, _Use] = OrderedDict()

    def __len__(self) -> int:
        return len(self._use)

    def rate(self, identity: str) -> Rate:
        kind, _, name = identity.partition(":")
        if kind == "key":
            return self.key_rates.get(name) or self.limits.per_key
        return self.limits.per_client

    def _current(self, identity: str, window: int) -> _Use:
        use = self._use.get(identity)
        if use is None or use.window != window:
            use = _Use(window)
            self._use[identity] = use
        self._use.move_to_end(identity)
        while len(self._use) > MAX_IDENTITIES:
            self._use.popitem(last=False)
        return use

    def admit(self, identities: list[str], tokens: int, now: float) -> float | None:
        """Count one request of ``tokens`` for every identity, or return the seconds to wait (for
        Retry-After) when one of them is over its limit; nothing is counted then."""
        window = int(now // WINDOW_S)
        uses = []
        for identity in identities:
            rate = self.rate(identity)
            if not rate.limited:
                continue
            use = self._current(identity, window)
            over_requests = rate.requests_per_minute and use.requests + 1 > rate.requests_per_minute
            over_tokens = rate.tokens_per_minute and use.tokens + tokens > rate.tokens_per_minute
            if over_requests or over_tokens:
                return max(1.0, math.ceil((window + 1) * WINDOW_S - now))
            uses.append(use)
        for use in uses:
            _count(use, tokens)
        return None

    def count(self, identities: list[str], tokens: int, now: float) -> None:
        """Count one request of ``tokens`` for every identity, over its limit or not: a request
        already served (Nginx routed it while the sidecar was away)."""
        window = int(now // WINDOW_S)
        for identity in identities:
            if self.rate(identity).limited:
                _count(self._current(identity, window), tokens)

    def headroom(self, identities: list[str], now: float) -> float | None:
        """Tokens left this window under the tightest token limit of ``identities`` (None: none of
        them has one)."""
        window = int(now // WINDOW_S)
        left = None
        for identity in identities:
            limit = self.rate(identity).tokens_per_minute
            if not limit:
                continue
            use = self._use.get(identity)
            used = use.tokens if use is not None and use.window == window else 0.0
            left = limit - used if left is None else min(left, limit - used)
        return left

    def correct(self, identities: list[str], delta_tokens: float, now: float) -> None:
        """The request ended: its tokens were ``delta_tokens`` more (or fewer) than counted."""
        window = int(now // WINDOW_S)
        for identity in identities:
            if not self.rate(identity).limited:
                continue
            use = self._current(identity, window)
            use.tokens = max(0.0, use.tokens + delta_tokens)
            use.unsynced_tokens += delta_tokens

    async def sync(self, now: float) -> None:
        """Exchange counts with the other replicas through Redis (one pipeline)."""
        if self.client is None or not self._use:
            return
        window = int(now // WINDOW_S)
        sent = [
            (i, u, u.unsynced_requests, u.unsynced_tokens) for i, u in self._use.items() if u.window == window
        ]
        if not sent:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for identity, _, requests, tokens in sent:
                    key = f"{self.prefix}:rl:{window}:{identity}"
                    pipe.hincrbyfloat(key, "r", requests)
                    pipe.hincrbyfloat(key, "t", tokens)
                    pipe.expire(key, int(2 * WINDOW_S))
                results = await pipe.execute()
        except REDIS_ERRORS as exc:
            logger.debug("rate-limit sync failed, counting locally: %s", exc)
            return
        for n, (_, use, requests, tokens) in enumerate(sent):
            if use.window != window:
                continue
            # Everyone's totals now, ours included; what was counted during the round trip stays on top.
            use.unsynced_requests -= requests
            use.unsynced_tokens -= tokens
            use.requests = float(results[3 * n]) + use.unsynced_requests
            use.tokens = float(results[3 * n + 1]) + use.unsynced_tokens


def _count(use: _Use, tokens: float) -> None:
    use.requests += 1
    use.tokens += tokens
    use.unsynced_requests += 1
    use.unsynced_tokens += tokens
