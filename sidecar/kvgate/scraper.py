"""Reads a backend's load from its Prometheus ``/metrics`` (vLLM's names, or SGLang's), its health and
its served models.

A vLLM exposition is hundreds of lines, almost all histogram buckets, and the sidecar reads five
series of it. prometheus_client's parser builds every family of it; measured under load it took over
half of the sidecar's CPU and held the decision loop for milliseconds per scrape, so decisions missed
their budget. ``parse_metrics`` therefore scans lines: only those starting with a wanted name are
parsed (labels skipped quote-aware, so label order and values do not matter), the rest cost one
``startswith``. ``tests/test_scraper.py`` checks it against prometheus_client's parser on whole
expositions. The KV-usage gauge is read under its 0.9.2+ name first and its old name after;
prefix-cache counters likewise. A backend serving several models or engines is summed over series.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvgate.load import Scraped

# vLLM's names first, then SGLang's (--enable-metrics): running and queued requests, KV token usage
# (0..1) and prompt tokens. SGLang has no prefix-cache counters (only a hit-rate gauge).
SERIES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "prompt_tokens": ("vllm:prompt_tokens", "sglang:prompt_tokens"),
}


class ScrapeError(Exception):
    """The scrape did not give what it asked for."""


class Unhealthy(ScrapeError):
    """The health check failed: refused or reset (``timeout`` False), a status other than 200, or no
    answer within the scrape's timeout (``timeout`` True: a hung server, or only a busy one)."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class LoadUnknown(ScrapeError):
    """The backend is healthy but its metrics (or its model list) did not come: a missing signal,
    not a dead server. vLLM under heavy load can answer ``/metrics`` slowly on every replica."""


# Counters are exposed with _total; both spellings are accepted, _created series are not wanted.
_WANTED = {name for names in SERIES.values() for name in names}

# Series read for one label's value, not summed: waiting requests by why they wait (vLLM 0.1x+:
# "capacity" = no KV blocks free, "deferred" = e.g. awaiting a remote KV transfer), and the cache's
# geometry, which vLLM exposes as labels of an info gauge.
LABELLED_SERIES = {
    "vllm:num_requests_waiting_by_reason": "reason",
    "vllm:cache_config_info": "",
}
_WANTED |= set(LABELLED_SERIES)
_PREFIXES = tuple(sorted(_WANTED))


def _labels(text: str) -> dict[str, str]:
    """``{a="x",b="y"}`` as a dict; quote-aware (a value may hold ``,``, ``}`` or ``\"``)."""
    out: dict[str, str] = {}
    i, n = 1, len(text) - 1
    while i < n:
        eq = text.find("=", i)
        if eq == -1 or eq + 1 >= n or text[eq + 1] != '"':
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
            value.append(text[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
    return out


def _sample(line: str) -> tuple[str, str, float] | None:
    """(name without ``_total``, its labels as written, value) of one exposition line, or None when
    it is not one we read."""
    brace = line.find("{")
    space = line.find(" ")
    end_name = brace if brace != -1 and (space == -1 or brace < space) else space
    if end_name <= 0:
        return None
    name = line[:end_name]
    if name.endswith("_total"):
        name = name[: -len("_total")]
    if name not in _WANTED:
        return None
    rest = line[end_name:]
    labels = ""
    if rest.startswith("{"):
        # Skip the labels: a "}" inside a quoted value does not close them.
        quoted = escaped = False
        for i, ch in enumerate(rest):
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = quoted
            elif ch == '"':
                quoted = not quoted
            elif ch == "}" and not quoted:
                labels, rest = rest[: i + 1], rest[i + 1 :]
                break
        else:
            raise ScrapeError(f"unterminated labels in {line[:80]!r}")
    fields = rest.split()
    if not fields:
        raise ScrapeError(f"no value in {line[:80]!r}")
    try:
        value = float(fields[0])
    except ValueError:
        raise ScrapeError(f"unparseable metrics: value {fields[0][:20]!r} of {name}") from None
    return (name, labels, value) if math.isfinite(value) else None


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def parse_metrics(text: str, at: float) -> Scraped:
    """Load figures from exposition text; raises ScrapeError when it is not Prometheus text or has no
    vLLM request gauges at all."""
    sums: dict[str, float] = {}
    capacity: float | None = None
    cache: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        found = _sample(line)
        if found is None:
            continue
        name, labels, value = found
        if name in LABELLED_SERIES:
            if name == "vllm:cache_config_info":
                cache = _labels(labels)
            elif _labels(labels).get("reason") == "capacity":
                capacity = (capacity or 0.0) + value
            continue
        sums[name] = sums.get(name, 0.0) + value

    def first(kind: str) -> float | None:
        for name in SERIES[kind]:
            if name in sums:
                return sums[name]
        return None

    running, waiting = first("running"), first("waiting")
    if running is None and waiting is None:
        raise ScrapeError(
            "no request gauges in /metrics (vllm:num_requests_running/_waiting, sglang:num_running_reqs/"
            "num_queue_reqs); a backend without them needs metrics: none"
        )
    kv = first("kv")
    return Scraped(
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
        prefix_queries=first("queries"),
        prefix_hits=first("hits"),
        at=at,
        prompt_tokens=first("prompt_tokens"),
        waiting_for_kv=capacity,
        block_size=_int_label(cache, "block_size"),
        kv_blocks=_int_label(cache, "num_gpu_blocks"),
    )


async def scrape(
    session: aiohttp.ClientSession, url: str, timeout_s: float, metrics: str = "auto"
) -> Scraped:
    """One concurrent /metrics + health probe within ``timeout_s``. ``metrics: none``: health only,
    and a load of zero requests, so the policies see kvgate's own in-flight counts. ``auto`` treats a
    server with no ``/metrics`` route at all (404) the same way (SGLang without --enable-metrics,
    TGI's and llama.cpp's servers without it, mocks); a ``/metrics`` that answers anything else it
    cannot read is a ``LoadUnknown``. Health is ``/health`` answering 200, or, for a server with no
    ``/health`` route, ``/v1/models`` answering 200; anything else is ``Unhealthy``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def get_metrics() -> str | None:
        async with session.get(url + "/metrics", timeout=timeout) as resp:
            if resp.status == 404 and metrics == "auto":
                return None
            if resp.status != 200:
                raise LoadUnknown(f"/metrics answered {resp.status}")
            return await resp.text(errors="replace")

    async def get_health() -> None:
        async with session.get(url + "/health", timeout=timeout) as resp:
            status = resp.status
        if status == 200:
            return
        if status in (404, 405):  # no health route: a server that lists its models is up
            async with session.get(url + "/v1/models", timeout=timeout) as resp:
                if resp.status == 200:
                    return
                raise Unhealthy(f"/health answered {status}, /v1/models {resp.status}")
        raise Unhealthy(f"/health answered {status}")

    async def health() -> None:
        try:
            await get_health()
        except TimeoutError:
            raise Unhealthy(f"/health: no answer within {timeout_s * 1000:.0f} ms", timeout=True) from None
        except aiohttp.ClientError as exc:
            raise Unhealthy(f"{type(exc).__name__}: {exc}") from None

    async def load() -> str | None:
        try:
            return await get_metrics()
        except TimeoutError:
            raise LoadUnknown(f"/metrics: no answer within {timeout_s * 1000:.0f} ms") from None
        except aiohttp.ClientError as exc:
            raise LoadUnknown(f"/metrics: {type(exc).__name__}: {exc}") from None

    if metrics == "none":
        await health()
        return Scraped(0.0, 0.0, None, None, None, time.monotonic())
    # Health decides first: a backend that fails it is Unhealthy whatever its metrics did.
    got_health, text = await asyncio.gather(health(), load(), return_exceptions=True)
    if isinstance(got_health, BaseException):
        raise got_health
    if isinstance(text, BaseException):
        raise text
    if text is None:
        return Scraped(0.0, 0.0, None, None, None, time.monotonic(), metrics_less=True)
    try:
        return parse_metrics(text, time.monotonic())
    except ScrapeError as exc:
        raise LoadUnknown(str(exc)) from None


async def served_models(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> dict[str, Mapping[str, Any]]:
    """The backend's ``/v1/models``: each model's card as it gave it (vLLM's carries ``root``,
    ``max_model_len``, ``created``, which clients read), by id."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url + "/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                raise LoadUnknown(f"/v1/models answered {resp.status}")
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise LoadUnknown(f"/v1/models failed: {exc!r}") from None
    try:
        return {str(card["id"]): card for card in data["data"] if isinstance(card, Mapping)}
    except (KeyError, TypeError) as exc:
        raise LoadUnknown(f"/v1/models has no data[].id: {exc}") from None
