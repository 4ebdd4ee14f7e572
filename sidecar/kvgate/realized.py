"""How much of the prefix the index credits a backend with that backend then serves from its cache.

The approximate index records where the gateway sent each prompt, not what the engine kept: under
eviction it credits backends with prefixes they dropped (on the conversation trace it predicted 2.6x
the cached tokens the engines delivered), so the prefill counted ahead of a request there is too
little and its expected first byte too early. Each scrape gives the engine's own prefix-cache hit
rate since the last one (its hit and query counters, in tokens); set against the hit rate the index
credited the requests this gateway sent there meanwhile, it says what share of a credited prefix is
real. Rates, not totals, so that other replicas' and other clients' traffic on the same backend
cancels out. The share scales the credited prefix where the gateway counts prefill (the in-flight
ledger, first-byte budgets, the SLO's predictions); placement weighs the index as it is, after
``kvgate.residency`` has cut what the backend's cache size says it evicted.

Nothing to bring down: one small window per backend, forgotten with the backend.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvgate.features import Features
from kvgate.load import Scraped
from kvgate.policies import uncached_tokens

DECAY = 0.95  # the past's weight at each scrape: about the last 20 scrapes count
MIN_PROMPT = 8192  # prompt tokens routed in the window below which the index is trusted as it is


@dataclass(slots=True)
class _Window:
    hits: float = 0.0  # the engine's prefix-cache hits, in tokens (decayed)
    queries: float = 0.0  # ... and queries
    credited: float = 0.0  # prompt tokens the index credited as held on requests routed there
    prompt: float = 0.0  # prompt tokens routed there
    new_credited: float = 0.0  # since the last scrape
    new_prompt: float = 0.0
    last: tuple[float, float, float] | None = None  # (scraped at, queries, hits) last folded


class Realized:
    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def routed(self, bid: str, prompt: int, credited: int) -> None:
        """A request went to ``bid`` with ``prompt`` tokens, ``credited`` of them held there."""
        w = self._windows.setdefault(bid, _Window())
        w.new_prompt += prompt
        w.new_credited += credited

    def share(self, bid: str, scraped: Scraped | None) -> float:
        """The share of a credited prefix ``bid`` serves from its cache (1 until known), folding in
        its latest scrape first."""
        w = self._windows.get(bid)
        if w is None:
            return 1.0
        q, h = (None, None) if scraped is None else (scraped.prefix_queries, scraped.prefix_hits)
        if (
            q is not None
            and h is not None
            and scraped is not None
            and (w.last is None or w.last[0] != scraped.at)
        ):
            _fold(w, scraped.at, q, h)
        if w.prompt < MIN_PROMPT or w.credited <= 0 or w.queries <= 0:
            return 1.0
        credited_rate = w.credited / w.prompt
        served_rate = w.hits / w.queries
        return max(0.0, min(1.0, served_rate / credited_rate))

    def own(self, bid: str) -> float:
        """The share of the prompt tokens ``bid``'s engine took (its prefix-cache queries) that this
        gateway sent it (1 until known): with other replicas or clients beside it, the share of its
        cache this gateway's requests have filled (``kvgate.residency``). Folded by ``share``."""
        w = self._windows.get(bid)
        if w is None or w.prompt < MIN_PROMPT or w.queries <= 0:
            return 1.0
        return max(0.0, min(1.0, w.prompt / w.queries))

    def uncached(self, f: Features, depth_chunks: int, bid: str, scraped: Scraped | None) -> int:
        """Prompt tokens ``bid`` will likely prefill for this request: those the index says it does
        not hold, plus the share of the credited ones it has not been serving."""
        est = f.est_tokens
        held = est - uncached_tokens(f, depth_chunks)
        if held <= 0:
            return est
        return est - round(self.share(bid, scraped) * held)

    def forget(self, keep: Collection[str]) -> None:
        self._windows = {b: w for b, w in self._windows.items() if b in keep}


def _fold(w: _Window, at: float, queries: float, hits: float) -> None:
    """One scrape: the counters' growth since the last one against what was routed meanwhile. A
    first scrape, or counters that went back (a restarted engine), only set the mark."""
    last, w.last = w.last, (at, queries, hits)
    routed = (w.new_prompt, w.new_credited)
    w.new_prompt = w.new_credited = 0.0
    if last is None or queries < last[1] or hits < last[2]:
        return
    w.hits = DECAY * w.hits + (hits - last[2])
    w.queries = DECAY * w.queries + (queries - last[1])
    w.prompt = DECAY * w.prompt + routed[0]
    w.credited = DECAY * w.credited + routed[1]
