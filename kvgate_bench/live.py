"""Live mode: stream a workload to any OpenAI-compatible URL and measure what clients see.

``live`` sends to one URL (kvgate's gateway, a peer router, or a backend); ``compare`` starts fresh
simulated backends for each target in turn (clean caches), starts the target in front of them
(kvgate's gateway with each policy, or the peer routers ``vllm-router`` and ``sglang-router`` from a
separate virtualenv this command manages), and runs the same workload against each.

Simulated backends run at ``--time-scale S``, and arrivals are compressed by the same factor, so every
wall-clock measurement is multiplied by S to report simulated seconds. A run is marked invalid when
the client's send lag (p99) or the simulators' step-lag ratio exceeds its bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kvgate.public import Config, NginxSettings
from kvgate.tools.launcher import (
    Supervisor,
    free_port,
    free_ports,
    get_json,
    launch_replica,
    wait_listening,
    wait_ready,
)
from prometheus_client.parser import text_string_to_metric_families

from kvgate_bench import levers, report, virtual
from kvgate_bench.cpu import RunCpu, wait_quiet
from kvgate_bench.report import Progress, Sample, Summary
from kvgate_bench.workloads import SIM_MODEL, BenchRequest, add_workload_args, build_workload

MAX_SEND_LAG_S = 0.05  # wall: p99 lateness of the client's sends
MAX_STEP_LAG = 0.05  # simulators' lost time / scheduled step time
SERVER_NICE = 5  # real fleet: the servers' CPU priority below the router's and the client's
CLIENT_NICE = -5  # real fleet: the load generator's
PEER_VENV = Path(__file__).resolve().parents[1] / ".bench-venv"  # beside the checkout's .venv
KVGATE_POLICIES = ["round_robin", "least_load", "consistent_hash", "prefix", "kvgate"]
# ``kvgate:POLICY+VARIANT`` runs the gateway with more of its configuration on (sections merged into
# its config). ``queue``: the whole compute-scheduling layer as the example config recommends it.
KVGATE_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {"queue": levers.RECOMMENDED}
PEER_TARGETS = [
    "vllm-router:cache_aware",
    "vllm-router:consistent_hash",
    "vllm-router:power_of_two",
    "sglang-router:cache_aware",
]
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
    return f"HTTP {status}: {message}"[:200]


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


async def _one(session: aiohttp.ClientSession, url: str, r: BenchRequest, body: bytes) -> Sample:
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
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue
                    c = choices[0]
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if not text:
                        continue  # the role chunk carries no token
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
    url: str,
    reqs: Sequence[BenchRequest],
    rate_factor: float,
    backends: Sequence[str],
    progress: Callable[[int, int], None] | None = None,
) -> LiveRun:
    """Send ``reqs`` at ``arrival / rate_factor`` wall seconds; ``rate_factor`` = speed-up x time scale."""
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
            s = await _one(session, url, r, bodies[i])
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


def summarize_live(
    target: str,
    run: LiveRun,
    time_scale: float,
    speedup: float,
    gateway: Sequence[float] = (),
    cpu: RunCpu | None = None,
    **extra: Any,
) -> Summary:
    s = time_scale
    scaled = [
        Sample(
            x.ttft * s,
            None if x.itl is None else x.itl * s,
            x.e2e * s,
            x.output_tokens,
            x.ok,
            x.backend,
            x.prompt_tokens,
        )
        for x in run.samples
    ]
    d = run.backend_deltas
    hits = sum(v["vllm:prefix_cache_hits_total"] for v in d.values())
    queries = sum(v["vllm:prefix_cache_queries_total"] for v in d.values())
    prefill = {b: v["vllm:prompt_tokens_total"] - v["vllm:prefix_cache_hits_total"] for b, v in d.items()}
    busy = sum(v["vllm_sim_step_busy_seconds_total"] for v in d.values())
    lost = sum(v["vllm_sim_step_overrun_seconds_total"] for v in d.values())
    step_lag = lost / busy if busy > 0 else 0.0
    problems = []
    if run.send_lag_p99 > MAX_SEND_LAG_S:
        problems.append(f"client send lag p99 {run.send_lag_p99 * 1000:.0f} ms")
    if step_lag > MAX_STEP_LAG:
        problems.append(f"simulator step lag {step_lag:.1%}")
    if cpu is not None and cpu.problem():
        problems.append(str(cpu.problem()))
    note = "; ".join(problems) or f"send lag p99 {run.send_lag_p99 * 1000:.1f} ms, step lag {step_lag:.1%}"
    if cpu is not None:
        note += f"; {cpu.describe()}"
    if gateway:
        extra["gateway_ttft_p50"] = report.pct(gateway, 0.5) * s
        extra["gateway_ttft_mean"] = sum(gateway) / len(gateway) * s
    return report.summarize(
        target,
        scaled,
        run.makespan_wall * s,
        hits / queries if queries else 0.0,
        prefill,
        speedup=speedup,
        valid=not problems,
        note=note,
        **extra,
    )


# -- targets -------------------------------------------------------------------------------------------
def ensure_peer_venv() -> Path | None:
    """The peer routers live in their own virtualenv, never in kvgate's dependencies."""
    bin_dir = PEER_VENV / "bin"
    if (bin_dir / "vllm-router").exists() and (bin_dir / "sglang-router").exists():
        return bin_dir
    print(f"installing vllm-router and sglang-router into {PEER_VENV}", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True, timeout=300)
        subprocess.run(
            [str(bin_dir / "pip"), "install", "-q", "vllm-router", "sglang-router"], check=True, timeout=1200
        )
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"peer routers unavailable ({exc}); skipping them", file=sys.stderr)
        return None
    return bin_dir


def start_target(
    sup: Supervisor, target: str, workers: list[str], time_scale: float, peer_cpus: str | None = None
) -> str:
    """Start ``target`` in front of ``workers``; returns its base URL once it routes. ``peer_cpus``
    (a ``taskset`` CPU list) pins a peer router, for a peer that would otherwise starve the
    simulators of CPU."""
    kind, _, policy = target.partition(":")
    port = free_port()
    if kind == "kvgate":
        policy, _, variant = policy.partition("+")
        extra = KVGATE_VARIANTS[variant] if variant else {}
        redis_port = free_port()
        sup.start_redis(redis_port)
        interval = max(50, int(virtual.SCRAPE_INTERVAL_S * 1000 / time_scale))  # as the replay's
        sock = str(sup.run_dir / "sidecar.sock")
        cfg: dict[str, Any] = {
            "listen": {"socket": sock, "http_port": free_port()},
            "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
            "scrape": {
                "interval_ms": interval,
                "timeout_ms": min(interval, 250),
                "stale_after_ms": 4 * interval,
            },
            "routing": {"policy": policy},
            "backends": [{"id": f"sim-{i}", "url": u} for i, u in enumerate(workers)],
        }
        cfg["gateway"] = {"route_headers": True}  # the report counts each backend's share
        for section, values in extra.items():
            cfg[section] = {**cfg.get(section, {}), **values}
        settings = NginxSettings.from_config(
            Config.from_mapping(cfg, {}),
            listen=f"127.0.0.1:{port}",
            run_dir=str(sup.run_dir),
            workers=2,
            access_log=True,
        )
        (sup.run_dir / "nginx-access.log").unlink(missing_ok=True)  # one run's requests only
        return launch_replica(sup, "kvgate", cfg, settings).url
    # Both peers take the same flags; sglang-router needs "launch" and a metrics port of its own.
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy]
    if kind == "vllm-router":
        argv = [str(PEER_VENV / "bin" / kind), *common]
    elif kind == "sglang-router":
        argv = [str(PEER_VENV / "bin" / kind), "launch", *common, "--prometheus-port", str(free_port())]
    else:
        raise ValueError(f"unknown target {target}")
    if peer_cpus:
        argv = ["taskset", "-c", peer_cpus, *argv]
    proc = sup.spawn(kind, argv)
    wait_listening(proc, port=port, timeout=60)
    url = f"http://127.0.0.1:{port}"
    # Ready once it lists the workers' model: worker discovery and health checks are done.
    wait_ready(
        proc, "it lists the workers' model", lambda: bool(get_json(url + "/v1/models").get("data")), 60
    )
    return url


def run_target(
    args: argparse.Namespace,
    target: str,
    speedup: float,
    reqs: Sequence[BenchRequest],
    out: Path,
    peer_cpus: str | None = None,
    real: Sequence[str] = (),
) -> tuple[Summary, list[float]]:
    """One live run: fresh simulated backends (clean caches), or the real fleet ``real`` with its
    prefix caches reset; ``target`` in front of them, the workload at ``speedup``. Returns its
    summary and its TTFTs (simulated seconds)."""
    sup = Supervisor(out / "run" / target.replace(":", "-"))
    cpu = None
    try:
        if real:
            workers = list(real)
            reset_caches(workers)
        else:
            port = free_ports(args.backends)
            # One process per backend, as vLLM runs one API server per instance: a burst's parsing
            # and tokenization for one backend does not hold up the others' engines.
            for i in range(args.backends):
                sup.start_sim(
                    port + i,
                    1,
                    f"sim-{i}",
                    "--model",
                    args.model,
                    "--profile",
                    args.profile,
                    "--time-scale",
                    str(args.time_scale),
                    "--seed",
                    str(i),
                )
            workers = [f"http://127.0.0.1:{port + i}" for i in range(args.backends)]
        url = start_target(sup, target, workers, args.time_scale, peer_cpus)
        with RunCpu(proc.pid for proc in sup.procs.values()) as used:
            lr = asyncio.run(
                run_live(url, reqs, speedup * args.time_scale, workers, Progress(f"{target} x{speedup:g}"))
            )
        cpu = used if real else None
        gw = gateway_ttfts(sup.run_dir / "nginx-access.log")
    finally:
        sup.stop_all()
    row = summarize_live(target, lr, args.time_scale, speedup, gw, cpu)
    gw_note = (
        f"(gateway p50 {row.gateway_ttft_p50:.3f}s vs client {row.ttft_p50:.3f}s) "
        if row.gateway_ttft_p50 is not None
        else ""
    )
    print(
        f"  {target:30} x{speedup:<4g} TTFT mean {row.ttft_mean:.3f}s p90 {row.ttft_p90:.3f}s "
        f"{gw_note}"
        f"hit {row.hit_rate:.1%} imbalance {row.imbalance:.2f} errors {row.errors} "
        f"{'' if row.valid else 'INVALID ' + row.note}",
        file=sys.stderr,
    )
    if row.errors:
        print(f"    errors: {errors_by_reason(lr.samples)}", file=sys.stderr)
    return row, [s.ttft * args.time_scale for s in lr.samples if s.ok]


def add_parsers(sub: Any) -> None:
    lv = sub.add_parser("live", help="stream the workload to one OpenAI-compatible URL")
    add_workload_args(lv)
    lv.add_argument("--url", required=True)
    lv.add_argument("--backend-urls", nargs="*", default=[], help="backends to scrape for hit rate and lag")
    lv.add_argument("--speedup", type=float, default=1.0)
    lv.add_argument("--time-scale", type=float, default=1.0, help="the simulators' --time-scale")
    lv.add_argument("--target", default="target")
    lv.add_argument("--gateway-log", type=Path, help="a kvgate access log (kvgate format) of this run")
    lv.add_argument("--out", default="bench-results/live")
    cp = sub.add_parser("compare", help="same workload through each target in turn, fresh backends each time")
    add_workload_args(cp)
    cp.add_argument("--backends", type=int, default=4)
    cp.add_argument("--profile", default="llama3-8b-h100")
    cp.add_argument("--speedups", type=float, nargs="+", default=[1.0])
    cp.add_argument("--time-scale", type=float, default=4.0)
    cp.add_argument("--targets", nargs="+", default=[f"kvgate:{p}" for p in KVGATE_POLICIES] + PEER_TARGETS)
    cp.add_argument("--no-peers", action="store_true", help="skip the peer routers")
    cp.add_argument(
        "--repeats", type=int, default=1, help="runs of each target (the report shows the spread)"
    )
    cp.add_argument("--peer-cpus", help="taskset CPU list for the peer routers, e.g. 1")
    cp.add_argument(
        "--real-vllm",
        type=int,
        default=0,
        metavar="N",
        help="N real vLLM servers (make real-vllm: the CPU build, the tiny model) as the fleet, started "
        "once, their prefix caches reset before each run (real time: --time-scale is 1); prompts in "
        "the words the tiny model tokenizes one to one",
    )
    cp.add_argument(
        "--real-blocks",
        type=int,
        default=256,
        help="--real-vllm: KV blocks (of 128 tokens) per server",
    )
    cp.add_argument("--out", default="bench-results/compare")


@contextlib.contextmanager
def real_fleet(args: argparse.Namespace, out: Path) -> Iterator[list[str]]:
    """``compare --real-vllm N``: N real vLLM servers for every run (nothing without the option)."""
    if not getattr(args, "real_vllm", 0):
        yield []
        return
    from vllm_real.fleet import Fleet, ServerSpec

    # The servers run at a lower CPU priority than the router under test and the load generator: on a
    # shared host their engines' spinning would otherwise take the cores a router needs to answer in
    # time. Each run then checks that the router took no more than its share (RunCpu).
    # The load generator itself goes ahead of everything: its few percent of a core must send each
    # request on time, or the lateness counts against the router (client send lag).
    try:
        os.setpriority(os.PRIO_PROCESS, 0, CLIENT_NICE)
        Path("/proc/self/autogroup").write_text(str(CLIENT_NICE))  # where the kernel groups by session
    except OSError as exc:  # not permitted: the measurement notes the client's lateness anyway
        print(f"kvgate-bench: the load generator runs at its own priority ({exc})", file=sys.stderr)
    sup = Supervisor(
        out / "run" / "real-vllm", nice={f"vllm-{i}": SERVER_NICE for i in range(args.real_vllm)}
    )
    try:
        # Dev mode: POST /reset_prefix_cache, so that no run starts with another's cache.
        spec = ServerSpec(dev_mode=True, num_gpu_blocks=getattr(args, "real_blocks", 256))
        yield Fleet(sup).start([spec] * args.real_vllm)
    finally:
        sup.stop_all()


def reset_caches(urls: Sequence[str]) -> None:
    """Each server's prefix cache emptied and its last run's work drained: every run starts cold."""
    wait_quiet()
    for url in urls:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if getattr(args, "real_vllm", 0):
        from vllm_real.fleet import MAX_MODEL_LEN, MODEL

        args.model, args.time_scale, args.words = args.model or MODEL, 1.0, "vocab"
        args.max_context = args.max_context or MAX_MODEL_LEN  # longer ones vLLM refuses (400)
    if args.model is None:
        args.model = served_model(args.url) if args.mode == "live" else SIM_MODEL
        print(f"model: {args.model}", file=sys.stderr)  # compare starts simulators serving it
    reqs = build_workload(args)
    head = report.header(argv)
    if args.mode == "live":
        lr = asyncio.run(
            run_live(args.url, reqs, args.speedup * args.time_scale, args.backend_urls, Progress(args.target))
        )
        if any(not s.ok for s in lr.samples):
            print(f"errors: {errors_by_reason(lr.samples)}", file=sys.stderr)
        gw = gateway_ttfts(args.gateway_log) if args.gateway_log else []
        row = summarize_live(args.target, lr, args.time_scale, args.speedup, gw)
        path = report.write(
            Path(args.out),
            f"live, {args.workload}",
            head,
            [row],
            {args.target: [s.ttft * args.time_scale for s in lr.samples if s.ok]},
        )
        print(report.markdown_table([row]))
        print(f"wrote {path}")
        return 0
    targets = list(args.targets)
    notes: list[str] = []
    if args.no_peers:
        targets = [t for t in targets if t.startswith("kvgate:")]
    elif any(not t.startswith("kvgate:") for t in targets) and ensure_peer_venv() is None:
        notes.append("Peer routers skipped: they could not be installed.")
        targets = [t for t in targets if t.startswith("kvgate:")]
    rows: list[Summary] = []
    cdfs: dict[str, list[float]] = {}
    out = Path(args.out)
    with real_fleet(args, out) as real:
        if real:
            notes.append(f"fleet: {len(real)} real vLLM servers (CPU build, tiny model), in real time")
        for speedup in args.speedups:
            for repeat in range(args.repeats):
                for target in targets:
                    try:
                        row, ttfts = run_target(args, target, speedup, reqs, out, args.peer_cpus, real)
                    except (OSError, RuntimeError, TimeoutError) as exc:
                        notes.append(f"{target} x{speedup:g} failed to run: {exc}")
                        print(notes[-1], file=sys.stderr)
                        continue
                    rows.append(row)
                    if speedup == args.speedups[0] and repeat == 0:
                        cdfs[target] = ttfts
    fleet = f"{args.real_vllm} real vLLM servers" if args.real_vllm else f"{args.backends} backends"
    path = report.write(out, f"live compare, {args.workload}, {fleet}", head, rows, cdfs, notes)
    print(f"wrote {path}")
    return 0
