"""``kvgate-bench real-vs-sim``: is the simulator a stand-in for a real vLLM?

1. Calibrate: measure one real server beside N-1 busy ones (``vllm_real.calibrate --neighbours``:
   prefill per word and per chunk, decode against batch size and context, the cache's blocks) and
   write a ``vllm-sim`` profile. Beside busy neighbours, because that is how fast a server of the
   loaded fleet is (each on a core of its own, they still share memory and caches).
2. Run one workload through each target (default: round robin and kvgate) on N real vLLM servers,
   their prefix caches reset before each run.
3. Run it again through the same targets on N simulators with that profile, in real time.
4. Report mean and p90 TTFT of each target on both fleets, their ratio, and whether the policies
   come out in the same order. Prompts are written in the vocabulary the tiny model tokenizes one
   word to one token, so a prompt is as long on both fleets.

The goal: each sim figure within 15 % of the real one, and the same order of policies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate_bench import live, report, targets
from kvgate_bench.workloads import add_workload_args, build_workload

TOLERANCE = 0.15


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate-bench real-vs-sim", description=__doc__.split("\n")[0])
    add_workload_args(p)
    p.add_argument("--servers", type=int, default=2, help="real servers, and simulators")
    p.add_argument("--targets", nargs="+", default=["kvgate:round_robin", "kvgate:kvgate"])
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--profile", type=Path, help="a profile calibrate wrote (default: calibrate now)")
    p.add_argument("--out", default="bench-results/real-vs-sim")
    args = p.parse_args(argv)
    from vllm_real import calibrate
    from vllm_real.fleet import MODEL

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model, args.words, args.time_scale = MODEL, "vocab", 1.0
    args.backends, args.peer_cpus = args.servers, None
    profile = args.profile
    if profile is None:
        profile = out / "profile.json"
        calibrate.main(
            [
                *("--out", str(profile), "--run-dir", str(out / "run" / "calibrate")),
                *("--neighbours", str(args.servers - 1)),
            ]
        )
    args.profile = str(profile)
    measured = json.loads(Path(profile).read_text())
    reqs = build_workload(args)
    print(f"{len(reqs)} requests; profile {profile}: {json.dumps(measured['measured'])}", file=sys.stderr)
    rows: dict[str, list[report.Summary]] = {"real": [], "sim": []}
    args.real_vllm = args.servers
    with targets.real_fleet(args, out) as real:
        for _ in range(args.repeats):
            for target in args.targets:
                rows["real"].append(
                    live.run_target(args, target, args.speedup, reqs, out / "real", None, real)[0]
                )
    for _ in range(args.repeats):
        for target in args.targets:
            rows["sim"].append(live.run_target(args, target, args.speedup, reqs, out / "sim")[0])
    table = compare_table(rows, args.targets)
    runs = [dataclasses.replace(r, target=f"{r.target} ({fleet})") for fleet in rows for r in rows[fleet]]
    notes = [
        f"Workload: {args.workload}, {len(reqs)} requests, {args.servers} servers, speed-up "
        f"{args.speedup:g}. Profile: `{profile}` ({json.dumps(measured['measured'])}).",
        "",
        table,
    ]
    report.write(
        out, "Real vLLM against the simulator", report.header(argv or sys.argv[1:]), runs, None, notes
    )
    print(table)
    print(f"wrote {out / 'report.md'}")
    return 0


def compare_table(rows: dict[str, list[report.Summary]], targets: Sequence[str]) -> str:
    """Per target: real and simulated mean and p90 TTFT (means over repeats), their ratio, in goal."""
    lines = [
        "| target | real mean s | sim mean s | sim/real | real p90 s | sim p90 s | sim/real | within 15 % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order: dict[str, list[tuple[float, str]]] = {"real": [], "sim": []}
    for t in targets:
        got = {}
        for fleet in ("real", "sim"):
            runs = [r for r in rows[fleet] if r.target == t]
            got[fleet] = (
                sum(r.ttft_mean for r in runs) / len(runs),
                sum(r.ttft_p90 for r in runs) / len(runs),
            )
            order[fleet].append((got[fleet][0], t))
        (rm, rp), (sm, sp) = got["real"], got["sim"]
        ok = abs(sm / rm - 1) <= TOLERANCE and abs(sp / rp - 1) <= TOLERANCE
        lines.append(
            f"| {t} | {rm:.3f} | {sm:.3f} | {sm / rm:.2f} | {rp:.3f} | {sp:.3f} | {sp / rp:.2f} | "
            f"{'yes' if ok else 'no'} |"
        )
    same = [t for _, t in sorted(order["real"])] == [t for _, t in sorted(order["sim"])]
    lines.append("")
    lines.append(f"Policies in the same order on both fleets (by mean TTFT): {'yes' if same else 'no'}.")
    return "\n".join(lines)
