"""Two tenants, one flooding: does the quiet one keep its TTFT? Virtual time, the gateway queue on.

Tenant ``quiet`` sends a window of the conversation trace at trace speed; tenant ``flood`` sends
another window of it at ``--flood`` times that rate, over the same time, each under its own API key
(``Features.client_key``), so together they are far past what the backends serve and the gateway
queue holds what waits. Side by side, same seed: the quiet tenant alone; both with the queue first
come first served; both with the fair order (``queue.order: fair``, ``kvgate.tenants``), without and
with the backends it keeps clear for the tenant under its share (``queue.fair_reserve``). Reported
per tenant: mean, p50 and p90 TTFT of the requests served, and how many the gateway refused (429).

    kvgate-bench fairness --duration 300 --flood 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.public import PolicyName

from kvgate_bench import report, virtual
from kvgate_bench.workloads import DEFAULT_TRACE, BenchRequest, load_trace
from vllm_sim.profiles import get_profile

QUIET, FLOOD = "quiet", "flood"


def two_tenants(
    trace: Path, duration: float, flood: float, gap: float = 1200.0
) -> tuple[list[BenchRequest], list[str]]:
    """The quiet tenant's window (from 0 s) and the flood's (from ``gap`` s in the trace, its arrivals
    ``flood`` times as dense, over the same ``duration``), merged and renumbered; each request's
    tenant."""
    quiet = load_trace(trace, 0.0, duration, spread=True)
    loud = load_trace(trace, gap, duration * flood, spread=True)
    tagged = [(r.arrival, QUIET, r) for r in quiet] + [(r.arrival / flood, FLOOD, r) for r in loud]
    tagged.sort(key=lambda t: t[0])
    reqs = [dataclasses.replace(r, rid=i, arrival=at) for i, (at, _, r) in enumerate(tagged)]
    return reqs, [tenant for _, tenant, _ in tagged]


def run(
    reqs: Sequence[BenchRequest],
    tenants: Sequence[str],
    order: str,
    backends: int,
    profile: str,
    reserve: int | None = None,
) -> dict[str, Any]:
    """One replay; ``reserve``: ``queue.fair_reserve`` (None: the default)."""
    feats = [
        dataclasses.replace(f, client_key=t) for f, t in zip(virtual.features_for(reqs), tenants, strict=True)
    ]
    queue: dict[str, Any] = {"enabled": True, "order": order, "max_wait_ms": 600_000}
    if reserve is not None:
        queue["fair_reserve"] = reserve
    result = virtual.replay(
        reqs, feats, PolicyName.KVGATE, backends, get_profile(profile), extra={"queue": queue}
    )
    label = order if reserve is None else f"{order}, reserve {reserve}"
    out: dict[str, Any] = {"order": label, "rejected": result.rejected}
    for tenant in sorted(set(tenants)):
        ttfts = sorted(r.ttft for r in result.results if tenants[r.rid] == tenant)
        sent = sum(1 for t in tenants if t == tenant)
        out[tenant] = {
            "sent": sent,
            "served": len(ttfts),
            "mean": statistics.fmean(ttfts) if ttfts else float("nan"),
            "p50": report.pct(ttfts, 0.5),
            "p90": report.pct(ttfts, 0.9),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of the quiet tenant's window")
    p.add_argument("--flood", type=float, default=3.0, help="the flooding tenant's rate, x the quiet one's")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--out", default="bench-results/fairness")
    args = p.parse_args(argv)
    reqs, tenants = two_tenants(args.trace, args.duration, args.flood)
    quiet_only = [i for i, t in enumerate(tenants) if t == QUIET]
    alone_reqs = [dataclasses.replace(reqs[i], rid=n) for n, i in enumerate(quiet_only)]
    rows = [
        {**run(alone_reqs, [QUIET] * len(alone_reqs), "fcfs", args.backends, args.profile), "order": "alone"}
    ]
    rows.append(run(reqs, tenants, "fcfs", args.backends, args.profile))
    rows.append(run(reqs, tenants, "fair", args.backends, args.profile, reserve=0))  # the order alone
    rows.append(run(reqs, tenants, "fair", args.backends, args.profile))
    alone = rows[0][QUIET]
    lines = [
        "| run | quiet: served / sent | mean | p50 | p90 TTFT (x alone) | flood: served / sent | p90 "
        "| refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        q = row[QUIET]
        f = row.get(FLOOD)
        flood = f"{f['served']} / {f['sent']} | {f['p90']:.3f} s" if f else "| "
        lines.append(
            f"| {row['order']} | {q['served']} / {q['sent']} | {q['mean']:.3f} s | {q['p50']:.3f} s | "
            f"{q['p90']:.3f} s ({q['p90'] / alone['p90']:.2f}x) | {flood} | {row['rejected']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    head = report.header(["fairness", *(sys.argv[1:] if argv is None else argv)])
    report.write_json(out / "fairness.json", {"header": head, "rows": rows})
    (out / "report.md").write_text(f"# Two tenants, one flooding\n\n`{head['command']}`\n\n{text}")
    print(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
