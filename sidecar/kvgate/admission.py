"""Admission: who may send a request now, and in which class it waits.

A request is counted against its API key's and its client address's rate limits when it is decided
(its prompt's estimated tokens plus the output it may generate), corrected by the usage the backend
reports at its end, and given back when it never runs (it left the gateway queue, or its client went
away). Under a token limit a request without ``max_tokens`` is given one, so no stream outruns its
budget. The class a request waits in (vLLM's priority: lower goes first) comes from the client when
clients may choose, else from its key.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import OrderedDict

from kvgate.config import Config
from kvgate.features import Features
from kvgate.limits import DEFAULT_OUTPUT_TOKENS, RateLimiter
from kvgate.messages import KeysReply, Outcome
from kvgate.metrics import SidecarMetrics

MAX_ADMITTED = 100_000  # decisions whose token count awaits its correction (bounded: reports can be lost)


class RateLimited(Exception):
    def __init__(self, retry_after: float) -> None:
        super().__init__(f"rate limited; retry after {retry_after:.0f}s")
        self.retry_after = retry_after


class Admission:
    def __init__(self, config: Config, metrics: SidecarMetrics, limiter: RateLimiter | None) -> None:
        self.config = config
        self.metrics = metrics
        self.limiter = limiter
        # decision id -> (identities, tokens counted at admission, max_tokens given), until it ends
        self._admitted: OrderedDict[str, tuple[list[str], int, int | None]] = OrderedDict()
        self._key_priority = {k.name: k.priority for k in config.auth.keys if k.priority is not None}

    def __len__(self) -> int:
        return len(self._admitted)

    def priority_of(self, f: Features) -> int:
        """The request's class in the gateway queue: what the client asked for when clients may
        choose, else its API key's, else 0 (vLLM's sense: lower goes first)."""
        if f.priority is not None and self.config.queue.client_priority:
            return f.priority
        if f.client_key is not None:
            return self._key_priority.get(f.client_key, 0)
        return 0

    def admit(self, did: str, f: Features) -> None:
        """Count the request against its key's and its address's limits, or raise RateLimited. Under
        a token limit, a request without max_tokens is given one (what the limit has left after its
        prompt, shared among its ``n`` completions, at most ``limits.default_max_tokens``), counted
        as such; a request's output counts once per completion."""
        if self.limiter is None:
            return
        identities = identities_of(f.client_key, f.client_addr)
        if not identities:
            return
        now = time.time()
        output, given = f.max_tokens, None
        if output is None:
            room = self.limiter.headroom(identities, now)
            if room is not None:
                # each of n completions may generate max_tokens: what is left is shared among them
                share = (int(room) - f.est_tokens) // f.completions
                output = given = max(1, min(self.config.limits.default_max_tokens, share))
        tokens = f.est_tokens + f.completions * (output if output is not None else DEFAULT_OUTPUT_TOKENS)
        retry = self.limiter.admit(identities, tokens, now)
        if retry is not None:
            self.metrics.rate_limited.labels(identities[0].partition(":")[0]).inc()
            raise RateLimited(retry)
        self._admitted[did] = (identities, tokens, given)
        if len(self._admitted) > MAX_ADMITTED:
            self._admitted.popitem(last=False)

    def given_max_tokens(self, did: str) -> int | None:
        """The max_tokens admission gave this request (to write into its body), if any."""
        admitted = self._admitted.get(did)
        return None if admitted is None else admitted[2]

    def unadmit(self, did: str) -> None:
        """A request that never ran gives its admitted tokens back."""
        admitted = self._admitted.pop(did, None)
        if admitted is not None and self.limiter is not None:
            identities, counted, _ = admitted
            self.limiter.correct(identities, -counted, time.time())

    def settle(self, o: Outcome) -> None:
        """The request ended: correct its token count from the usage the backend reported."""
        if o.decision_id is None or self.limiter is None:
            return
        admitted = self._admitted.pop(o.decision_id, None)
        if admitted is None or o.prompt_tokens is None or o.completion_tokens is None:
            return
        identities, counted, _ = admitted
        self.limiter.correct(identities, o.prompt_tokens + o.completion_tokens - counted, time.time())

    def count_unrouted(self, o: Outcome) -> None:
        """A request Nginx routed on its own (the sidecar was slow or away) ended: it counts against
        its key's and its address's limits now, by the usage its backend reported. It was served
        uncounted; counted late, it holds its client back for the rest of the window as a counted
        one would have (a client cannot slow the sidecar down to escape its limits)."""
        if o.decision_id is not None or self.limiter is None:
            return
        identities = identities_of(o.client_key, o.client_addr)
        if identities:
            used = (o.prompt_tokens or 0) + (o.completion_tokens or 0)
            self.limiter.count(identities, used, time.time())

    def keys(self) -> KeysReply:
        """The hashed API keys Nginx checks (versioned, so Nginx re-reads them only on change)."""
        keys = {k.sha256: k.name for k in self.config.auth.keys}
        classes = {k.name: k.priority for k in self.config.auth.keys if k.priority}
        rates = {}
        if (limiter := self.limiter) is not None:  # what Nginx holds each key to on its own
            for k in self.config.auth.keys:
                if (rate := limiter.rate(f"key:{k.name}")).limited:
                    rates[k.name] = (rate.requests_per_minute, rate.tokens_per_minute)
        version = zlib.crc32(json.dumps([keys, classes, rates], sort_keys=True).encode())
        return KeysReply(version, keys, classes, rates)


def identities_of(client_key: str | None, client_addr: str | None) -> list[str]:
    """Who a request counts against: its API key (by name) and its client's address."""
    return ([f"key:{client_key}"] if client_key else []) + ([f"ip:{client_addr}"] if client_addr else [])
