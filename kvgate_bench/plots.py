"""The reports' PNG plots: TTFT CDFs per target, and TTFT against arrival rate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_cdf(path: Path, cdfs: Mapping[str, Sequence[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, values in cdfs.items():
        s = sorted(values)
        if s:
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF — {title}")
    ax.grid(True, alpha=0.3)
    if any(cdfs.values()):  # a run whose every request failed has no curve to name
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, sweep: Mapping[str, Sequence[tuple[float, float]]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in sweep.items():
        pts = sorted(points)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("arrival speed-up (x trace rate)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(f"Mean TTFT versus arrival rate — {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
