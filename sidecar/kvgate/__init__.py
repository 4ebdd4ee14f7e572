"""kvgate: the routing sidecar and the command-line entry point."""
