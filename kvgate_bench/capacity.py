"""How many requests per second one gateway replica decides, and whether two add up.

Closed loop: C clients keep one request each in flight through the gateway to static Nginx backends
that answer like vLLM at once (``overhead_targets``), so the backends are never what limits. C doubles
level by level; at each the gateway's own counters say how many decisions it made, how many fell open
(Nginx routed alone: the sidecar missed its budget or refused) and the decision call's p99 as Nginx
timed it. A replica's *capacity* is the highest throughput of a level with fall-open <= 0.1 % and
decision p99 <= 10 ms. CPU per decision: the sidecar's and Nginx's (master and workers) user + system
time over the level, divided by its decisions.

Where the machine has the cores, the load generator runs pinned to cores of its own, away from the
gateway's (``taskset``; the static backends and Redis sit with the client, they are other machines in
a fleet); with two cores that is one core each. Two replicas share Redis and the cores given to the
gateway; the client spreads its connections over both. vllm-router (``cache_aware`` and
``round_robin``, from the benchmark's virtualenv) runs through the same harness for its ceiling.

    kvgate-bench capacity --sizes 1024 51200 --replicas 1 2

Over 300 lines: the closed-loop client, the stacks it starts (kvgate replicas, the peers) and the
bounds it judges each level by are one measurement, read together.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from kvgate.public import Config, NginxSettings, find_nginx
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port, process_tree, wait_listening

from kvgate_bench import report
from kvgate_bench.load import bucket_quantile, counter_value, histogram, scrape_metrics
from kvgate_bench.overhead_targets import body_of, cpu_seconds, start_peer, static_backend_conf
from kvgate_bench.targets import ensure_peer_venv

MAX_FAILOPEN = 0.001
MAX_DECISION_P99_MS = 10.0
BACKENDS = 4


@dataclass
class Level:
    target: str
    size: int
    clients: int
    requests: int
    errors: int
    rps: float
    latency_p99_ms: float
    decisions: float = 0.0
    failopen: float = 0.0  # share of decisions Nginx routed alone
    decision_p99_ms: float = 0.0  # the decision call as Nginx timed it (histogram bucket bound)
    sidecar_cpu_ms: float = 0.0  # per decision
    proxy_cpu_ms: float = 0.0  # Nginx's per decision (a peer router's own, per request)

    @property
    def within(self) -> bool:
        """Within the bounds: kvgate's decisions (as Nginx timed them) and fall-open; a peer router,
        which decides inside its proxy, by its whole answer's p99 (the backends answer at once)."""
        if self.errors:
            return False
        if self.decisions == 0:
            return self.latency_p99_ms <= MAX_DECISION_P99_MS
        return self.failopen <= MAX_FAILOPEN and self.decision_p99_ms <= MAX_DECISION_P99_MS


@dataclass
class Gate:
    """A target the client sends to: its URLs and how to read its CPU and counters."""

    name: str
    urls: list[str]
    proxy_pids: Callable[[], list[int]]  # Nginx (or the peer router)
    sidecar_pids: Callable[[], list[int]]
    metrics: list[str]  # each replica's /kvgate/metrics ([] for a peer router)


async def closed_loop(
    urls: Sequence[str], bodies: Sequence[bytes], clients: int, seconds: float
) -> tuple[int, int, list[float]]:
    """``clients`` connections, spread over ``urls``, each one request after another for ``seconds``;
    (requests, errors, latencies)."""
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=30)

    async def client(i: int) -> None:
        nonlocal errors
        url = urls[i % len(urls)] + "/v1/chat/completions"
        connector = aiohttp.TCPConnector(limit=1)  # one connection per client, kept alive
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            n = i
            while time.perf_counter() < stop:
                body = bodies[n % len(bodies)]
                n += clients
                t0 = time.perf_counter()
                try:
                    async with session.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        if r.status != 200:
                            errors += 1
                            continue
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return len(latencies) + errors, errors, latencies


async def measure(gate: Gate, size: int, clients: int, seconds: float, bodies: Sequence[bytes]) -> Level:
    async with aiohttp.ClientSession() as s:
        before = [await scrape_metrics(s, m) for m in gate.metrics]
    cpu0 = cpu_seconds(gate.sidecar_pids()), cpu_seconds(gate.proxy_pids())
    t0 = time.perf_counter()
    n, errors, lat = await closed_loop(gate.urls, bodies, clients, seconds)
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(gate.sidecar_pids()), cpu_seconds(gate.proxy_pids())
    await asyncio.sleep(0.3)  # the last histogram flushes (Nginx's 100 ms timers)
    async with aiohttp.ClientSession() as s:
        after = [await scrape_metrics(s, m) for m in gate.metrics]
    lat.sort()
    level = Level(gate.name, size, clients, n, errors, len(lat) / wall, report.pct(lat, 0.99) * 1000)
    if gate.metrics:
        name = "kvgate_gateway_decision_seconds_count"
        level.decisions = sum(
            counter_value(a, name) - counter_value(b, name) for a, b in zip(after, before, strict=True)
        )
        fo = "kvgate_gateway_failopen"
        fell = sum(counter_value(a, fo) - counter_value(b, fo) for a, b in zip(after, before, strict=True))
        level.failopen = fell / max(1.0, level.decisions + fell)
        h = "kvgate_gateway_decision_seconds"
        merged_before: dict[float, float] = {}
        merged_after: dict[float, float] = {}
        for b, a in zip(before, after, strict=True):
            for k, v in histogram(b, h).items():
                merged_before[k] = merged_before.get(k, 0.0) + v
            for k, v in histogram(a, h).items():
                merged_after[k] = merged_after.get(k, 0.0) + v
        level.decision_p99_ms = (
            bucket_quantile(merged_before, merged_after, 0.99) * 1000 if merged_after else 0.0
        )
    per = max(1.0, level.decisions or level.requests)
    level.sidecar_cpu_ms = (cpu1[0] - cpu0[0]) * 1000 / per
    level.proxy_cpu_ms = (cpu1[1] - cpu0[1]) * 1000 / per
    return level


def pin(pids: Sequence[int], cpus: str | None) -> None:
    """Every thread of ``pids`` onto ``cpus`` (``taskset`` syntax); nothing when ``cpus`` is None."""
    if cpus is None:
        return
    for pid in pids:
        subprocess.run(["taskset", "-a", "-pc", cpus, str(pid)], capture_output=True, check=False)


def split_cores() -> tuple[str | None, set[int] | None]:
    """(the gateway's cores, the client's): half each, the gateway's the lower ones; no pinning on
    one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return ",".join(map(str, cores[:half])), set(cores[half:])


def start_gateways(sup: Supervisor, replicas: int, backends: list[int], cpus: str | None) -> Gate:
    redis_port = free_port()
    sup.start_redis(redis_port)
    urls, metrics = [], []
    sidecars: list[str] = []
    nginxes: list[str] = []
    for k in range(replicas):
        run = sup.run_dir / f"gw{k}"
        run.mkdir(parents=True, exist_ok=True)
        cfg = {
            "listen": {"socket": str(run / "sidecar.sock"), "http_port": free_port()},
            "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
            "backends": [{"id": f"b{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(backends)],
        }
        port = free_port()
        settings = NginxSettings.from_config(
            Config.from_mapping(cfg, {}), listen=f"127.0.0.1:{port}", run_dir=str(run), workers=2
        )
        replica = launch_replica(sup, f"gw{k}", cfg, settings)
        urls.append(replica.url)
        metrics.append(replica.url + "/kvgate/metrics")
        sidecars.append(replica.sidecar_name)
        nginxes.append(replica.nginx_name)

    def trees(names: list[str]) -> Callable[[], list[int]]:
        return lambda: [p for n in names for p in process_tree(sup.procs[n].pid)]

    name = f"kvgate x{replicas}" if replicas > 1 else "kvgate"
    gate = Gate(name, urls, trees(nginxes), trees(sidecars), metrics)
    pin(gate.proxy_pids() + gate.sidecar_pids(), cpus)
    return gate


def run_target(
    gate: Gate, sizes: Sequence[int], clients: Sequence[int], seconds: float, rows: list[Level]
) -> None:
    for size in sizes:
        bodies = [body_of(size, i) for i in range(256)]
        asyncio.run(measure(gate, size, 4, 1.0, bodies))  # warm-up: connections, JIT, caches
        for c in clients:
            level = asyncio.run(measure(gate, size, c, seconds, bodies))
            rows.append(level)
            print(
                f"  {gate.name:24} {size / 1024:5g} KB {c:4} clients: {level.rps:7.0f} req/s, p99 "
                f"{level.latency_p99_ms:6.1f} ms, fall-open {level.failopen:.3%}, decision p99 <= "
                f"{level.decision_p99_ms:g} ms, CPU/decision sidecar {level.sidecar_cpu_ms:.3f} ms "
                f"proxy {level.proxy_cpu_ms:.3f} ms, errors {level.errors}"
                f"{'' if level.within else '  (over the bounds)'}",
                flush=True,
            )


def capacity(rows: Sequence[Level], target: str, size: int) -> Level | None:
    ok = [r for r in rows if r.target == target and r.size == size and r.within]
    return max(ok, key=lambda r: r.rps, default=None)


def markdown(rows: Sequence[Level], sizes: Sequence[int]) -> str:
    targets = list(dict.fromkeys(r.target for r in rows))
    out = [
        f"Capacity: the highest throughput of a level with fall-open <= {MAX_FAILOPEN:.1%} and decision "
        f"p99 <= {MAX_DECISION_P99_MS:g} ms (a peer router: its answers' p99 <= "
        f"{MAX_DECISION_P99_MS:g} ms); ceiling: the highest of any level without errors. CPU per "
        "decision: the sidecar's + Nginx's (a peer: the router's).\n",
        "| target | "
        + " | ".join(f"{s / 1024:g} KB: capacity req/s (clients); ceiling; CPU ms" for s in sizes)
        + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for t in targets:
        cells = []
        for s in sizes:
            c = capacity(rows, t, s)
            top = max((r.rps for r in rows if r.target == t and r.size == s and not r.errors), default=0.0)
            cells.append(
                f"none; {top:.0f}"
                if c is None
                else f"{c.rps:.0f} ({c.clients}); {top:.0f}; {c.sidecar_cpu_ms:.3f} + {c.proxy_cpu_ms:.3f}"
            )
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def measure_all(
    args: argparse.Namespace, gateway_cpus: str | None, rows: list[Level], notes: list[str]
) -> None:
    """Every target the command asks for, one after another, each on a fresh stack."""
    out = Path(args.out)
    for replicas in args.replicas:
        sup = Supervisor(out / "run" / f"kvgate-{replicas}")
        try:
            backends = _start_backends(sup)
            gate = start_gateways(sup, replicas, backends, gateway_cpus)
            run_target(gate, args.sizes, args.clients, args.seconds, rows)
        finally:
            sup.stop_all()
    if args.no_peers:
        return
    if ensure_peer_venv() is None:
        notes.append("vllm-router skipped: it could not be installed")
        return
    for peer in ("vllm-router:round_robin", "vllm-router:cache_aware"):
        sup = Supervisor(out / "run" / peer.replace(":", "-"))
        try:
            backends = _start_backends(sup)
            target = start_peer(sup, peer, backends[0], backends[1:])
            pin(target.pids(), gateway_cpus)
            gate = Gate(peer, [f"http://127.0.0.1:{target.port}"], target.pids, lambda: [], [])
            run_target(gate, args.sizes, args.clients, args.seconds, rows)
        except (OSError, RuntimeError, TimeoutError) as exc:
            notes.append(f"{peer} failed to run: {exc}")
        finally:
            sup.stop_all()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 51_200])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--seconds", type=float, default=5.0, help="per level")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--no-peers", action="store_true", help="kvgate only")
    p.add_argument("--out", default="bench-results/capacity")
    args = p.parse_args(argv)
    out = Path(args.out)
    gateway_cpus, client_cpus = split_cores()
    notes = []
    mine = os.sched_getaffinity(0)
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)  # the client, the backends and Redis (started after)
        notes.append(
            f"gateway on CPUs {gateway_cpus}, the client, backends and Redis on {sorted(client_cpus)}"
        )
    else:
        notes.append("one CPU: nothing pinned")
    rows: list[Level] = []
    try:
        measure_all(args, gateway_cpus, rows, notes)
    finally:
        os.sched_setaffinity(0, mine)  # a caller in the same process (a test) gets its cores back
    text = markdown(rows, args.sizes)
    print(text)
    head = report.header(["capacity", *(sys.argv[1:] if argv is None else argv)])
    report.write_json(
        out / "capacity.json", {"header": head, "notes": notes, "rows": [asdict(r) for r in rows]}
    )
    (out / "report.md").write_text(
        f"# Capacity per replica\n\n`{head['command']}`\n\n{text}\n" + "\n".join(notes) + "\n"
    )
    print(f"wrote {out / 'report.md'}")
    return 0


def _start_backends(sup: Supervisor) -> list[int]:
    """``BACKENDS`` static vLLM-like Nginx servers (one process, a port each)."""
    run = sup.run_dir
    (run / "nginx-tmp" / "body").mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(BACKENDS)]
    (run / "backend.conf").write_text(static_backend_conf(run, ports[0], ports[1:]))
    proc = sup.spawn(
        "backend",
        [find_nginx(), "-p", str(run), "-c", str(run / "backend.conf"), "-e", str(run / "backend.log")],
    )
    for port in ports:
        wait_listening(proc, port=port)
    return ports
