"""``kvgate-bench fairness --real-vllm N``: the two tenants in real time, through the whole gateway
(Nginx, the Lua hook, the sidecar, Redis), in front of real vLLM servers.

Each tenant sends under its own API key (``auth.keys``: ``quiet`` and ``flood``), so the tenant the
queue orders by is the one Nginx checked, as in production, not a label the benchmark set. Every
run starts from empty prefix caches and a quiet machine (``targets.reset_caches``)."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvgate.public import hash_key
from kvgate.tools.launcher import Supervisor

from kvgate_bench import report
from kvgate_bench.load import counter_value, histogram, metric_families
from kvgate_bench.report import Progress
from kvgate_bench.stream_client import run_live
from kvgate_bench.targets import reset_caches, start_target
from kvgate_bench.workloads import BenchRequest

# The gateway's scheduling priority against the servers on the cores they share (``kvgate up
# --gateway-nice``): starved of CPU, the sidecar misses the queue's heartbeats and the requests it
# holds fall open together onto the servers.
GATEWAY_NICE = -10

# The keys the two tenants send (plain: they guard a benchmark's own gateway on loopback).
KEYS = {"quiet": "kvgate-bench-quiet", "flood": "kvgate-bench-flood"}


def keyed(reqs: Sequence[BenchRequest], tenants: Sequence[str]) -> list[BenchRequest]:
    """Each request with its tenant's ``Authorization`` header."""
    return [
        dataclasses.replace(r, headers={**r.headers, "Authorization": f"Bearer {KEYS[t]}"})
        for r, t in zip(reqs, tenants, strict=True)
    ]


def auth_section() -> dict[str, Any]:
    return {"keys": [{"name": name, "sha256": hash_key(key)} for name, key in KEYS.items()]}


def gateway_notes(gateway: str, sidecar: str) -> dict[str, float]:
    """Why the quiet tenant's answers came when they did, from the gateway's own counters: how long
    it waited at the gateway (in all, how many of its requests, how many as past its share); how
    many requests Nginx routed on its own ring because the sidecar answered late (they skip the
    queue); how often the sidecar's loop ran more than Nginx's 50 ms budget late, and how long it
    waited for a core in all (``kvgate.looplag``)."""
    req = urllib.request.Request(
        gateway + "/kvgate/metrics", headers={"Authorization": f"Bearer {KEYS['quiet']}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        nginx = metric_families(resp.read().decode())
    with urllib.request.urlopen(sidecar + "/metrics", timeout=10) as resp:
        own = metric_families(resp.read().decode())
    lag = histogram(own, "kvgate_event_loop_lag_seconds")
    return {
        "quiet_wait_s": counter_value(own, "kvgate_tenant_queue_wait_seconds_sum", tenant="quiet"),
        "quiet_held": counter_value(own, "kvgate_tenant_queue_wait_seconds_count", tenant="quiet"),
        "quiet_past_share": counter_value(own, "kvgate_tenant_past_share_queued", tenant="quiet"),
        "fell_open": counter_value(nginx, "kvgate_gateway_failopen"),
        "loop_late": max(lag.values(), default=0.0) - lag.get(0.05, 0.0),
        "cpu_wait_s": counter_value(own, "kvgate_cpu_wait_seconds"),
    }


def replay(
    fleet: Sequence[str],
    reqs: Sequence[BenchRequest],
    tenants: Sequence[str],
    queue: Mapping[str, Any],
    label: str,
    out: Path,
) -> tuple[dict[int, float], int, int, dict[str, float]]:
    """One run of ``reqs`` through kvgate (its routing policy, the gateway queue as ``queue`` says)
    in front of ``fleet``: the TTFT of each request served (by index), how many the gateway refused
    (429) and how many failed otherwise, and the gateway's notes on the run (``gateway_notes``)."""
    # The gateway ahead of the servers on the cores they share, as ``kvgate up --gateway-nice`` runs
    # it: only kvgate runs here, so no peer router would be at a disadvantage.
    gateway = {"kvgate-sidecar": GATEWAY_NICE, "kvgate-nginx": GATEWAY_NICE, "redis": GATEWAY_NICE}
    sup = Supervisor(out / "run" / label.replace(",", "").replace(" ", "-"), nice=gateway)
    try:
        reset_caches(fleet)
        sidecars: list[str] = []
        more = {"queue": dict(queue), "auth": auth_section()}
        urls = start_target(sup, "kvgate:kvgate", list(fleet), 1.0, sidecars=sidecars, more=more)
        run = asyncio.run(run_live(urls, keyed(reqs, tenants), 1.0, list(fleet), Progress(label)))
        notes = gateway_notes(urls[0], sidecars[0])
    finally:
        sup.stop_all()
    served = {i: s.ttft for i, s in enumerate(run.samples) if s.ok}
    refused = sum(1 for s in run.samples if not s.ok and s.error.startswith(report.SHED))
    return served, refused, len(run.samples) - len(served) - refused, notes
