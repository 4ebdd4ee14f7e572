"""The two-tenant benchmark's figures (``kvgate_bench.fairness``): a run's line per tenant, a
window's table against the quiet tenant's value alone, and the summary across windows."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate_bench import report

QUIET, FLOOD = "quiet", "flood"


def row(
    label: str, tenants: Sequence[str], served: Mapping[int, float], rejected: int, failed: int = 0
) -> dict[str, Any]:
    """A run's line: per tenant, how many were sent and served and the served ones' TTFTs;
    ``served``: each served request's TTFT by its index in ``tenants``."""
    out: dict[str, Any] = {"order": label, "rejected": rejected, "failed": failed}
    for tenant in sorted(set(tenants)):
        ttfts = sorted(t for i, t in served.items() if tenants[i] == tenant)
        out[tenant] = {
            "sent": sum(1 for t in tenants if t == tenant),
            "served": len(ttfts),
            "mean": statistics.fmean(ttfts) if ttfts else float("nan"),
            "p50": report.pct(ttfts, 0.5),
            "p90": report.pct(ttfts, 0.9),
            "ttfts": [round(t, 4) for t in ttfts],  # for the pooled figure (summary)
        }
    return out


def label_of(order: str, reserve: int | None) -> str:
    return order if reserve is None else f"{order}, reserve {reserve}"


def table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One window's runs, the quiet tenant's p90 against its value alone."""
    alone = rows[0][QUIET]
    lines = [
        "| run | quiet: served / sent | mean | p50 | p90 TTFT (x alone) | flood: served / sent | p90 "
        "| refused | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for line in rows:
        q = line[QUIET]
        f = line.get(FLOOD)
        flood = f"{f['served']} / {f['sent']} | {f['p90']:.3f} s" if f else "| "
        lines.append(
            f"| {line['order']} | {q['served']} / {q['sent']} | {q['mean']:.3f} s | {q['p50']:.3f} s | "
            f"{q['p90']:.3f} s ({q['p90'] / alone['p90']:.2f}x) | {flood} | {line['rejected']} | "
            f"{line['failed']} |"
        )
    for line in rows:
        if (g := line.get("gateway")) is not None:  # live runs: why the quiet tenant's time went
            lines.append(
                f"\n{line['order']}: the quiet tenant waited {g['quiet_wait_s']:.1f} s at the gateway in all "
                f"({g['quiet_held']:.0f} requests held, {g['quiet_past_share']:.0f} as past its share); "
                f"{g['fell_open']:.0f} requests fell open to Nginx's ring; the sidecar's loop ran over "
                f"50 ms late {g['loop_late']:.0f} times and waited {g['cpu_wait_s']:.1f} s for a core"
            )
    return lines


def summary(windows: Sequence[tuple[float, Sequence[Mapping[str, Any]]]]) -> list[str]:
    """Across windows, the goal's figure (the quiet tenant's p90 in the fair run against its value
    alone) per window, its median and its worst, with the flood's p90 beside it; and pooled: every
    alone run's TTFTs against every fair run's (runs alternate, alone then fair, so what drifts
    between them weighs on both sides alike, and each p90 is of several times the requests)."""
    label = label_of("fair", None)
    ratios: list[float] = []
    pooled: tuple[list[float], list[float]] = ([], [])
    lines = [
        "| window from | quiet p90 alone | fair | x alone | flood p90 | flood served / sent | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for start, rows in windows:
        alone, fair = rows[0][QUIET], next(r for r in rows if r["order"] == label)
        ratios.append(fair[QUIET]["p90"] / alone["p90"])
        pooled[0].extend(alone["ttfts"])
        pooled[1].extend(fair[QUIET]["ttfts"])
        f = fair[FLOOD]
        lines.append(
            f"| {start:g} s | {alone['p90']:.3f} s | {fair[QUIET]['p90']:.3f} s | {ratios[-1]:.2f}x "
            f"| {f['p90']:.3f} s | {f['served']} / {f['sent']} | {fair['rejected']} |"
        )
    alone_p90, fair_p90 = (report.pct(sorted(ttfts), 0.9) for ttfts in pooled)
    lines.append(
        f"\nquiet p90 x alone over {len(ratios)} windows: median {statistics.median(ratios):.2f}x, "
        f"worst {max(ratios):.2f}x; pooled {fair_p90 / alone_p90:.2f}x ({alone_p90:.3f} s alone, "
        f"{fair_p90:.3f} s fair, {len(pooled[0])} requests each)"
    )
    return lines
