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
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_ports

from kvgate_bench import report
from kvgate_bench.cpu import RunCpu
from kvgate_bench.report import Progress, Summary
from kvgate_bench.stream_client import (
    LiveRun,
    errors_by_reason,
    gateway_ttfts,
    run_live,
    served_model,
)
from kvgate_bench.targets import (
    KVGATE_POLICIES,
    PEER_TARGETS,
    add_real_args,
    ensure_peer_venv,
    fit_to_real,
    pool_plan,
    prediction_error,
    real_fleet,
    reset_caches,
    start_target,
)
from kvgate_bench.workloads import SIM_MODEL, BenchRequest, add_workload_args, build_workload

MAX_SEND_LAG_S = 0.05  # wall: p99 lateness of the client's sends
MAX_STEP_LAG = 0.05  # simulators' lost time / scheduled step time


def summarize_live(
    target: str,
    run: LiveRun,
    time_scale: float,
    speedup: float,
    gateway: Sequence[float] = (),
    cpu: RunCpu | None = None,
    slo: report.Slo = report.DEFAULT_SLO,
    **extra: Any,
) -> Summary:
    s = time_scale
    scaled = [
        replace(x, ttft=x.ttft * s, itl=None if x.itl is None else x.itl * s, e2e=x.e2e * s)
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
        slo,
        speedup=speedup,
        valid=not problems,
        note=note,
        **extra,
    )


def run_target(
    args: argparse.Namespace,
    target: str,
    speedup: float,
    reqs: Sequence[BenchRequest],
    out: Path,
    peer_cpus: str | None = None,
    real: Sequence[str] = (),
    replicas: int = 1,
) -> tuple[Summary, list[float]]:
    """One live run: fresh simulated backends (clean caches), or the real fleet ``real`` with its
    prefix caches reset; ``target`` in front of them (kvgate: ``replicas`` gateway replicas, the
    client's requests spread over them at random), the workload at ``speedup``. Returns its summary
    and its TTFTs (simulated seconds)."""
    label = target if replicas == 1 else f"{target} x{replicas} replicas"
    sup = Supervisor(out / "run" / label.replace(":", "-").replace(" ", "-"))
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
        sidecars: list[str] = []
        pools, labels = pool_plan(target, reqs, len(workers))
        urls = start_target(
            sup,
            target,
            workers,
            args.time_scale,
            peer_cpus,
            replicas,
            report.Slo.from_args(args),
            sidecars,
            more=pools,
            labels=labels,
        )
        with RunCpu(proc.pid for proc in sup.procs.values()) as used:
            lr = asyncio.run(
                run_live(urls, reqs, speedup * args.time_scale, workers, Progress(f"{label} x{speedup:g}"))
            )
        cpu = used if real else None
        logs = [sup.run_dir / "nginx-access.log"]
        logs += [sup.run_dir / f"replica-{k}" / "nginx-access.log" for k in range(1, replicas)]
        gw = [t for log in logs for t in gateway_ttfts(log)]
        predicted = prediction_error(sidecars)
    finally:
        sup.stop_all()
    row = summarize_live(label, lr, args.time_scale, speedup, gw, cpu, report.Slo.from_args(args))
    row = replace(row, predicted=predicted[0], prediction_p50=predicted[1], prediction_p90=predicted[2])
    gw_note = (
        f"(gateway p50 {row.gateway_ttft_p50:.3f}s vs client {row.ttft_p50:.3f}s) "
        if row.gateway_ttft_p50 is not None
        else ""
    )
    print(
        f"  {label:30} x{speedup:<4g} TTFT mean {row.ttft_mean:.3f}s p90 {row.ttft_p90:.3f}s "
        f"{gw_note}"
        f"hit {row.hit_rate:.1%} imbalance {row.imbalance:.2f} errors {row.errors} "
        f"{'' if row.valid else 'INVALID ' + row.note}",
        file=sys.stderr,
    )
    if row.errors:
        print(f"    errors: {errors_by_reason(lr.samples)}", file=sys.stderr)
    if row.prediction_p50 is not None and row.prediction_p90 is not None:
        print(
            f"    the gateway predicted {row.predicted} first bytes: error p50 {row.prediction_p50:.0%} "
            f"p90 {row.prediction_p90:.0%}",
            file=sys.stderr,
        )
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
    add_real_args(cp)  # real time: --time-scale is 1
    cp.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1],
        help="kvgate targets: gateway replicas (Nginx + sidecar each, one Redis), the client spreading "
        "requests over them at random; several values run side by side (peer routers: one instance)",
    )
    cp.add_argument("--out", default="bench-results/compare")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if getattr(args, "real_vllm", 0):
        fit_to_real(args)
        args.time_scale = 1.0
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
        row = summarize_live(
            args.target, lr, args.time_scale, args.speedup, gw, slo=report.Slo.from_args(args)
        )
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
                runs = [(t, n) for t in targets for n in (args.replicas if t.startswith("kvgate:") else [1])]
                for target, n in runs:
                    try:
                        row, ttfts = run_target(args, target, speedup, reqs, out, args.peer_cpus, real, n)
                    except (OSError, RuntimeError, TimeoutError) as exc:
                        notes.append(f"{target} x{speedup:g} failed to run: {exc}")
                        print(notes[-1], file=sys.stderr)
                        continue
                    rows.append(row)
                    if speedup == args.speedups[0] and repeat == 0:
                        cdfs[row.target] = ttfts
    fleet = f"{args.real_vllm} real vLLM servers" if args.real_vllm else f"{args.backends} backends"
    path = report.write(out, f"live compare, {args.workload}, {fleet}", head, rows, cdfs, notes)
    print(f"wrote {path}")
    return 0
