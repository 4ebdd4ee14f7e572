"""How much load one ``vllm-sim`` process carries before its step schedule lags real time.

Starts ``vllm-sim --instances N``, keeps C streaming requests in flight (closed loop, spread evenly
over the instances) for a fixed wall duration at each time scale, and compares the inter-token
latency the clients see with the one the engines simulated (their ITL histograms, divided by the
time scale). The step lag ratio is the simulators' own account: seconds by which step ends overran
their schedule over seconds of scheduled steps (``vllm_sim_step_overrun_seconds_total`` /
``vllm_sim_step_busy_seconds_total``); a run is within budget when it is under 5 %. The client-side
ITL excess adds HTTP and client overhead on top, and the largest ``vllm_sim_step_lag_seconds``
(worst step in a 2 s window) is reported too.

    python -m kvgate_bench.sim_capacity --instances 8 --concurrency 64 --scales 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from kvgate.tools.launcher import Supervisor
from prometheus_client.parser import text_string_to_metric_families

from kvgate_bench.report import write_json
from vllm_sim import tokenizer

BUDGET = 0.05


@dataclass
class Run:
    time_scale: float
    requests: int
    tokens: int
    client_itl_ms: float  # wall, as clients saw it
    engine_itl_ms: float  # simulated ITL / time scale: what a perfect loop would deliver
    excess: float  # client / engine - 1
    lag_ratio: float  # step overrun / scheduled step time, from the simulators' counters
    max_step_lag_ms: float
    ok: bool


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (
                "vllm:inter_token_latency_seconds_sum",
                "vllm:inter_token_latency_seconds_count",
                "vllm_sim_step_lag_seconds",
                "vllm_sim_step_overrun_seconds_total",
                "vllm_sim_step_busy_seconds_total",
            ):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def _one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


async def run_scale(
    urls: list[str], concurrency: int, scale: float, seconds: float, prompt_tokens: int, max_tokens: int
) -> Run:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        before = [await _metrics(session, u) for u in urls]
        gaps: list[float] = []
        requests = 0
        lag_max = 0.0
        deadline = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            nonlocal requests
            url = urls[i % len(urls)]
            n = 0
            while time.perf_counter() < deadline:
                prompt = " ".join(tokenizer.filler_words(f"{i}-{n}", prompt_tokens))
                gaps.extend(await _one(session, url, prompt, max_tokens))
                requests += 1
                n += 1

        async def watch_lag() -> None:
            nonlocal lag_max
            while time.perf_counter() < deadline:
                for u in urls:
                    lag_max = max(lag_max, (await _metrics(session, u)).get("vllm_sim_step_lag_seconds", 0.0))
                await asyncio.sleep(0.5)

        await asyncio.gather(watch_lag(), *(worker(i) for i in range(concurrency)))
        after = [await _metrics(session, u) for u in urls]

    def delta(name: str) -> float:
        return sum(a[name] - b[name] for a, b in zip(after, before, strict=True))

    itl_sum = delta("vllm:inter_token_latency_seconds_sum")
    itl_n = delta("vllm:inter_token_latency_seconds_count")
    lag = delta("vllm_sim_step_overrun_seconds_total")
    busy = delta("vllm_sim_step_busy_seconds_total")
    engine_itl = itl_sum / itl_n / scale
    client_itl = statistics.fmean(gaps)
    excess = client_itl / engine_itl - 1.0
    ratio = lag / busy
    return Run(
        scale,
        requests,
        len(gaps),
        client_itl * 1000,
        engine_itl * 1000,
        excess,
        ratio,
        lag_max * 1000,
        ratio <= BUDGET,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--scales", type=float, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--out", default="bench-results/sim_capacity.json")
    args = p.parse_args(argv)
    runs = []
    for scale in args.scales:
        sup = Supervisor(Path(args.out).parent / "sim-capacity-run")
        try:
            sup.start_sim(args.port, args.instances, "sim", "--time-scale", str(scale))
            urls = [f"http://127.0.0.1:{args.port + i}" for i in range(args.instances)]
            run = asyncio.run(
                run_scale(urls, args.concurrency, scale, args.seconds, args.prompt_tokens, args.max_tokens)
            )
        finally:
            sup.stop_all()
        runs.append(run)
        print(
            f"time-scale {scale:>5g}: {run.requests:4d} requests, {run.tokens:6d} tokens, client ITL "
            f"{run.client_itl_ms:7.3f} ms vs engine {run.engine_itl_ms:7.3f} ms ({run.excess:+.1%}), "
            f"step lag ratio {run.lag_ratio:.1%}, max step lag {run.max_step_lag_ms:6.2f} ms  "
            f"{'OK' if run.ok else 'OVER 5%'}",
            flush=True,
        )
    write_json(
        Path(args.out),
        {"instances": args.instances, "concurrency": args.concurrency, "runs": [asdict(r) for r in runs]},
    )

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
