"""Live against virtual on the same window: does the live gateway do what the virtual replay says?

For each speed-up and kvgate policy, the workload is replayed in virtual time (deterministic) and run
live ``--repeats`` times through the real gateway in front of fresh simulated backends (``compare``'s
runs). The report gives each live run, their spread, and live mean / virtual mean.

A replay scrapes the engines at fixed instants; live, the sidecar's scrape clock has an arbitrary phase
against the arrivals, and a load-aware policy's placements (and through the caches, later ones) follow
what each scrape saw. ``--scrape-phases K`` replays K times with the first scrape spread over one
interval and takes the virtual twin as their mean (range reported); 1 keeps the single replay.

    kvgate-bench twin --duration 600 --policies round_robin kvgate --speedups 1 1.5 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate.public import PolicyName

from kvgate_bench import bounds, report, virtual
from kvgate_bench.live import run_target
from kvgate_bench.report import Progress, Summary
from kvgate_bench.workloads import add_workload_args, build_workload
from vllm_sim.profiles import PROFILES, get_profile


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench twin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(p)
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--profile", default="llama3-8b-h100", choices=sorted(PROFILES))
    p.add_argument(
        "--policies", nargs="+", default=["round_robin", "kvgate"], choices=[x.value for x in PolicyName]
    )
    p.add_argument("--speedups", type=float, nargs="+", default=[1.0, 1.5])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=3.0)
    p.add_argument("--out", default="bench-results/twin")
    p.add_argument(
        "--scrape-phases", type=int, default=1, help="replays per cell, first scrape spread over one interval"
    )
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    reqs = build_workload(args)
    profile = get_profile(args.profile)
    feats = virtual.features_for(reqs)
    cached = bounds.pooled_cache_ideal(reqs, args.backends, profile)
    ideal = sum(cached) / max(1, sum(r.prompt_tokens for r in reqs))
    zero_q = bounds.zero_queue_ttft(reqs, cached, profile)
    out = Path(args.out)
    rows: list[Summary] = []
    lines = [
        "| policy | speed-up | virtual mean TTFT s | live runs mean TTFT s | live / virtual | "
        "virtual p90 s | live p90 s (runs) | virtual hit | live hit (runs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for speedup in args.speedups:
        for name in args.policies:
            phases = max(1, args.scrape_phases)
            replays: list[Summary] = []
            for k in range(phases):
                phase = virtual.SCRAPE_INTERVAL_S * k / phases
                label = f"virtual {name}" + (f" (first scrape {phase:.2f} s)" if phases > 1 else "")
                run = virtual.replay(
                    reqs,
                    feats,
                    PolicyName(name),
                    args.backends,
                    profile,
                    speedup,
                    scrape_phase=phase,
                    progress=Progress(label),
                )
                v = virtual.summarize_run(
                    label, run, ideal, sum(zero_q) / len(zero_q), speedup, report.Slo.from_args(args)
                )
                replays.append(v)
                rows.append(v)
                print(
                    f"  {label} x{speedup:g} TTFT mean {v.ttft_mean:.3f}s p90 {v.ttft_p90:.3f}s",
                    file=sys.stderr,
                )
            v_means = [v.ttft_mean for v in replays]
            v_mean = statistics.fmean(v_means)
            v_p90 = statistics.fmean(v.ttft_p90 for v in replays)
            v_hit = statistics.fmean(v.hit_rate for v in replays)
            v_text = f"{v_mean:.3f}" + (f" ({min(v_means):.3f} to {max(v_means):.3f})" if phases > 1 else "")
            live: list[Summary] = []
            for _ in range(args.repeats):
                row, _ttfts = run_target(args, f"kvgate:{name}", speedup, reqs, out)
                live.append(row)
                rows.append(row)
            means = [r.ttft_mean for r in live]
            lines.append(
                f"| {name} | {speedup:g} | {v_text} | "
                + ", ".join(
                    f"{m:.3f}" + ("" if r.valid else " (invalid)") for m, r in zip(means, live, strict=True)
                )
                + f" | {statistics.fmean(means) / v_mean:.3f} ({min(means) / v_mean:.3f} to "
                f"{max(means) / v_mean:.3f}) | {v_p90:.3f} | "
                + ", ".join(f"{r.ttft_p90:.3f}" for r in live)
                + f" | {v_hit:.1%} | "
                + ", ".join(f"{r.hit_rate:.1%}" for r in live)
                + " |"
            )
    head = report.header(["twin", *argv])
    notes = ["## Live against virtual", "", *lines]
    path = report.write(
        out, f"live vs virtual, {args.workload}, {args.backends} x {profile.name}", head, rows, None, notes
    )
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
