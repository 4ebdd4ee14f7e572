"""kvgate bench: trace replay and side-by-side comparison of routing policies and peer routers."""
