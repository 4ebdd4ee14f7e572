"""Reads a vLLM backend's load from its Prometheus ``/metrics``, its health and its served models.

Parsing uses prometheus_client's parser, so label order, extra series, comments and the ``_created``
series do not matter. The KV-usage gauge is read under its 0.9.2+ name first and its old name after;
prefix-cache counters likewise. A backend serving several models or engines is summed over series.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.load import Scraped

_NAMES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}


class ScrapeError(Exception):
    pass


def parse_metrics(text: str, at: float) -> Scraped:
    """Load figures from exposition text; raises ScrapeError when it is not Prometheus text or has no
    vLLM request gauges at all."""
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if name.endswith("_created"):
                    continue
                if name.endswith("_total"):
                    name = name[: -len("_total")]
                sums[name] = sums.get(name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:
        raise ScrapeError(f"unparseable metrics: {exc}") from None

    def first(kind: str) -> float | None:
        for name in _NAMES[kind]:
            if name in sums:
                return sums[name]
        return None

    running, waiting = first("running"), first("waiting")
    if running is None and waiting is None:
        raise ScrapeError("no vllm:num_requests_running or vllm:num_requests_waiting in /metrics")
    kv = first("kv")
    return Scraped(
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
        prefix_queries=first("queries"),
        prefix_hits=first("hits"),
        at=at,
    )


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Scraped:
    """One concurrent /metrics + /health probe within ``timeout_s``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def get_metrics() -> str:
        async with session.get(url + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                raise ScrapeError(f"/metrics answered {resp.status}")
            return await resp.text(errors="replace")

    async def get_health() -> None:
        async with session.get(url + "/health", timeout=timeout) as resp:
            if resp.status != 200:
                raise ScrapeError(f"/health answered {resp.status}")

    try:
        text, _ = await asyncio.gather(get_metrics(), get_health())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ScrapeError(f"{type(exc).__name__}: {exc}") from None
    return parse_metrics(text, time.monotonic())


async def served_models(session: aiohttp.ClientSession, url: str, timeout_s: float) -> frozenset[str]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                raise ScrapeError(f"/v1/models answered {resp.status}")
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ScrapeError(f"/v1/models failed: {exc}") from None
    try:
        return frozenset(str(card["id"]) for card in data["data"])
    except (KeyError, TypeError) as exc:
        raise ScrapeError(f"/v1/models has no data[].id: {exc}") from None
