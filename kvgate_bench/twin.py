"""Live against virtual on the same window: does the live gateway do what the virtual replay says?

For each speed-up and kvgate policy, the workload is replayed once in virtual time (deterministic)
and run live ``--repeats`` times through the real gateway in front of fresh simulated backends
(``compare``'s runs). The report gives each live run, their spread, and live mean / virtual mean.

    kvgate-bench twin --duration 600 --policies round_robin kvgate --speedups 1 1.5 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate.config import PolicyName

from kvgate_bench import report, virtual
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
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    reqs = build_workload(args)
    profile = get_profile(args.profile)
    feats = virtual.features_for(reqs)
    cached = virtual.pooled_cache_ideal(reqs, args.backends, profile)
    ideal = sum(cached) / max(1, sum(r.prompt_tokens for r in reqs))
    zero_q = virtual.zero_queue_ttft(reqs, cached, profile)
    out = Path(args.out)
    rows: list[Summary] = []
    lines = [
        "| policy | speed-up | virtual mean TTFT s | live runs mean TTFT s | live / virtual | "
        "virtual p90 s | live p90 s (runs) | virtual hit | live hit (runs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for speedup in args.speedups:
        for name in args.policies:
            run = virtual.replay(
                reqs,
                feats,
                PolicyName(name),
                args.backends,
                profile,
                speedup,
                progress=Progress(f"virtual {name}"),
            )
            v = virtual.summarize_run(f"virtual {name}", run, ideal, sum(zero_q) / len(zero_q), speedup)
            rows.append(v)
            print(
                f"  virtual {name:12} x{speedup:g} TTFT mean {v.ttft_mean:.3f}s p90 {v.ttft_p90:.3f}s",
                file=sys.stderr,
            )
            live: list[Summary] = []
            for _ in range(args.repeats):
                row, _ttfts = run_target(args, f"kvgate:{name}", speedup, reqs, out)
                live.append(row)
                rows.append(row)
            means = [r.ttft_mean for r in live]
            lines.append(
                f"| {name} | {speedup:g} | {v.ttft_mean:.3f} | "
                + ", ".join(
                    f"{m:.3f}" + ("" if r.valid else " (invalid)") for m, r in zip(means, live, strict=True)
                )
                + f" | {statistics.fmean(means) / v.ttft_mean:.3f} ({min(means) / v.ttft_mean:.3f} to "
                f"{max(means) / v.ttft_mean:.3f}) | {v.ttft_p90:.3f} | "
                + ", ".join(f"{r.ttft_p90:.3f}" for r in live)
                + f" | {v.hit_rate:.1%} | "
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
