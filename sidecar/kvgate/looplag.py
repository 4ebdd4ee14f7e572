"""Whether the sidecar keeps up: how long a decision's line can wait before the sidecar reads it.

The decision's own clock (``kvgate_decision_seconds``) starts when the line is read, so it cannot see
that wait; Nginx can (its decision histogram and fail-open counts) but not say why. Two measurements
say why:

* ``kvgate_event_loop_lag_seconds``: how late a timer due every ``LAG_INTERVAL_S`` runs. Whatever holds
  the loop that long (a long callback, a garbage collection, the process waiting for a core) holds
  every line that arrives meanwhile.
* ``kvgate_cpu_wait_seconds_total``: time the loop's thread was ready to run but waited for a core (the
  kernel's run-queue wait, ``/proc/self/schedstat``; Linux only, absent elsewhere). When decisions miss
  Nginx's budget while this climbs with the lag, the host is short of CPU for the gateway: the answer
  is cores or priority for the gateway's processes, not a longer budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LAG_INTERVAL_S = 0.025  # 40 wakeups a second: a stall of a fraction of the 50 ms budget is seen
SCHEDSTAT = "/proc/self/schedstat"  # the process's main thread: the one that runs the event loop


async def lag_loop(
    lag: Histogram, interval_s: float = LAG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
) -> None:
    """Observe, forever, how late a sleep of ``interval_s`` wakes up."""
    while True:
        due = clock() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, clock() - due))


class SchedStat(NamedTuple):
    """A thread's scheduling so far, as the kernel counts it."""

    run_s: float  # on a core
    wait_s: float  # ready to run, waiting for a core
    slices: int  # times put on a core


def parse_schedstat(text: str) -> SchedStat:
    """A schedstat line: "<run ns> <wait ns> <slices>"."""
    run_ns, wait_ns, slices = text.split()[:3]
    return SchedStat(int(run_ns) / 1e9, int(wait_ns) / 1e9, int(slices))


def read_schedstat(path: str = SCHEDSTAT) -> SchedStat | None:
    """``path``'s figures (``/proc/<pid>/schedstat``: that process's main thread), or None where the
    kernel does not say."""
    try:
        # A read of procfs: the kernel formats a few numbers, nothing waits on a disk or a peer.
        with open(path, encoding="ascii") as f:
            return parse_schedstat(f.read())
    except (OSError, ValueError):
        return None


class CpuWaitCollector(Collector):
    """``kvgate_cpu_wait_seconds_total``, read when /metrics is: nothing runs between scrapes."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily]:
        stat = read_schedstat(self.path)
        if stat is None:
            return
        family = CounterMetricFamily(
            "kvgate_cpu_wait_seconds",
            "Time the sidecar's event-loop thread was ready to run but waited for a core.",
        )
        family.add_metric([], stat.wait_s)
        yield family
