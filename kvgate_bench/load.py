"""Closed-loop load: N streaming clients keep one request each in flight, as a throughput benchmark
client does (guidellm's throughput profile), and the gateway's own counters say how the sidecar kept
its decision budget under that load.

Without ``--url`` it starts its own stack on this machine: simulated backends and one kvgate gateway
(redis-server, the sidecar, Nginx), all competing for the same cores as the client. For each
concurrency it reports the client's TTFT and, from the gateway's ``/kvgate/metrics`` and the sidecar's
``/metrics`` read before and after, the decisions made, those that missed Nginx's budget (fail-open by
timeout), the decision latency as Nginx and as the sidecar measure it, and whether the sidecar was
held up: its event loop's worst lag and the time it waited for a core.

    kvgate-bench load --concurrency 32 64 --requests 600

Over 300 lines: the closed-loop client, the stack it starts and the counters it reads are one
measurement, read together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from kvgate.public import Config, NginxSettings, SchedStat, read_schedstat
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port, free_ports
from prometheus_client.parser import text_string_to_metric_families

from kvgate_bench import report
from kvgate_bench.stream_client import one_request
from kvgate_bench.workloads import SIM_MODEL, BenchRequest, add_workload_args, build_workload


@dataclass
class LoadRow:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    ttft_p50: float
    ttft_p99: float
    decisions: float
    failopen_timeout: float
    failopen_other: float
    late_replies: float  # decisions read after their timer fired (in time; the worker was busy)
    miss_rate: float  # decisions that missed Nginx's budget / decisions
    nginx_decision_p50_ms: float
    nginx_decision_p99_ms: float
    nginx_decision_p999_ms: float
    sidecar_decision_p99_ms: float
    sidecar_loop_lag_max_ms: float  # the worst wakeup of the sidecar's loop (bucket bound)
    sidecar_cpu_wait_ms: float  # time the sidecar's loop thread was ready but waited for a core
    # Per process of the stack (and the client) over the level: CPU ms run, ms waited for a core, and
    # the times it was put on a core (each after a wait, so waited / times is the mean wait per wakeup).
    cpu_ms: dict[str, tuple[float, float, int]] = field(default_factory=dict)


def metric_families(text: str) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    out: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(fam.name, []).append((dict(s.labels), float(s.value), s.name))
    return out


def histogram(fams: dict[str, list[tuple[dict[str, str], float, str]]], name: str) -> dict[float, float]:
    """Cumulative bucket counts of one histogram, by upper bound."""
    return {
        float(labels["le"]): value
        for labels, value, sample in fams.get(name, [])
        if sample.endswith("_bucket") and "le" in labels
    }


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of the observations between two reads."""
    bounds = sorted(after)
    total = after[bounds[-1]] - before.get(bounds[-1], 0.0)
    if total <= 0:
        return 0.0
    for b in bounds:
        if after[b] - before.get(b, 0.0) >= q * total:
            return b
    return bounds[-1]


def counter_value(
    fams: dict[str, list[tuple[dict[str, str], float, str]]], name: str, **labels: str
) -> float:
    """A counter's value (``name`` without ``_total``), or a histogram's count or sum (``name`` ending
    in ``_count`` or ``_sum``: prometheus_client files them under the histogram's family)."""
    family, sample = name, None
    for suffix in ("_count", "_sum"):
        if name.endswith(suffix):
            family, sample = name[: -len(suffix)], name
    return sum(
        v
        for lab, v, s in fams.get(family, [])
        if (sample is None or s == sample) and all(lab.get(k) == x for k, x in labels.items())
    )


async def scrape_metrics(
    session: aiohttp.ClientSession, url: str
) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return metric_families(await resp.text())


def encode_bodies(reqs: Sequence[BenchRequest]) -> list[bytes]:
    """Every request's body, built once: a trace's prompts take seconds of CPU to render, which must
    not run between two levels (nor be paid again for each)."""
    return [json.dumps(r.body()).encode() for r in reqs]


async def run_load(
    url: str,
    sidecar_url: str | None,
    reqs: Sequence[BenchRequest],
    bodies: Sequence[bytes],
    concurrency: int,
    n: int,
) -> LoadRow:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        g0 = await scrape_metrics(session, url + "/kvgate/metrics")
        s0 = await scrape_metrics(session, sidecar_url + "/metrics") if sidecar_url else {}
        next_i = 0
        samples = []

        async def client() -> None:
            nonlocal next_i
            while next_i < n:
                i = next_i
                next_i += 1
                k = i % len(bodies)
                samples.append(await one_request(session, url, reqs[k], bodies[k]))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.3)  # the last outcome reports and histogram flushes (100 ms timers)
        g1 = await scrape_metrics(session, url + "/kvgate/metrics")
        s1 = await scrape_metrics(session, sidecar_url + "/metrics") if sidecar_url else {}
    decisions = counter_value(g1, "kvgate_gateway_decision_seconds_count") - counter_value(
        g0, "kvgate_gateway_decision_seconds_count"
    )

    def failopen(reason: str) -> float:
        name = "kvgate_gateway_failopen"
        return counter_value(g1, name, reason=reason) - counter_value(g0, name, reason=reason)

    timeouts = failopen("timeout")
    late_name = "kvgate_gateway_late_replies"
    late = counter_value(g1, late_name, call="decide") - counter_value(g0, late_name, call="decide")
    ok = [s.ttft for s in samples if s.ok]
    nginx_before, nginx_after = (
        histogram(g0, "kvgate_gateway_decision_seconds"),
        histogram(g1, "kvgate_gateway_decision_seconds"),
    )
    side_before, side_after = (
        histogram(s0, "kvgate_decision_seconds"),
        histogram(s1, "kvgate_decision_seconds"),
    )
    lag_name, cpu_wait = "kvgate_event_loop_lag_seconds", "kvgate_cpu_wait_seconds"
    lag_before, lag_after = histogram(s0, lag_name), histogram(s1, lag_name)
    return LoadRow(
        concurrency=concurrency,
        requests=len(samples),
        errors=sum(1 for s in samples if not s.ok),
        wall_s=wall,
        ttft_p50=report.pct(ok, 0.5),
        ttft_p99=report.pct(ok, 0.99),
        decisions=decisions,
        failopen_timeout=timeouts,
        failopen_other=failopen("refused") + failopen("error"),
        late_replies=late,
        miss_rate=timeouts / decisions if decisions else 0.0,
        nginx_decision_p50_ms=bucket_quantile(nginx_before, nginx_after, 0.5) * 1000,
        nginx_decision_p99_ms=bucket_quantile(nginx_before, nginx_after, 0.99) * 1000,
        nginx_decision_p999_ms=bucket_quantile(nginx_before, nginx_after, 0.999) * 1000,
        sidecar_decision_p99_ms=bucket_quantile(side_before, side_after, 0.99) * 1000 if side_after else 0.0,
        sidecar_loop_lag_max_ms=bucket_quantile(lag_before, lag_after, 1.0) * 1000 if lag_after else 0.0,
        sidecar_cpu_wait_ms=(counter_value(s1, cpu_wait) - counter_value(s0, cpu_wait)) * 1000,
    )


def stack_pids(sup: Supervisor) -> dict[str, int]:
    """The processes that share the cores in a local run: the stack's (Nginx's workers, children of
    its master, each by name) and this client."""
    pids = {"client": os.getpid()}
    for name, proc in sup.procs.items():
        pids[name] = proc.pid
        try:
            kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            kids = []
        for i, kid in enumerate(kids):
            pids[f"{name}-worker-{i}"] = int(kid)
    return pids


def schedstat(pids: dict[str, int]) -> dict[str, SchedStat]:
    """Each process's main thread so far, as the kernel counts it; one that does not say is left out."""
    stats = {name: read_schedstat(f"/proc/{pid}/schedstat") for name, pid in pids.items()}
    return {name: stat for name, stat in stats.items() if stat is not None}


def start_stack(
    sup: Supervisor, backends: int, profile: str, time_scale: float, model: str
) -> tuple[str, str]:
    """Simulated backends and one kvgate gateway on this machine; (gateway URL, sidecar URL)."""
    sim = free_ports(backends)
    sup.start_sim(
        sim, backends, "sim", "--model", model, "--profile", profile, "--time-scale", str(time_scale)
    )
    redis_port = free_port()
    sup.start_redis(redis_port)
    port, http_port = free_port(), free_port()
    sock = str(sup.run_dir / "sidecar.sock")
    cfg = {
        "listen": {"socket": sock, "http_port": http_port},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
        "backends": [{"id": f"sim-{i}", "url": f"http://127.0.0.1:{sim + i}"} for i in range(backends)],
    }
    settings = NginxSettings.from_config(
        Config.from_mapping(cfg, {}), listen=f"127.0.0.1:{port}", run_dir=str(sup.run_dir), workers=2
    )
    replica = launch_replica(sup, "kvgate", cfg, settings)
    return replica.url, replica.http


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(p)
    p.set_defaults(workload="chat")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--requests", type=int, default=600, help="requests per concurrency level")
    p.add_argument("--url", help="a running gateway (default: start one here)")
    p.add_argument("--sidecar-url", help="its sidecar's HTTP API, for the sidecar-side latency")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument(
        "--others-nice",
        type=int,
        default=0,
        help="CPU niceness of the simulated backends and of this client (default 0: the same as the "
        "gateway's). On a fleet they are other machines; here they share the gateway's cores.",
    )
    p.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds of idle before every level after the first: a burst after a quiet spell, when "
        "upstream keep-alive connections have closed (default 0: levels back to back)",
    )
    p.add_argument("--out", default="bench-results/load.json")
    args = p.parse_args(argv)
    reqs = build_workload(args)
    sup = Supervisor(Path(args.out).parent / "load-run")
    rows: list[LoadRow] = []
    try:
        if args.url:
            url, sidecar_url = args.url, args.sidecar_url
        else:
            url, sidecar_url = start_stack(
                sup, args.backends, args.profile, args.time_scale, args.model or SIM_MODEL
            )
            if args.others_nice:
                os.setpriority(os.PRIO_PROCESS, sup.procs["sim"].pid, args.others_nice)
        if args.others_nice:
            os.nice(args.others_nice)  # this client; the gateway's processes keep theirs
        bodies = encode_bodies(reqs[: args.requests])
        for level, c in enumerate(args.concurrency):
            if level and args.pause > 0:
                time.sleep(args.pause)
            pids = stack_pids(sup)
            before = schedstat(pids)
            row = asyncio.run(run_load(url, sidecar_url, reqs, bodies, c, args.requests))
            after = schedstat(pids)
            row.cpu_ms = {
                n: (
                    (after[n].run_s - before[n].run_s) * 1000,
                    (after[n].wait_s - before[n].wait_s) * 1000,
                    after[n].slices - before[n].slices,
                )
                for n in after
                if n in before
            }
            rows.append(row)
            print(
                f"concurrency {c:3}: {row.requests} requests, {row.errors} errors, "
                f"TTFT p50 {row.ttft_p50:.3f}s p99 {row.ttft_p99:.3f}s | decisions {row.decisions:.0f}, "
                f"over budget {row.failopen_timeout:.0f} ({row.miss_rate:.3%}), "
                f"other fail-open {row.failopen_other:.0f}, read late {row.late_replies:.0f} | "
                f"decision call (Nginx) "
                f"p50 <= {row.nginx_decision_p50_ms:g} ms, p99 <= {row.nginx_decision_p99_ms:g} ms, "
                f"p99.9 <= {row.nginx_decision_p999_ms:g} ms; "
                f"in the sidecar p99 <= {row.sidecar_decision_p99_ms:g} ms; "
                f"sidecar loop lag max <= {row.sidecar_loop_lag_max_ms:g} ms, "
                f"waited for a core {row.sidecar_cpu_wait_ms:.0f} ms",
                flush=True,
            )
            if row.cpu_ms:
                spent = ", ".join(
                    f"{n} {r:.0f}/{w:.0f}/{w / k if k else 0.0:.2f}" for n, (r, w, k) in row.cpu_ms.items()
                )
                print(f"      CPU ms run / waited for a core / mean wait per wakeup: {spent}", flush=True)
    finally:
        sup.stop_all()
    report.write_json(
        Path(args.out), {"header": report.header(["load", *(argv or [])]), "rows": [asdict(r) for r in rows]}
    )
    return 0
