"""Latency and CPU each gateway adds over a plain Nginx ``proxy_pass`` to the same backend.

The backend is a static Nginx server that answers like vLLM (a fixed chat completion, /health,
/metrics, /v1/models, and ``POST /v1/chat/completions/render`` with the prompt's token ids, one per
4 bytes, which vllm-router's ``cache_aware`` asks for on every request), so its own cost is small and
the same for every gateway. Targets, side by side:

- ``plain``: Nginx ``proxy_pass``, 2 workers, upstream keepalive;
- ``kvgate``: the gateway (Lua reads, checks and hashes the body, asks the sidecar, the balancer
  applies the pick, the log phase reports), 2 workers, its sidecar;
- ``kvgate-uvloop``: the same, its sidecar on uvloop (``--event-loop uvloop``; with ``--uvloop``);
- ``vllm-router:round_robin`` and ``vllm-router:cache_aware``, from the benchmark's own virtualenv
  (skipped with a printed reason when it cannot be installed).

Requests are interleaved target by target (the order rotates with each request), so every target
sees the same machine. Two modes per prompt size: sequential (one client, open loop at ``--rate``
requests per second per target) and concurrent (``--concurrency`` closed-loop clients). Added latency
= the target's percentile minus the plain proxy's. CPU per request = the user + system time of the
target's processes (from ``/proc``, master, workers and sidecar included) over the concurrent run,
divided by its requests. Last, kvgate with its sidecar stopped (fail-open).

    kvgate-bench overhead --sizes 1024 51200 512000

Over 300 lines: the two load modes, the tables and the command are one measurement (the targets
it runs through are ``kvgate_bench.overhead_targets``).
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvgate.public import Config, NginxSettings, find_nginx
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port, process_tree, wait_listening

from kvgate_bench import phases, report
from kvgate_bench.overhead_targets import (
    Target,
    body_of,
    cpu_seconds,
    plain_proxy_conf,
    post,
    start_peer,
    static_backend_conf,
)
from kvgate_bench.targets import ensure_peer_venv

PEERS = ("vllm-router:round_robin", "vllm-router:cache_aware")


def sequential(targets: Sequence[Target], size: int, n: int, rate: float) -> None:
    """One client, open loop: ``rate`` requests per second per target, interleaved."""
    conns = [http.client.HTTPConnection("127.0.0.1", t.port, timeout=30) for t in targets]
    interval = 1.0 / (rate * len(targets))
    start = time.perf_counter()
    k = 0
    for i in range(n):
        body = body_of(size, i)
        for j in range(len(targets)):
            idx = (i + j) % len(targets)
            delay = start + k * interval - time.perf_counter()
            k += 1
            if delay > 0:
                time.sleep(delay)
            targets[idx].latencies.append(post(conns[idx], body, targets[idx].name))
    for conn in conns:
        conn.close()


def concurrent(targets: Sequence[Target], size: int, n: int, clients: int) -> dict[str, float]:
    """``clients`` closed-loop clients, each sending its share of ``n`` requests to every target in
    turn. Returns each target's CPU seconds over the run."""
    groups = {t.name: t.pids for t in targets}
    groups.update({f"{t.name} ({part})": fn for t in targets for part, fn in t.parts.items()})
    before = {name: cpu_seconds(fn()) for name, fn in groups.items()}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        conns = [http.client.HTTPConnection("127.0.0.1", t.port, timeout=60) for t in targets]
        mine: list[list[float]] = [[] for _ in targets]
        try:
            for i in range(c, n, clients):
                body = body_of(size, i)
                for j in range(len(targets)):
                    idx = (i + j) % len(targets)
                    mine[idx].append(post(conns[idx], body, targets[idx].name))
        except BaseException as exc:  # reported by the caller, not lost in a thread
            errors.append(exc)
        finally:
            for conn in conns:
                conn.close()
            with lock:
                for t, values in zip(targets, mine, strict=True):
                    t.latencies.extend(values)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"concurrent run failed: {errors[0]}")
    return {name: cpu_seconds(fn()) - before[name] for name, fn in groups.items()}


def ms(values: list[float], q: float) -> float:
    return report.pct(values, q) * 1000


def rows_for(targets: Sequence[Target], cpu: dict[str, float] | None, n: int) -> dict[str, dict[str, float]]:
    plain = targets[0].latencies
    out: dict[str, dict[str, float]] = {}
    for t in targets:
        row = {
            "p50_ms": ms(t.latencies, 0.5),
            "p99_ms": ms(t.latencies, 0.99),
            "mean_ms": statistics.fmean(t.latencies) * 1000,
            "added_p50_ms": ms(t.latencies, 0.5) - ms(plain, 0.5),
            "added_p99_ms": ms(t.latencies, 0.99) - ms(plain, 0.99),
        }
        if cpu is not None:
            row["cpu_ms_per_request"] = cpu[t.name] / n * 1000
            for part in t.parts:
                row[f"cpu_ms_per_request_{part}"] = cpu[f"{t.name} ({part})"] / n * 1000
        out[t.name] = row
    return out


def print_rows(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(title, flush=True)
    for name, r in rows.items():
        cpu = f"  CPU {r['cpu_ms_per_request']:.3f} ms/req" if "cpu_ms_per_request" in r else ""
        parts = [
            (k.removeprefix("cpu_ms_per_request_"), v)
            for k, v in r.items()
            if k.startswith("cpu_ms_per_request_")
        ]
        if parts:
            cpu += " (" + ", ".join(f"{k} {v:.3f}" for k, v in parts) + ")"
        print(
            f"  {name:26} p50 {r['p50_ms']:7.3f} p99 {r['p99_ms']:7.3f} | added p50 {r['added_p50_ms']:+.3f}"
            f" p99 {r['added_p99_ms']:+.3f} ms{cpu}",
            flush=True,
        )


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| size | mode | target | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU ms/request |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, modes in results["sizes"].items():
        for mode, rows in modes.items():
            for name, r in rows.items():
                cpu = f"{r['cpu_ms_per_request']:.3f}" if "cpu_ms_per_request" in r else ""
                parts = [
                    f"{k.removeprefix('cpu_ms_per_request_')} {v:.3f}"
                    for k, v in r.items()
                    if k.startswith("cpu_ms_per_request_")
                ]
                if parts:
                    cpu += " (" + ", ".join(parts) + ")"
                lines.append(
                    f"| {int(size) / 1024:g} KB | {mode} | {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                    f"{r['added_p50_ms']:+.3f} | {r['added_p99_ms']:+.3f} | {cpu} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 51_200, 512_000])
    p.add_argument("--requests", type=int, default=1000, help="per target and size, sequential mode")
    p.add_argument("--rate", type=float, default=25.0, help="sequential: requests per second per target")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--concurrent-requests", type=int, default=2000, help="per target and size")
    p.add_argument("--no-peers", action="store_true", help="only the plain proxy and kvgate")
    p.add_argument("--uvloop", action="store_true", help="also kvgate with its sidecar on uvloop")
    p.add_argument("--phase-iterations", type=int, default=300, help="per size, for the per-phase breakdown")
    p.add_argument("--out", default="bench-results/gateway-overhead")
    args = p.parse_args(argv)
    out = Path(args.out)
    sup = Supervisor(out / "run")
    run = sup.run_dir
    (run / "nginx-tmp" / "body").mkdir(parents=True, exist_ok=True)
    (run / "nginx-tmp" / "proxy").mkdir(parents=True, exist_ok=True)
    nginx = find_nginx()
    results: dict[str, Any] = {"args": vars(args), "notes": [], "sizes": {}}
    peers: list[str] = []
    others: list[Supervisor] = []  # more gateways' supervisors (--uvloop)
    if not args.no_peers:
        if ensure_peer_venv() is None:
            results["notes"].append("vllm-router skipped: it could not be installed")
        else:
            peers = list(PEERS)
    try:
        backend, plain_port = free_port(), free_port()
        (run / "backend.conf").write_text(static_backend_conf(run, backend))
        (run / "plain.conf").write_text(plain_proxy_conf(run, plain_port, backend))
        procs = {}
        for name, port in (("backend", backend), ("plain", plain_port)):
            procs[name] = sup.spawn(
                name, [nginx, "-p", str(run), "-c", str(run / f"{name}.conf"), "-e", str(run / f"{name}.log")]
            )
            wait_listening(procs[name], port=port)
        socket_path = run / "sidecar.sock"
        cfg = {
            "listen": {"socket": str(socket_path), "http_port": free_port()},
            "redis": {"url": None},
            "backends": [{"id": "static", "url": f"http://127.0.0.1:{backend}"}],
        }
        gw = free_port()
        settings = NginxSettings.from_config(
            Config.from_mapping(cfg, {}), listen=f"127.0.0.1:{gw}", run_dir=str(run), workers=2
        )
        replica = launch_replica(sup, "gateway", cfg, settings)

        def tree(name: str) -> Callable[[], list[int]]:
            return lambda: process_tree(sup.procs[name].pid) if name in sup.procs else []

        def kvgate_pids() -> list[int]:
            return tree(replica.sidecar_name)() + tree(replica.nginx_name)()

        targets = [
            Target("plain", plain_port, tree("plain")),
            Target(
                "kvgate",
                gw,
                kvgate_pids,
                parts={"nginx": tree(replica.nginx_name), "sidecar": tree(replica.sidecar_name)},
            ),
        ]
        if args.uvloop:
            # A second gateway, its own supervisor (for its sidecar's argument) and run dir.
            uv = Supervisor(run / "uvloop", sidecar_args=("--event-loop", "uvloop"))
            others.append(uv)
            uv_socket = uv.run_dir / "sidecar.sock"
            uv_port = free_port()
            uv_cfg = {**cfg, "listen": {"socket": str(uv_socket), "http_port": free_port()}}
            uv_replica = launch_replica(
                uv,
                "gateway",
                uv_cfg,
                NginxSettings.from_config(
                    Config.from_mapping(uv_cfg, {}),
                    listen=f"127.0.0.1:{uv_port}",
                    run_dir=str(uv.run_dir),
                    workers=2,
                ),
            )

            def uv_tree(name: str) -> Callable[[], list[int]]:
                return lambda: process_tree(uv.procs[name].pid) if name in uv.procs else []

            targets.append(
                Target(
                    "kvgate-uvloop",
                    uv_port,
                    lambda: uv_tree(uv_replica.sidecar_name)() + uv_tree(uv_replica.nginx_name)(),
                    parts={
                        "nginx": uv_tree(uv_replica.nginx_name),
                        "sidecar": uv_tree(uv_replica.sidecar_name),
                    },
                )
            )
        for peer in peers:
            targets.append(start_peer(sup, peer, backend))
        for size in args.sizes:
            size_rows: dict[str, Any] = {}
            for t in targets:
                t.latencies = []
            sequential(targets, size, 50, args.rate * 4)  # warm-up: connections, caches, JIT
            for t in targets:
                t.latencies = []
            sequential(targets, size, args.requests, args.rate)
            size_rows["sequential"] = rows_for(targets, None, args.requests)
            print_rows(
                f"{size / 1024:g} KB, sequential at {args.rate:g} req/s per target:", size_rows["sequential"]
            )
            for t in targets:
                t.latencies = []
            cpu = concurrent(targets, size, args.concurrent_requests, args.concurrency)
            size_rows["concurrent"] = rows_for(targets, cpu, args.concurrent_requests)
            print_rows(f"{size / 1024:g} KB, {args.concurrency} concurrent clients:", size_rows["concurrent"])
            results["sizes"][str(size)] = size_rows
        results["phases_lua_us"] = phases.lua_phases(
            sup, str(socket_path), replica.http + "/metrics", args.sizes, args.phase_iterations
        )
        results["phases_sidecar_us"] = phases.sidecar_phases(args.sizes, args.phase_iterations)
        print(phases.markdown(results["phases_lua_us"], results["phases_sidecar_us"]), flush=True)
        sup.stop(replica.sidecar_name)
        results["fail_open"] = {}
        pair = targets[:2]
        for size in args.sizes:
            for t in pair:
                t.latencies = []
            sequential(pair, size, args.requests, args.rate)
            results["fail_open"][str(size)] = rows_for(pair, None, args.requests)["kvgate"]
            r = results["fail_open"][str(size)]
            print(
                f"{size / 1024:g} KB, sidecar down (fail-open): added p50 {r['added_p50_ms']:+.3f} ms "
                f"p99 {r['added_p99_ms']:+.3f} ms",
                flush=True,
            )
    finally:
        for other in others:
            other.stop_all()
        sup.stop_all()
    report.write_json(out / "gateway-overhead.json", results)
    head = report.header(["overhead", *(sys.argv[1:] if argv is None else argv)])
    text = f"# Gateway overhead\n\n`{head['command']}`\n\n{markdown(results)}"
    if "phases_lua_us" in results:
        text += "\nPer phase, median microseconds:\n\n"
        text += phases.markdown(results["phases_lua_us"], results["phases_sidecar_us"])
    for note in results["notes"]:
        text += f"\n{note}\n"
    (out / "report.md").write_text(text)
    print(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
