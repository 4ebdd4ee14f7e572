"""The streaming client of live runs: each request sent at its arrival time over one shared
session, its first token and every later one timed as a client sees them, and the backends'
counters read before and after."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate_bench import report
from kvgate_bench.report import Sample
from kvgate_bench.workloads import BenchRequest

COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm_sim_step_overrun_seconds_total",
    "vllm_sim_step_busy_seconds_total",
)


@dataclass
class LiveRun:
    samples: list[Sample]
    makespan_wall: float
    send_lag_p99: float
    backend_deltas: dict[str, dict[str, float]]


async def scrape_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        text = await resp.text()
    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def _reason(status: int, body: bytes) -> str:
    """An error answer as the report names it: the status and the server's own message."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:120].decode(errors="replace")
    return report.http_error(status, message)


def errors_by_reason(samples: Sequence[Sample]) -> str:
    """The failed requests' reasons, most frequent first: what 'errors N' was made of."""
    counts: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            counts[s.error or "unknown"] = counts.get(s.error or "unknown", 0) + 1
    return "; ".join(f"{n} x {why}" for why, n in sorted(counts.items(), key=lambda kv: -kv[1])[:5])


def served_model(url: str) -> str:
    """The first model a URL serves (its /v1/models), for a run that names none."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise SystemExit(
            f"kvgate-bench: no --model given and {url}/v1/models did not name one: {exc}"
        ) from None


def carries_token(chunk: Mapping[str, Any]) -> bool:
    """Whether a stream's chunk is its first token: it has text, or it ends the answer (a first
    token that is end-of-sequence comes with no text, and is still the first token). Chat's opening
    chunk, the role alone, carries none."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
    return bool(text) or bool(c.get("finish_reason"))


async def one_request(session: aiohttp.ClientSession, url: str, r: BenchRequest, body: bytes) -> Sample:
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    n = 0
    backend = ""
    try:
        async with session.post(
            url + r.path, data=body, headers={"Content-Type": "application/json", **r.headers}
        ) as resp:
            backend = resp.headers.get("X-Kvgate-Backend", "")
            if resp.status != 200:
                why = _reason(resp.status, await resp.read())
                return Sample(
                    0.0, None, time.perf_counter() - t0, 0, False, backend, r.prompt_tokens, error=why
                )
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                if first is None:
                    if not carries_token(json.loads(line[6:])):
                        continue
                    first = time.perf_counter()
                    last = first
                    n = 1
                elif b'"choices":[]' not in line:
                    last = time.perf_counter()
                    n += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        why = f"{type(exc).__name__}: {exc}"[:200]
        return Sample(0.0, None, time.perf_counter() - t0, n, False, backend, r.prompt_tokens, error=why)
    if first is None:
        why = "the stream ended without a token"
        return Sample(0.0, None, time.perf_counter() - t0, 0, False, backend, r.prompt_tokens, error=why)
    itl = (last - first) / (n - 1) if n > 1 else None
    return Sample(first - t0, itl, last - t0, n, True, backend, r.prompt_tokens)


async def run_live(
    url: str | Sequence[str],
    reqs: Sequence[BenchRequest],
    rate_factor: float,
    backends: Sequence[str],
    progress: Callable[[int, int], None] | None = None,
) -> LiveRun:
    """Send ``reqs`` at ``arrival / rate_factor`` wall seconds; ``rate_factor`` = speed-up x time scale.
    Several URLs (gateway replicas): each request to one of them at random (seeded), as a Kubernetes
    Service spreads new connections."""
    urls = [url] if isinstance(url, str) else list(url)
    pick = random.Random(0)
    to = [urls[pick.randrange(len(urls))] for _ in reqs]
    bodies = [json.dumps(r.body()).encode() for r in reqs]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        before = {b: await scrape_counters(session, b) for b in backends}
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.5
        lags: list[float] = []
        done = 0

        async def fire(i: int, r: BenchRequest) -> Sample:
            nonlocal done
            at = start + r.arrival / rate_factor
            await asyncio.sleep(max(0.0, at - loop.time()))
            lags.append(loop.time() - at)
            s = await one_request(session, to[i], r, bodies[i])
            done += 1
            if progress is not None and (done % 20 == 0 or done == len(reqs)):
                progress(done, len(reqs))
            return s

        samples = await asyncio.gather(*(fire(i, r) for i, r in enumerate(reqs)))
        makespan = loop.time() - start
        after = {b: await scrape_counters(session, b) for b in backends}
    deltas = {b: {k: after[b][k] - before[b][k] for k in COUNTERS} for b in backends}
    return LiveRun(list(samples), makespan, report.pct(lags, 0.99), deltas)


def gateway_ttfts(access_log: Path) -> list[float]:
    """TTFTs kvgate measured itself (``ttft=`` of its access log format; streams that answered 200)."""
    out: list[float] = []
    if not access_log.exists():
        return out
    for line in access_log.read_text().splitlines():
        status = line.split('" ', 1)[1].split(" ", 1)[0] if '" ' in line else ""
        for field in line.split():
            if field.startswith("ttft=") and field[5:] not in ("", "-") and status == "200":
                out.append(float(field[5:]))
    return out
