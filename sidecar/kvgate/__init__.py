"""kvgate: the routing sidecar and the command-line entry point."""

from __future__ import annotations


def version(distribution: str = "kvgate") -> str:
    """The installed release (kvgate, the simulator and the benchmark ship as one distribution)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(distribution)
    except PackageNotFoundError:  # run from a checkout without installing
        return "unknown"
