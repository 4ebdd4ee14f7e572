"""The targets a live comparison runs the workload through: kvgate's gateway (any policy, with
the compute layer on or off) or a peer router from its own virtualenv, in front of simulated
backends or a fleet of real vLLM servers."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvgate.public import Config, NginxSettings
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port, get_json, wait_listening, wait_ready

from kvgate_bench import levers, report, virtual
from kvgate_bench.cpu import wait_quiet
from kvgate_bench.workloads import BenchRequest

SERVER_NICE = 5  # real fleet: the servers' CPU priority below the router's and the client's


CLIENT_NICE = -5  # real fleet: the load generator's


PEER_VENV = Path(__file__).resolve().parents[1] / ".bench-venv"  # beside the checkout's .venv


KVGATE_POLICIES = ["round_robin", "least_load", "consistent_hash", "prefix", "kvgate"]


# ``kvgate:POLICY+VARIANT`` runs the gateway with more of its configuration on (sections merged into
# its config). ``queue``: the whole compute-scheduling layer as the example config recommends it.
# ``slo``: that and admission by TTFT objective (the run's SLO, every request sheddable).
# ``pools``: length-bucketed pools as the levers table runs them (a quarter of the backends, at
# least one, for the workload's longest quarter of prompts; spill by backlog, the default);
# ``pools-queue``: those under the recommended queue.
KVGATE_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "queue": levers.RECOMMENDED,
    "slo": levers.RECOMMENDED,
    "pools": {},
    "pools-queue": levers.RECOMMENDED,
}


def pool_plan(
    target: str, reqs: Sequence[BenchRequest], backends: int
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """A ``+pools`` target's pools section and each backend's labels, from the workload's prompts;
    nothing for any other target."""
    if not target.partition("+")[2].startswith("pools"):
        return {}, []
    return levers.pool_setup(virtual.features_for(reqs), backends)


def variant(name: str, slo: report.Slo, time_scale: float) -> dict[str, dict[str, Any]]:
    """A variant's config sections; ``slo``'s objective in wall-clock time (the simulators run
    ``time_scale`` x faster), as the scrape interval is."""
    extra = KVGATE_VARIANTS[name]
    if name != "slo":
        return extra
    wall = report.Slo(slo.ttft_s / time_scale, slo.itl_s / time_scale)
    return {**extra, **levers.slo_section(levers.LEVERS["+slo-shed"], wall)}


PEER_TARGETS = [
    "vllm-router:cache_aware",
    "vllm-router:consistent_hash",
    "vllm-router:power_of_two",
    "sglang-router:cache_aware",
]


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
    sup: Supervisor,
    target: str,
    workers: list[str],
    time_scale: float,
    peer_cpus: str | None = None,
    replicas: int = 1,
    slo: report.Slo = report.DEFAULT_SLO,
    sidecars: list[str] | None = None,
    more: Mapping[str, Mapping[str, Any]] | None = None,
    labels: Sequence[Mapping[str, str]] = (),
) -> list[str]:
    """Start ``target`` in front of ``workers``; returns its base URLs once it routes (kvgate: one
    per gateway replica, ``replicas`` of them on one Redis; a peer router: one). ``peer_cpus`` (a
    ``taskset`` CPU list) pins a peer router, for a peer that would otherwise starve the simulators
    of CPU. ``slo``: the objective of the ``+slo`` variant. ``sidecars``: filled with kvgate's
    sidecars' HTTP URLs (their metrics). ``more``: kvgate's config sections, merged over the
    variant's; ``labels``: each worker's labels (pools)."""
    sidecars = [] if sidecars is None else sidecars
    kind, _, policy = target.partition(":")
    if kind == "kvgate":
        sidecars.clear()
        policy, _, flavour = policy.partition("+")
        extra = dict(variant(flavour, slo, time_scale) if flavour else {})
        for section, values in (more or {}).items():
            extra[section] = {**extra.get(section, {}), **values}
        redis_port = free_port()
        sup.start_redis(redis_port)
        interval = max(50, int(virtual.SCRAPE_INTERVAL_S * 1000 / time_scale))  # as the replay's
        urls = []
        for k in range(replicas):
            # Replica 0 keeps the names one replica always had (its access log is read the same way).
            run_dir = sup.run_dir if k == 0 else sup.run_dir / f"replica-{k}"
            run_dir.mkdir(parents=True, exist_ok=True)
            cfg: dict[str, Any] = {
                "listen": {"socket": str(run_dir / "sidecar.sock"), "http_port": free_port()},
                "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
                "scrape": {
                    "interval_ms": interval,
                    "timeout_ms": min(interval, 250),
                    "stale_after_ms": 4 * interval,
                },
                "routing": {"policy": policy},
                "backends": [
                    {"id": f"sim-{i}", "url": u, "labels": dict(labels[i]) if labels else {}}
                    for i, u in enumerate(workers)
                ],
            }
            cfg["gateway"] = {"route_headers": True}  # the report counts each backend's share
            for section, values in extra.items():
                cfg[section] = {**cfg.get(section, {}), **values}
            settings = NginxSettings.from_config(
                Config.from_mapping(cfg, {}),
                listen=f"127.0.0.1:{free_port()}",
                run_dir=str(run_dir),
                workers=2,
                access_log=True,
            )
            (run_dir / "nginx-access.log").unlink(missing_ok=True)  # one run's requests only
            name = "kvgate" if k == 0 else f"kvgate-{k}"
            replica = launch_replica(sup, name, cfg, settings)
            urls.append(replica.url)
            sidecars.append(replica.http)
        return urls
    port = free_port()
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
    return [url]


def add_real_args(p: argparse.ArgumentParser) -> None:
    """``--real-vllm N`` and its KV size: a fleet of real vLLM servers for every run."""
    p.add_argument(
        "--real-vllm",
        type=int,
        default=0,
        metavar="N",
        help="N real vLLM servers (make real-vllm: the CPU build, the tiny model) as the fleet, started "
        "once, their prefix caches reset before each run, in real time; prompts in the words the tiny "
        "model tokenizes one to one",
    )
    p.add_argument(
        "--real-blocks", type=int, default=256, help="--real-vllm: KV blocks (of 128 tokens) per server"
    )


def fit_to_real(args: argparse.Namespace) -> None:
    """With ``--real-vllm``: the workload in the fleet's model and words, no longer than it takes
    (longer ones vLLM refuses with 400)."""
    if getattr(args, "real_vllm", 0):
        from vllm_real.fleet import MAX_MODEL_LEN, MODEL

        args.model, args.words = getattr(args, "model", None) or MODEL, "vocab"
        args.max_context = args.max_context or MAX_MODEL_LEN


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


def prediction_error(sidecars: Sequence[str]) -> tuple[int, float | None, float | None]:
    """The gateway's own TTFT prediction error over a run (``kvgate_ttft_prediction_error``, every
    backend of every replica): how many first bytes it predicted, and the error's p50 and p90 as
    Prometheus' ``histogram_quantile`` reads them (linear within a bucket)."""
    cumulative: dict[float, float] = {}
    for url in sidecars:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("kvgate_ttft_prediction_error_bucket{"):
                le = float(line.split('le="', 1)[1].split('"', 1)[0])
                cumulative[le] = cumulative.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    total = cumulative.get(math.inf, 0.0)
    return int(total), histogram_quantile(cumulative, 0.5), histogram_quantile(cumulative, 0.9)


def histogram_quantile(cumulative: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of a histogram given as cumulative counts per upper bound (``+Inf``
    included), linear within a bucket, as Prometheus' ``histogram_quantile``."""
    total = cumulative.get(math.inf, 0.0)
    if total <= 0:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for bound in sorted(cumulative):
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return low  # beyond the last finite bound: that bound, as Prometheus says
            return low + (bound - low) * (rank - below) / (count - below) if count > below else bound
        low, below = bound, count
    return None
