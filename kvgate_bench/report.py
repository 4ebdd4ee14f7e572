"""Summaries and reports: per-target statistics (goodput at an SLO among them), Markdown + JSON;
the plots are ``kvgate_bench.plots``.

Over 300 lines: a sample, the objective it meets, the summary of many and the tables and files that
show them are one vocabulary every benchmark shares, read together."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvgate_bench.plots import plot_cdf, plot_sweep


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request as either mode measured it (seconds are simulated seconds)."""

    ttft: float
    itl: float | None
    e2e: float
    output_tokens: int
    ok: bool
    backend: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""  # why it failed, for the report (an HTTP status and the server's message)


@dataclass(frozen=True, slots=True)
class Slo:
    """A service-level objective a request meets or misses: its first token within ``ttft_s`` and a
    mean gap between later tokens within ``itl_s`` (a one-token answer has no gap). Defaults: an
    interactive chat's, 1 s to the first token and 100 ms per token after it (faster than a reader),
    as the goodput literature sets them for chat. Seconds are the report's (simulated ones in
    virtual and scaled runs)."""

    ttft_s: float = 1.0
    itl_s: float = 0.1

    def met(self, s: Sample) -> bool:
        return s.ok and s.ttft <= self.ttft_s and (s.itl is None or s.itl <= self.itl_s)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Slo:
        return cls(args.slo_ttft_ms / 1000.0, args.slo_itl_ms / 1000.0)


DEFAULT_SLO = Slo()


def http_error(status: int, message: str) -> str:
    """A failed request's ``Sample.error``: the status and the server's own message."""
    return f"HTTP {status}: {message}"[:200]


SHED = http_error(429, "")  # how a request the gateway refused starts its error


def add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=DEFAULT_SLO.ttft_s * 1000,
        help="goodput: a request meets its objective with its first token within this (default 1000)",
    )
    p.add_argument(
        "--slo-itl-ms",
        type=float,
        default=DEFAULT_SLO.itl_s * 1000,
        help="goodput: ... and a mean gap between later tokens within this (default 100)",
    )


@dataclass(frozen=True, slots=True)
class Summary:
    target: str
    requests: int
    errors: int
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float
    e2e_p99: float
    throughput_tok_s: float
    hit_rate: float
    imbalance: float
    ideal_hit_rate: float | None = None
    zero_queue_ttft: float | None = None
    fleet_ttft: float | None = None  # kvgate_bench.bounds.fleet_ttft's mean at this load
    gateway_ttft_p50: float | None = None  # kvgate's own measure (first body byte at Nginx), live runs
    gateway_ttft_mean: float | None = None
    # Requests per second that met the SLO, the share of all requests that did (shed and failed ones
    # miss it), and the share the gateway shed (refused with 429).
    goodput_rps: float = float("nan")
    slo_met: float = float("nan")
    shed_rate: float = 0.0
    speedup: float = 1.0
    valid: bool = True
    note: str = ""
    # Live kvgate runs: first bytes the gateway predicted, and its error's p50 / p90 (its histogram).
    predicted: int = 0
    prediction_p50: float | None = None
    prediction_p90: float | None = None


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(
    target: str,
    samples: Sequence[Sample],
    makespan: float,
    hit_rate: float,
    prefill_per_backend: Mapping[str, float],
    slo: Slo = DEFAULT_SLO,
    shed_apart: int = 0,
    **extra: Any,
) -> Summary:
    """``shed_apart``: requests the gateway refused that are not among ``samples`` (virtual runs)."""
    ok = [s for s in samples if s.ok]
    total = len(samples) + shed_apart
    shed = shed_apart + sum(1 for s in samples if s.error.startswith(SHED))
    good = sum(1 for s in samples if slo.met(s))
    ttfts = [s.ttft for s in ok]
    itls = [s.itl for s in ok if s.itl is not None]
    loads = [v for v in prefill_per_backend.values()]
    imbalance = (
        max(loads) / statistics.fmean(loads) if loads and statistics.fmean(loads) > 0 else float("nan")
    )
    return Summary(
        target=target,
        requests=len(samples),
        errors=len(samples) - len(ok),
        ttft_mean=statistics.fmean(ttfts) if ttfts else float("nan"),
        ttft_p50=pct(ttfts, 0.5),
        ttft_p90=pct(ttfts, 0.9),
        ttft_p99=pct(ttfts, 0.99),
        itl_mean=statistics.fmean(itls) if itls else float("nan"),
        e2e_p99=pct([s.e2e for s in ok], 0.99),
        throughput_tok_s=sum(s.output_tokens for s in ok) / makespan if makespan > 0 else float("nan"),
        hit_rate=hit_rate,
        imbalance=imbalance,
        goodput_rps=good / makespan if makespan > 0 else float("nan"),
        slo_met=good / total if total else float("nan"),
        shed_rate=shed / total if total else 0.0,
        **extra,
    )


def write_json(path: Path, data: Any) -> None:
    """Write a benchmark's figures and say where they went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


def header(argv: Sequence[str]) -> dict[str, Any]:
    def version(cmd: list[str]) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "unavailable"

    from kvgate_bench import __version__

    return {
        "command": " ".join(["kvgate-bench", *argv]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "kvgate": __version__,
        "python": sys.version.split()[0],
        "nginx": version(["nginx", "-v"]),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, "
        f"{_cpu_count()} CPUs, {platform.processor() or 'cpu'}",
    }


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 0


COLUMNS = [
    ("target", "target", "{}"),
    ("speedup", "speed-up", "{:g}"),
    ("requests", "requests", "{}"),
    ("errors", "errors", "{}"),
    ("ttft_mean", "TTFT mean s", "{:.3f}"),
    ("ttft_p50", "p50", "{:.3f}"),
    ("ttft_p90", "p90", "{:.3f}"),
    ("ttft_p99", "p99", "{:.3f}"),
    ("gateway_ttft_p50", "gateway-measured TTFT p50", "{:.3f}"),
    ("itl_mean", "ITL mean ms", "{:.1f}"),
    ("e2e_p99", "e2e p99 s", "{:.2f}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("goodput_rps", "goodput req/s", "{:.2f}"),
    ("slo_met", "SLO met", "{:.1%}"),
    ("shed_rate", "shed", "{:.1%}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("ideal_hit_rate", "pooled ideal", "{:.1%}"),
    ("imbalance", "imbalance", "{:.2f}"),
    ("zero_queue_ttft", "zero-queue TTFT s", "{:.3f}"),
    ("fleet_ttft", "fleet-bound TTFT s", "{:.3f}"),
]


def markdown_table(rows: Sequence[Summary]) -> str:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = getattr(r, key)
            if key == "itl_mean" and v == v:
                v = v * 1000
            cells.append("n/a" if v is None or (isinstance(v, float) and v != v) else fmt.format(v))
        mark = "" if r.valid else " (INVALID: " + r.note + ")"
        cells[0] += mark
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(rows: Sequence[Summary]) -> str:
    """Repeated runs of one target at one speed-up, as mean (min to max) of each run's figure."""
    groups: dict[tuple[str, float], list[Summary]] = {}
    for r in rows:
        groups.setdefault((r.target, r.speedup), []).append(r)

    def cell(values: list[float], fmt: str) -> str:
        return (
            f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))} to {fmt.format(max(values))})"
        )

    lines = [
        "| target | speed-up | runs (valid) | mean TTFT s | p90 TTFT s | hit rate |",
        "|---|---|---|---|---|---|",
    ]
    for (target, speedup), group in groups.items():
        lines.append(
            f"| {target} | {speedup:g} | {len(group)} ({sum(g.valid for g in group)}) | "
            f"{cell([g.ttft_mean for g in group], '{:.3f}')} | "
            f"{cell([g.ttft_p90 for g in group], '{:.3f}')} | "
            f"{cell([g.hit_rate * 100 for g in group], '{:.1f}')} % |"
        )
    return "\n".join(lines)


def write(
    out_dir: Path,
    title: str,
    head: Mapping[str, Any],
    rows: Sequence[Summary],
    cdfs: Mapping[str, Sequence[float]] | None = None,
    notes: Sequence[str] = (),
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(
        json.dumps({"header": head, "rows": [asdict(r) for r in rows]}, indent=1, allow_nan=True)
    )
    md = [
        f"# {title}",
        "",
        *(f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in head.items()),
        "",
        markdown_table(rows),
        "",
    ]
    if len({(r.target, r.speedup) for r in rows}) < len(rows):
        md += ["Repeated runs: mean of the runs (lowest to highest run).", "", spread_table(rows), ""]
    md += list(notes)
    if cdfs:
        plot_cdf(out_dir / "ttft_cdf.png", cdfs, title)
        md += ["", "![TTFT CDF](ttft_cdf.png)"]
    sweep: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        sweep.setdefault(r.target, []).append((r.speedup, r.ttft_mean))
    if any(len(v) > 1 for v in sweep.values()):
        plot_sweep(out_dir / "ttft_vs_rate.png", sweep, title)
        md += ["", "![TTFT versus arrival rate](ttft_vs_rate.png)"]
    path = out_dir / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


class Progress:
    """A one-line progress bar on stderr when it is a terminal; in a log file, only the end."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.tty:
            if done >= total:
                sys.stderr.write(f"{self.label}: {done}/{total}\n")
            return
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{self.label:40} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        sys.stderr.flush()
        if done >= total:
            sys.stderr.write("\n")
