"""Two tenants, one flooding: does the quiet one keep its TTFT? The gateway queue on; virtual time, or
real time on real vLLM servers (``--real-vllm``, ``kvgate_bench.fairness_live``).

Tenant ``quiet`` sends a window of the conversation trace at trace speed; tenant ``flood`` sends
another window of it at ``--flood`` times that rate, over the same time, each under its own API key
(``Features.client_key``), so together they are far past what the backends serve and the gateway
queue holds what waits. Side by side, same seed: the quiet tenant alone; both with the queue first
come first served; both with the fair order (``queue.order: fair``, ``kvgate.tenants``), without and
with the backends it keeps clear for the tenant under its share (``queue.fair_reserve``). Reported
per tenant: mean, p50 and p90 TTFT of the requests served, and how many the gateway refused (429).

    kvgate-bench fairness --duration 300 --flood 3
    kvgate-bench fairness --duration 300 --flood 0.5 --flood-output 8   # a flood of long answers
    kvgate-bench fairness --duration 300 --flood 3 --quiet-asks 4096    # a generous max_tokens
    kvgate-bench fairness --real-vllm 2 --trace-block-tokens 32 --duration 120 --flood 3 --start 0 0 0
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.public import PolicyName

from kvgate_bench import fairness_live, report, virtual
from kvgate_bench.fairness_report import FLOOD, QUIET, label_of, row, summary, table
from kvgate_bench.targets import add_real_args, fit_to_real, real_fleet
from kvgate_bench.workloads import (
    DEFAULT_TRACE,
    SIM_MODEL,
    TRACE_BLOCK_TOKENS,
    BenchRequest,
    add_scale_args,
    load_trace,
    scaled,
    within,
)
from vllm_sim.profiles import get_profile


def two_tenants(
    trace: Path,
    duration: float,
    flood: float,
    gap: float = 1200.0,
    start: float = 0.0,
    words: str = "filler",
    block: int = TRACE_BLOCK_TOKENS,
    model: str = SIM_MODEL,
    most: int | None = None,
    flood_output: float = 1.0,
    quiet_asks: int | None = None,
) -> tuple[list[BenchRequest], list[str]]:
    """The quiet tenant's window (from ``start`` s) and the flood's (``gap`` s after it, its arrivals
    ``flood`` times as dense, over the same ``duration``, its answers ``flood_output`` times as
    long), merged and renumbered; each request's tenant. ``quiet_asks``: the ``max_tokens`` the
    quiet tenant's requests ask for; they write what the trace says (virtual time). ``words``,
    ``block``: as ``workloads.scaled`` writes them (real vLLM); ``most``: the longest request kept
    (``workloads.within``)."""

    def window(start: float, length: float, output: float = 1.0) -> list[BenchRequest]:
        reqs = scaled(load_trace(trace, start, length, model=model, spread=True), words, block)
        if output != 1.0:
            reqs = [
                dataclasses.replace(r, output_tokens=max(1, round(r.output_tokens * output))) for r in reqs
            ]
        return within(reqs, most)

    quiet, loud = window(start, duration), window(start + gap, duration * flood, flood_output)
    if quiet_asks is not None:
        quiet = [dataclasses.replace(r, asks=max(quiet_asks, r.output_tokens)) for r in quiet]
    tagged = [(r.arrival, QUIET, r) for r in quiet] + [(r.arrival / flood, FLOOD, r) for r in loud]
    tagged.sort(key=lambda t: t[0])
    reqs = [dataclasses.replace(r, rid=i, arrival=at) for i, (at, _, r) in enumerate(tagged)]
    return reqs, [tenant for _, tenant, _ in tagged]


def queue_section(order: str, reserve: int | None) -> dict[str, Any]:
    """The gateway queue of a run; ``reserve``: ``queue.fair_reserve`` (None: the default)."""
    queue: dict[str, Any] = {"enabled": True, "order": order, "max_wait_ms": 600_000}
    if reserve is not None:
        queue["fair_reserve"] = reserve
    return queue


def run(
    reqs: Sequence[BenchRequest],
    tenants: Sequence[str],
    order: str,
    backends: int,
    profile: str,
    reserve: int | None = None,
) -> dict[str, Any]:
    """One replay in virtual time; ``reserve``: ``queue.fair_reserve`` (None: the default)."""
    feats = [
        dataclasses.replace(f, client_key=t) for f, t in zip(virtual.features_for(reqs), tenants, strict=True)
    ]
    result = virtual.replay(
        reqs,
        feats,
        PolicyName.KVGATE,
        backends,
        get_profile(profile),
        extra={"queue": queue_section(order, reserve)},
    )
    served = {r.rid: r.ttft for r in result.results}
    return row(label_of(order, reserve), tenants, served, result.rejected)


# The runs side by side: (label, both tenants or the quiet one alone, queue order, fair_reserve).
RUNS: tuple[tuple[str, bool, str, int | None], ...] = (
    ("alone", False, "fcfs", None),
    (label_of("fcfs", None), True, "fcfs", None),
    (label_of("fair", 0), True, "fair", 0),  # the order alone
    (label_of("fair", None), True, "fair", None),
)


def window(args: argparse.Namespace, start: float, fleet: Any, out: Path) -> list[dict[str, Any]]:
    """The runs side by side over the quiet tenant's window from ``start`` s (``RUNS``; with
    ``--quick`` the goal's two)."""
    reqs, tenants = two_tenants(
        args.trace,
        args.duration,
        args.flood,
        gap=args.gap,
        start=start,
        words=args.words,
        block=args.trace_block_tokens,
        model=args.model or SIM_MODEL,
        most=args.max_context,
        flood_output=args.flood_output,
        quiet_asks=args.quiet_asks,
    )
    rows = []
    for label, both, order, reserve in RUNS:
        if args.quick and label not in ("alone", label_of("fair", None)):
            continue
        picked = [i for i, t in enumerate(tenants) if both or t == QUIET]
        these = [dataclasses.replace(reqs[i], rid=n) for n, i in enumerate(picked)]
        whose = [tenants[i] for i in picked]
        if fleet:
            served, refused, failed, notes = fairness_live.replay(
                fleet, these, whose, queue_section(order, reserve), label, out
            )
            rows.append({**row(label, whose, served, refused, failed), "gateway": notes})
        else:
            rows.append({**run(these, whose, order, args.backends, args.profile, reserve), "order": label})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of the quiet tenant's window")
    p.add_argument("--flood", type=float, default=3.0, help="the flooding tenant's rate, x the quiet one's")
    p.add_argument(
        "--flood-output",
        type=float,
        default=1.0,
        help="the flooding tenant's answers, x their length in the trace (a flood of decodes)",
    )
    p.add_argument(
        "--quiet-asks",
        type=int,
        default=None,
        help="the max_tokens the quiet tenant's requests ask for; they write what the trace says "
        "(a client's generous limit; virtual time only)",
    )
    # One window of a trace is one sample of a noisy quantity (a p90 of a few hundred requests past
    # saturation): a change is judged over several.
    p.add_argument(
        "--start",
        type=float,
        nargs="+",
        default=[0.0],
        help="where the quiet tenant's window starts (s); several: each in turn, then the median and "
        "worst (one given again runs again: on a real fleet, how far runs of one window spread)",
    )
    p.add_argument("--gap", type=float, default=1200.0, help="the flood's window starts this much later (s)")
    p.add_argument("--quick", action="store_true", help="only alone and fair (the goal's two runs)")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--out", default="bench-results/fairness")
    add_real_args(p)  # through the whole gateway, each tenant under its own API key
    add_scale_args(p)
    args = p.parse_args(argv)
    if args.quiet_asks is not None and args.real_vllm:
        p.error("--quiet-asks: a real engine writes all it is asked for (ignore_eos); virtual time only")
    args.model, args.words = None, "filler"
    fit_to_real(args)  # the fleet's model and words with --real-vllm
    out = Path(args.out)
    with real_fleet(args, out) as fleet:
        windows = [(start, window(args, start, fleet, out)) for start in args.start]
    parts = [
        ("" if len(windows) == 1 else f"## The window from {start:g} s\n\n") + "\n".join(table(rows))
        for start, rows in windows
    ]
    if len(windows) > 1:
        parts.append("## Across the windows\n\n" + "\n".join(summary(windows)))
    text = "\n\n".join(parts) + "\n"
    print(text)
    head = report.header(["fairness", *(sys.argv[1:] if argv is None else argv)])
    report.write_json(
        out / "fairness.json",
        {"header": head, "windows": [{"start": s, "rows": rows} for s, rows in windows]},
    )
    (out / "report.md").write_text(f"# Two tenants, one flooding\n\n`{head['command']}`\n\n{text}")
    print(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
