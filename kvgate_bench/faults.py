"""The fault suite: faults injected into a live stack under a steady load, each scored from the
clients' side.

One stack (simulated backends, redis-server, one sidecar, Nginx) runs under a supervisor that heals
what dies, as ``kvgate up`` does; ``concurrency`` clients keep streaming chat requests. Each scenario
injects a fault, holds it, heals it, and keeps the load on a little longer. Every request is one of:

* ok: a 200 whose stream ended with ``[DONE]``;
* failed by design: what no gateway can hide: a stream the backend cut after tokens had reached the
  client (it gets an error event), or a refusal while no backend at all could serve;
* failed: anything else, such as an error before the first byte while a healthy backend existed, a
  non-JSON error, a hang.

Reported per scenario: requests, ok, failed by design, failed, the time to recover (from the fault's
start, or from the heal for faults that need one, to the first second of only ok requests), and
whether every in-flight count was back to zero within 5 s of idle. The test suite runs short
versions (``tests/e2e/test_faults.py``); ``kvgate-bench faults`` runs them at length, the fuzz corpus, and a
soak that checks memory.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvgate.tools.readiness import process_tree

from kvgate_bench import fuzz, report
from kvgate_bench.fault_scenarios import (
    SCENARIOS,
    Scenario,
)
from kvgate_bench.fault_stack import (
    BY_DESIGN,
    FAILED,
    LOAD_KEY,
    OK,
    Load,
    Result,
    Stack,
)

# How long in-flight counts may take to reach 0 once the load stops: reports reach the sidecar
# within a flush or two, but on a loaded machine (CI) a restarted sidecar's first ones come later.
IDLE_WAIT_S = 5.0


@dataclass
class Score:
    scenario: str
    requests: int
    ok: int
    failed_by_design: int
    failed: int
    recover_s: float | None
    idle_zero_s: float | None  # seconds until every in-flight count was 0, once idle (None: not in 5 s)
    failures: list[str] = field(default_factory=list)


def score(name: str, results: Sequence[Result], fault_at: float, heal_at: float, total_outage: bool) -> Score:
    ok = sum(1 for r in results if r.outcome == OK)
    by_design = sum(1 for r in results if r.outcome == BY_DESIGN)
    failed = [r for r in results if r.outcome == FAILED]
    if total_outage:
        # No backend could serve between the fault and the heal: those refusals are by design.
        designed = [r for r in failed if r.start < heal_at and r.end > fault_at]
        by_design += len(designed)
        failed = [r for r in failed if r not in designed]
    # Recovered: the last request that was not ok, counted from the heal (which for a fault that heals
    # itself is the fault), when ok requests came after it.
    recover = None
    ends = sorted(results, key=lambda r: r.end)
    last_bad = max((r.end for r in ends if r.outcome != OK and r.end >= fault_at), default=None)
    if last_bad is None:
        recover = 0.0
    elif any(r.outcome == OK and r.start > last_bad for r in ends):
        recover = max(0.0, last_bad - heal_at)
    return Score(
        name, len(results), ok, by_design, len(failed), recover, None, sorted({r.detail for r in failed})
    )


def run_scenario(
    stack: Stack, sc: Scenario, concurrency: int, before: float, hold: float, after: float
) -> Score:
    with Load(stack.port, concurrency) as load:
        time.sleep(before)
        fault_at = time.monotonic()
        sc.inject(stack)
        time.sleep(hold)
        sc.heal(stack)
        heal_at = time.monotonic()  # once healed: requests that started before may still fail by design
        time.sleep(after)
    s = score(sc.name, load.results, fault_at, fault_at if sc.self_healing else heal_at, sc.total_outage)
    idle = time.monotonic()
    while time.monotonic() - idle < IDLE_WAIT_S:
        try:
            if stack.inflight() == 0:
                s.idle_zero_s = round(time.monotonic() - idle, 2)
                break
        except OSError:
            pass
        time.sleep(0.05)
    return s


def table(scores: Sequence[Score]) -> str:
    lines = [
        "| scenario | requests | ok | failed by design | failed | recovered after s | in flight 0 idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        rec = "n/a" if s.recover_s is None else f"{s.recover_s:.1f}"
        idle = "no" if s.idle_zero_s is None else f"yes ({s.idle_zero_s:.2f} s)"
        lines.append(
            f"| {s.scenario} | {s.requests} | {s.ok} | {s.failed_by_design} | {s.failed} | {rec} | {idle} |"
        )
    return "\n".join(lines)


def rss_kb(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def gateway_pids(stack: Stack) -> list[int]:
    out = []
    for name in (stack.replica.sidecar_name, stack.replica.nginx_name):
        proc = stack.sup.procs.get(name)
        if proc is not None:
            out += process_tree(proc.pid)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--before", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=10.0)
    p.add_argument("--after", type=float, default=10.0)
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), help="names from the list above")
    p.add_argument("--fuzz", type=int, default=12_000, help="malformed requests to send (0: none)")
    p.add_argument("--soak", type=float, default=0.0, help="seconds of soak with faults, measuring memory")
    p.add_argument(
        "--prefix-index-blocks",
        type=int,
        default=None,
        help="the sidecar's prefix-index bound (smaller: reached early, so later growth is a leak)",
    )
    p.add_argument(
        "--local-sessions",
        type=int,
        default=None,
        help="the sidecar's local session-map bound (each unkeyed soak request makes a new prefix key)",
    )
    p.add_argument(
        "--trace-memory",
        action="store_true",
        help="run the sidecar under tracemalloc; the soak then reports the allocation sites that grew",
    )
    p.add_argument("--out", default="bench-results/faults")
    args = p.parse_args(argv)
    out = Path(args.out)
    stack = Stack.start(
        out / "run",
        prefix_index_blocks=args.prefix_index_blocks,
        local_sessions=args.local_sessions,
        trace_memory=args.trace_memory,
    )
    scores: list[Score] = []
    extra: dict[str, Any] = {}
    try:
        for name in args.scenarios:
            sc = SCENARIOS[name]
            s = run_scenario(stack, sc, args.concurrency, args.before, args.hold, args.after)
            scores.append(s)
            print(table([s]).splitlines()[-1], flush=True)
            if name in stack.observed:  # what the scenario's attacker saw
                print(f"  {name}: {json.dumps(stack.observed[name])}", flush=True)
        if args.fuzz:
            extra["fuzz"] = asdict(fuzz.run(stack.port, args.fuzz, key=LOAD_KEY))
            print(f"fuzz: {extra['fuzz']}", flush=True)
        if args.soak:
            extra["soak"] = soak(stack, args.soak, args.concurrency)
            print(f"soak: {extra['soak']}", flush=True)
    finally:
        stack.stop()
    md = table(scores)
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md + "\n")
    report.write_json(
        out / "report.json",
        {
            "header": report.header(["faults", *(argv or [])]),
            "scores": [asdict(s) for s in scores],
            "observed": stack.observed,
            **extra,
        },
    )
    return 0


def soak(stack: Stack, seconds: float, concurrency: int) -> dict[str, Any]:
    """Load with faults cycling through the scenarios for ``seconds`` (those that replace a gateway
    process left out); every request classified; the resident memory of the sidecar and each Nginx
    process after a warm-up and at the end; the sidecar's live objects by type after the warm-up and
    once the load has stopped."""
    cycle = [s for s in SCENARIOS.values() if not s.total_outage and not s.replaces_gateway]
    with Load(stack.port, concurrency) as load:
        time.sleep(30)
        pids = gateway_pids(stack)
        start_rss = {pid: rss_kb([pid]) for pid in pids}
        first = stack.sidecar_memory(objects=True)
        samples: list[tuple[float, int]] = []  # (seconds into the soak, total RSS kB), once a minute
        structures: list[tuple[float, dict[str, int]]] = []  # the sidecar's bounded structures, likewise
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < seconds:
            if not samples or time.monotonic() - t0 - samples[-1][0] >= 60:
                at = round(time.monotonic() - t0)
                samples.append((at, rss_kb(pids)))
                structures.append((at, stack.sidecar_memory().get("structures", {})))
            sc = cycle[i % len(cycle)]
            sc.inject(stack)
            time.sleep(5)
            sc.heal(stack)
            time.sleep(10)
            i += 1
        end_rss = {pid: rss_kb([pid]) for pid in pids}
        samples.append((round(time.monotonic() - t0), rss_kb(pids)))
    # The closing heap walk once the load has stopped and its connections have closed, so that what
    # it counts is what stays, not what was in use at that instant.
    time.sleep(3)
    last = stack.sidecar_memory(objects=True)
    structures.append((round(time.monotonic() - t0), last.get("structures", {})))
    lived = [pid for pid in pids if end_rss[pid] > 0]
    start, end = sum(start_rss[p] for p in lived), sum(end_rss[p] for p in lived)
    failures: dict[str, int] = {}
    for r in load.results:
        if r.outcome == FAILED:
            failures[r.detail] = failures.get(r.detail, 0) + 1
    return {
        "seconds": seconds,
        "scenarios": [s.name for s in cycle],
        "faults_injected": i,
        "requests": len(load.results),
        "ok": sum(1 for r in load.results if r.outcome == OK),
        "failed_by_design": sum(1 for r in load.results if r.outcome == BY_DESIGN),
        "failed": sum(failures.values()),
        "failures": failures,
        "processes": len(pids),
        "processes_lived_through": len(lived),
        "rss_start_kb": start,
        "rss_end_kb": end,
        "rss_growth": (end - start) / start if start else None,
        "rss_by_process_kb": {str(p): [start_rss[p], end_rss[p]] for p in pids},
        "rss_samples_kb": samples,
        "sidecar_structures": structures,
        "sidecar_objects_grown": _grown(first.get("objects", {}), last.get("objects", {})),
        "sidecar_allocations_grown": _grown(
            {a["site"]: a["kb"] for a in first.get("allocations", [])},
            {a["site"]: a["kb"] for a in last.get("allocations", [])},
        ),
    }


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What grew between two top-N listings, largest growth first (a name absent before counts from 0)."""
    delta = {k: round(v - before.get(k, 0), 1) for k, v in after.items()}
    return dict(sorted(((k, d) for k, d in delta.items() if d > 0), key=lambda kv: -kv[1])[:15])
