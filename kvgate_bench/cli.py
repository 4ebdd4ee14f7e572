"""``kvgate-bench``: virtual-time replay, live runs against any OpenAI URL, and side-by-side compare."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.public import PolicyName, version

from kvgate_bench import live, report
from kvgate_bench.report import Progress, Summary
from kvgate_bench.virtual_gateway import Spread
from kvgate_bench.workloads import add_workload_args, build_workload

if TYPE_CHECKING:
    from kvgate_bench.virtual import Result
from vllm_sim.profiles import PROFILES, get_profile


def cmd_virtual(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from kvgate_bench import bounds, virtual

    try:
        profile = get_profile(args.profile)
    except ValueError as exc:
        print(f"kvgate-bench virtual: {exc}", file=sys.stderr)
        return 2
    reqs = build_workload(args)
    print(f"{len(reqs)} requests; computing features", file=sys.stderr)
    feats = virtual.features_for(reqs)
    head = report.header(argv)
    spread = Spread(args.spread)
    for n in args.backends:
        cached = bounds.pooled_cache_ideal(reqs, n, profile)
        ideal = sum(cached) / max(1, sum(r.prompt_tokens for r in reqs))
        zero_q = bounds.zero_queue_ttft(reqs, cached, profile)
        rows: list[Summary] = []
        cdfs: dict[str, list[float]] = {}
        for speedup, name, replicas in itertools.product(args.speedups, args.policies, args.replicas):
            label = name if len(args.replicas) == 1 else f"{name} x{replicas} replicas"
            policy = PolicyName(name)
            run = virtual.replay(
                reqs,
                feats,
                policy,
                n,
                profile,
                speedup,
                progress=Progress(f"{n} backends, {label}, x{speedup:g}"),
                extra=None if args.learn_tokens else {"tokens": {"learn": False}},
                frontend_per_token_s=args.frontend_per_token_us * 1e-6,
                index=args.index,
                replicas=replicas,
                spread=spread,
                share_load=not args.islands,
            )
            row = virtual.summarize_run(
                label, run, ideal, sum(zero_q) / len(zero_q), speedup, report.Slo.from_args(args)
            )
            fleet = bounds.fleet_ttft(reqs, cached, profile, n, speedup)
            row = dataclasses.replace(row, fleet_ttft=sum(fleet) / len(fleet))
            rows.append(row)
            if speedup == args.speedups[0]:
                cdfs[label] = [r.ttft for r in run.results]
            print(
                f"  {label:16} x{speedup:<5g} TTFT mean {row.ttft_mean:.3f}s p90 {row.ttft_p90:.3f}s "
                f"(fleet bound {row.fleet_ttft:.3f}s) "
                f"hit {row.hit_rate:.1%} (ideal {ideal:.1%}) imbalance {row.imbalance:.2f} "
                f"[{run.wall_s:.0f}s]{regret(run.results)}{prediction(run.results)}",
                file=sys.stderr,
            )
        out = Path(args.out) / f"{args.workload}-{n}-backends"
        path = report.write(out, f"virtual time, {args.workload}, {n} x {profile.name}", head, rows, cdfs)
        print(f"wrote {path}")
    return 0


def regret(results: Sequence[Result]) -> str:
    """Cached prompt tokens the index predicted on each request's backend against what its engine
    delivered: the totals, and the median of the per-request gap as a share of the prompt."""
    if not results:
        return ""
    gaps = sorted(abs(r.predicted_tokens - r.cached_tokens) / max(1, r.prompt_tokens) for r in results)
    predicted = sum(r.predicted_tokens for r in results)
    delivered = sum(r.cached_tokens for r in results)
    return (
        f" predicted {predicted} / delivered {delivered} cached tokens, "
        f"gap p50 {gaps[len(gaps) // 2]:.1%} p90 {gaps[int(len(gaps) * 0.9)]:.1%} of the prompt"
    )


def prediction(results: Sequence[Result]) -> str:
    """How far the sidecar's expected TTFT (``Routed.predicted_ttft_s``) was from the one served:
    |observed - predicted| / observed, over the requests it made a prediction for."""
    errors = sorted(
        abs(r.ttft - r.predicted_ttft) / r.ttft
        for r in results
        if r.predicted_ttft is not None and r.ttft > 0
    )
    if not errors:
        return ""
    return (
        f"; TTFT predicted for {len(errors)} of {len(results)}, error p50 "
        f"{errors[len(errors) // 2]:.0%} p90 {errors[int(len(errors) * 0.9)]:.0%}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C, so every process a run started is stopped on the way out.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


# Subcommands with a parser of their own: name -> (module, help).
OWN_PARSERS = {
    "load": ("kvgate_bench.load", "closed-loop load: the sidecar's decision budget under N clients"),
    "faults": ("kvgate_bench.faults", "fault injection suite, fuzz corpus and soak"),
    "overhead": ("kvgate_bench.gateway_overhead", "latency and CPU each gateway adds over a plain proxy"),
    "decisions": ("kvgate_bench.decision_latency", "the sidecar's decision latency, alone and in bursts"),
    "sim-capacity": ("kvgate_bench.sim_capacity", "how many simulated instances this machine keeps on time"),
    "twin": ("kvgate_bench.twin", "live against virtual on the same window, repeated"),
    "levers": ("kvgate_bench.levers", "each compute-scheduling lever alone and together, in virtual time"),
    "real-vs-sim": ("kvgate_bench.real_vs_sim", "calibrate the simulator on a real vLLM, then both fleets"),
    "capacity": ("kvgate_bench.capacity", "requests per second one gateway replica decides, and two"),
    "fairness": ("kvgate_bench.fairness", "two tenants, one flooding: the gateway queue's fair order"),
}


def _main(argv: list[str]) -> int:
    if argv and argv[0] in OWN_PARSERS:
        import importlib

        module = importlib.import_module(OWN_PARSERS[argv[0]][0])
        code: int = module.main(argv[1:])
        return code
    p = argparse.ArgumentParser(prog="kvgate-bench", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvgate-bench {version()}")
    sub = p.add_subparsers(dest="mode", required=True)
    v = sub.add_parser(
        "virtual", help="replay in virtual time through kvgate's policies and simulated engines"
    )
    add_workload_args(v)
    v.add_argument("--backends", type=int, nargs="+", default=[4])
    v.add_argument(
        "--policies", nargs="+", default=[p.value for p in PolicyName], choices=[p.value for p in PolicyName]
    )
    v.add_argument("--speedups", type=float, nargs="+", default=[1.0], help="arrival-rate multipliers")
    v.add_argument(
        "--fixed-tokens",
        dest="learn_tokens",
        action="store_false",
        help="estimate 4 bytes per token instead of learning the ratio (results before the tokens setting)",
    )
    v.add_argument(
        "--frontend-per-token-us",
        type=float,
        default=0.0,
        help="frontend (tokenization) time per prompt token: a burst's short prompts then reach their "
        "engine before its long ones, as they do live (default 0: in arrival order)",
    )
    v.add_argument(
        "--index",
        choices=["approximate", "exact"],
        default="approximate",
        help="exact: the sidecar gets each prompt's token ids and the engines' KV events",
    )
    v.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1],
        help="gateway replicas routing the same backends, each its own sidecar core (sessions shared "
        "as through Redis); several values run side by side",
    )
    v.add_argument(
        "--spread",
        choices=[s.value for s in Spread],
        default=Spread.RANDOM.value,
        help="how the client spreads requests over the replicas: a new connection to any (random), "
        "or in turn",
    )
    v.add_argument(
        "--islands",
        action="store_true",
        help="replicas do not share their in-flight load (redis.load_share_ms 0): the baseline",
    )
    v.add_argument(
        "--profile",
        default="llama3-8b-h100",
        help=f"{', '.join(sorted(PROFILES))}, or a profile JSON a calibration wrote",
    )
    v.add_argument("--out", default="bench-results/virtual")
    live.add_parsers(sub)
    for name, (_, text) in OWN_PARSERS.items():
        sub.add_parser(name, help=text, add_help=False)
    args = p.parse_args(argv)
    if args.mode == "virtual":
        return cmd_virtual(args, argv)
    return live.run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
