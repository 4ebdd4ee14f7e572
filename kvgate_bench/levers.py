"""``kvgate-bench levers``: each compute-scheduling lever on its own and together, in virtual time.

The same workload is replayed through kvgate's real decision service and simulated engines with one
configuration per row: round robin, routing alone, then routing plus each lever (calibrated token
estimate, gateway queue FCFS / shortest-first, length-bucketed pools, priority classes) and all of
them. Rows differ only in configuration, so their ratios are the levers' effects. Requests the gateway
queue refused (429) are counted apart; TTFT is over the requests that ran and includes time queued.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.public import Features, PolicyName

from kvgate_bench import bounds, report, virtual
from kvgate_bench.report import Progress, Summary
from kvgate_bench.workloads import add_workload_args, build_workload
from vllm_sim.profiles import PROFILES, get_profile

NO_LEARN = {"tokens": {"learn": False}}  # the fixed 4 bytes per token kvgate used before calibration
PRIORITY_EVERY = 10  # priority lever: one request in this many (10 %) is interactive (class -1)


@dataclass(frozen=True)
class Lever:
    name: str
    policy: PolicyName
    extra: dict[str, Any] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)
    pools: bool = False  # backends split into a short and a long pool
    backlog_ratio: float | None = None  # pools: spill at this backlog ratio too (pools.backlog_ratio)
    priority: bool = False  # one request in PRIORITY_EVERY asks for class -1
    disagg: bool = False  # --prefill-backends of the backends prefill, the rest decode
    # SLO admission (kvgate.slo) with the report's TTFT objective: "shed" (every request sheddable)
    # or "keep" (none is: requests move or wait for the objective, and are never refused for it).
    slo: str | None = None


def queue(order: str, **more: Any) -> dict[str, Any]:
    # Ageing 10 s unless a lever says otherwise: the documented rows were measured with it.
    return {"enabled": True, "order": order, "max_wait_ms": 600_000, "ageing_ms": 10_000, **more}


# With the gateway queue on, a backend counts as full sooner: little waits inside it, so the gateway
# holds the backlog and chooses its order and its backend late.
TIGHT = {"saturation_waiting": 1, "saturation_prefill_tokens": 8192}
PRIORITY = {**NO_LEARN, "queue": queue("fcfs", client_priority=True, forward_priority=True)}


def budget(tokens: int) -> dict[str, Any]:
    """Routing thresholds for the queue: a backend is full at one waiting request or ``tokens``
    queued prefill tokens."""
    return {"saturation_waiting": 1, "saturation_prefill_tokens": tokens}


# The whole layer as the example config recommends it (the best measured on the trace): learned
# tokens, the shortest-first queue with 75 s ageing and a long prompt's 5 ms gather, a 2,048-token
# budget. Live runs use it too.
RECOMMENDED = {"queue": queue("shortest", ageing_ms=75_000, gather_ms=5), "routing": budget(2048)}

LEVERS = {
    lv.name: lv
    for lv in (
        Lever("round_robin", PolicyName.ROUND_ROBIN, NO_LEARN),
        Lever("routing", PolicyName.KVGATE, NO_LEARN),
        Lever("+tokens", PolicyName.KVGATE),
        Lever("+queue", PolicyName.KVGATE, {**NO_LEARN, "queue": queue("fcfs")}),
        Lever("+queue-shortest", PolicyName.KVGATE, {**NO_LEARN, "queue": queue("shortest")}),
        Lever("+queue-tight", PolicyName.KVGATE, {**NO_LEARN, "queue": queue("fcfs")}, TIGHT),
        Lever("+queue-tight-shortest", PolicyName.KVGATE, {**NO_LEARN, "queue": queue("shortest")}, TIGHT),
        *(
            Lever(
                f"+queue-tight-shortest-ageing-{seconds}s",
                PolicyName.KVGATE,
                {**NO_LEARN, "queue": queue("shortest", ageing_ms=seconds * 1000)},
                TIGHT,
            )
            for seconds in (30, 60, 75, 90, 120)
        ),
        *(
            Lever(
                f"+queue-tight-shortest-fair-{multiple}x",
                PolicyName.KVGATE,
                {**NO_LEARN, "queue": queue("shortest", ageing_ms=600_000, ageing_fair_share=multiple)},
                TIGHT,
            )
            for multiple in (2, 4)
        ),
        *(
            Lever(
                f"+queue-shortest-budget-{tokens}",
                PolicyName.KVGATE,
                {"queue": RECOMMENDED["queue"]},
                budget(tokens),
            )
            for tokens in (1024, 2048, 4096, 16384)
        ),
        # A burst's long prompts wait this long so that its short ones go first (queue.gather_ms).
        *(
            Lever(
                f"+queue-gather-{ms}ms",
                PolicyName.KVGATE,
                {"queue": {**RECOMMENDED["queue"], "gather_ms": ms}},
                RECOMMENDED["routing"],
            )
            for ms in (0, 1, 5, 20)
        ),
        Lever("+pools", PolicyName.KVGATE, NO_LEARN, pools=True),
        *(
            Lever(f"+pools-backlog-{r:g}", PolicyName.KVGATE, NO_LEARN, pools=True, backlog_ratio=r)
            for r in (1.25, 1.5, 2, 4)
        ),
        # Pools under the gateway queue as recommended: a waiting request spills when it is planned.
        Lever("+pools-queue", PolicyName.KVGATE, {"queue": RECOMMENDED["queue"]}, TIGHT, pools=True),
        Lever(
            "+pools-queue-backlog-2",
            PolicyName.KVGATE,
            {"queue": RECOMMENDED["queue"]},
            TIGHT,
            pools=True,
            backlog_ratio=2,
        ),
        Lever("+priority", PolicyName.KVGATE, PRIORITY, priority=True),
        Lever("+priority-tight", PolicyName.KVGATE, PRIORITY, TIGHT, priority=True),
        Lever("+pd", PolicyName.KVGATE, {**NO_LEARN, "disaggregation": {"models": ["*"]}}, disagg=True),
        # The whole layer as the defaults and the example config have it: learned tokens, the tight
        # shortest-first queue with the default ageing.
        Lever("all", PolicyName.KVGATE, {"queue": RECOMMENDED["queue"]}, TIGHT),
        Lever("+slo-keep", PolicyName.KVGATE, {"queue": RECOMMENDED["queue"]}, TIGHT, slo="keep"),
        Lever("+slo-shed", PolicyName.KVGATE, {"queue": RECOMMENDED["queue"]}, TIGHT, slo="shed"),
    )
}


def slo_section(lever: Lever, slo: report.Slo) -> dict[str, Any]:
    """The lever's objectives: the report's TTFT objective for every request; sheddable from the
    default class (0) up, or from class 1 (which no request of the benchmark has)."""
    if lever.slo is None:
        return {}
    objective = {"ttft_ms": slo.ttft_s * 1000, "itl_ms": slo.itl_s * 1000}
    return {"slo": {"objectives": [objective], "sheddable_priority": 0 if lever.slo == "shed" else 1}}


def pool_setup(feats: Sequence[Features], backends: int) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """A long pool of a quarter of the backends for the longest quarter of prompts (by the same
    estimate the gateway makes), the rest short; each spills to the other."""
    lengths = sorted(f.est_tokens for f in feats)
    threshold = max(1, lengths[len(lengths) * 3 // 4])
    long_n = max(1, backends // 4)
    labels = [{"pool": "long" if i < long_n else "short"} for i in range(backends)]
    pools = {
        "rules": [{"pool": "short", "max_prompt_tokens": threshold}, {"pool": "long"}],
        "spill": {"short": ["long"], "long": ["short"]},
    }
    return {"pools": pools}, labels


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / max(1, len(xs))


def p90(sorted_xs: Sequence[float]) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(0.9 * len(sorted_xs)))] if sorted_xs else 0.0


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate-bench levers", description=__doc__)
    add_workload_args(p)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--speedups", type=float, nargs="+", default=[1.0, 3.0])
    p.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    p.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES))
    p.add_argument("--prefill-backends", type=int, default=None, help="+pd: prefill backends (a quarter)")
    p.add_argument(
        "--index",
        choices=["approximate", "exact"],
        default="approximate",
        help="exact: the sidecar gets each prompt's token ids and the engines' KV events",
    )
    p.add_argument("--out", default="bench-results/levers")
    args = p.parse_args(argv)
    reqs = build_workload(args)
    profile = get_profile(args.profile)
    print(f"{len(reqs)} requests; computing features", file=sys.stderr)
    feats = virtual.features_for(reqs)
    urgent = {r.rid for r in reqs if r.rid % PRIORITY_EVERY == 0}
    with_priority: list[Features] = [
        dataclasses.replace(f, priority=-1) if r.rid in urgent else f
        for r, f in zip(reqs, feats, strict=True)
    ]
    cached = bounds.pooled_cache_ideal(reqs, args.backends, profile)
    ideal = sum(cached) / max(1, sum(r.prompt_tokens for r in reqs))
    zero_q = bounds.zero_queue_ttft(reqs, cached, profile)
    pools_extra, pool_labels = pool_setup(feats, args.backends)
    prefillers = args.prefill_backends or max(1, args.backends // 4)
    pd_labels = [{"role": "prefill" if i < prefillers else "decode"} for i in range(args.backends)]
    zero_by_rid = {r.rid: z for r, z in zip(reqs, zero_q, strict=True)}
    rows: list[Summary] = []
    slo = report.Slo.from_args(args)
    notes: list[str] = []
    for speedup in args.speedups:
        base = None
        fleet = mean(bounds.fleet_ttft(reqs, cached, profile, args.backends, speedup))
        for name in args.levers:
            lv = LEVERS[name]
            extra = {
                **lv.extra,
                **(
                    {"pools": {**pools_extra["pools"], "backlog_ratio": lv.backlog_ratio or 0}}
                    if lv.pools
                    else {}
                ),
                **slo_section(lv, slo),
            }
            labels = pool_labels if lv.pools else pd_labels if lv.disagg else None
            run = virtual.replay(
                reqs,
                with_priority if lv.priority else feats,
                lv.policy,
                args.backends,
                profile,
                speedup,
                progress=Progress(f"{name} x{speedup:g}"),
                routing=lv.routing,
                extra=extra,
                labels=labels,
                index=args.index,
            )
            row = virtual.summarize_run(
                f"{name} x{speedup:g}", run, ideal, sum(zero_q) / len(zero_q), speedup, slo
            )
            row = dataclasses.replace(row, errors=run.rejected, fleet_ttft=fleet)
            rows.append(row)
            base = base if base is not None else row.ttft_mean
            line = (
                f"{name:16} x{speedup:<4g} TTFT mean {row.ttft_mean:7.3f}s ({row.ttft_mean / base:.2f}x) "
                f"p50 {row.ttft_p50:.3f} p90 {row.ttft_p90:.3f} p99 {row.ttft_p99:.3f} "
                f"hit {row.hit_rate:.1%} rejected {run.rejected} SLO met {row.slo_met:.1%}"
            )
            if run.queue_waits:  # over every request: one that never waited counts as 0
                waits = sorted(run.queue_waits)
                line += (
                    f" | queue: {len(waits) / len(reqs):.0%} waited, "
                    f"mean wait {sum(waits) / len(reqs):.3f}s, p90 of those who waited {p90(waits):.3f}s"
                )
            if lv.slo == "shed":  # the shed that no idle backend could have served in time
                served = {r.rid for r in run.results}
                hopeless = sum(1 for r in reqs if r.rid not in served and zero_by_rid[r.rid] > slo.ttft_s)
                line += f" | shed {len(reqs) - len(served)}, {hopeless} of them past the objective even alone"
            if lv.priority:
                hi = sorted(r.ttft for r in run.results if r.rid in urgent)
                lo = sorted(r.ttft for r in run.results if r.rid not in urgent)
                hi_zero = sorted(zero_by_rid[r.rid] for r in run.results if r.rid in urgent)
                line += (
                    f" | class -1: mean {mean(hi):.3f}s p90 {p90(hi):.3f}s (zero-queue p90 "
                    f"{p90(hi_zero):.3f}s); class 0: mean {mean(lo):.3f}s p90 {p90(lo):.3f}s"
                )
            print(line, file=sys.stderr)
            notes.append(line)
        line = f"{'fleet bound':16} x{speedup:<4g} TTFT mean {fleet:7.3f}s ({fleet / (base or fleet):.2f}x)"
        print(line, file=sys.stderr)
        notes.append(line)
    head = report.header(["levers", *argv])
    out = Path(args.out) / f"{args.workload}-{args.backends}-backends"
    path = report.write(
        out, f"compute levers, {args.workload}, {args.backends} x {profile.name}", head, rows, notes=notes
    )
    print(f"wrote {path}")
    return 0
