"""kvgate-bench: trace replay and side-by-side comparison of routing policies and peer routers."""

__version__ = "0.1.0"
