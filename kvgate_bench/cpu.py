"""Who had the CPU during a run on a shared host.

A real vLLM server on CPU keeps its cores looking busy whether or not it has work: its engine spins
(yielding) on the shared-memory queue to its worker for a second after each message. So "every core
busy" says little; what says whether a run measured the servers or the contention around them is the
CPU the router under test and the load generator took. ``GroupCpu`` counts the CPU seconds of
process groups (each supervised child leads one, with whatever it forks); ``MachineLoad`` samples
the share of all cores busy, reported beside it. Both read ``/proc``.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

SAMPLE_S = 0.25
TICKS = os.sysconf("SC_CLK_TCK")


def _busy_idle() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, idle


def group_cpu_seconds(pgids: Iterable[int]) -> float:
    """CPU seconds (user + system) so far of every live process in the process groups ``pgids``."""
    wanted = set(pgids)
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) in wanted:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


def self_cpu_seconds() -> float:
    """This process's CPU seconds (the load generator's, its threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class GroupCpu:
    """``with GroupCpu(pgids) as cpu: ...`` then ``cpu.cores``: the average number of cores the groups
    used over the block (CPU seconds / wall seconds). Processes that exit within it are not counted."""

    def __init__(self, pgids: Iterable[int]) -> None:
        self.pgids = list(pgids)
        self.cores = 0.0

    def __enter__(self) -> GroupCpu:
        self._t0, self._c0 = time.monotonic(), group_cpu_seconds(self.pgids)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        wall = max(time.monotonic() - self._t0, 1e-9)
        self.cores = (group_cpu_seconds(self.pgids) - self._c0) / wall


class MachineLoad:
    """``with MachineLoad() as load: ...`` then ``load.busy_mean``: the average share of all cores busy
    (sampled from /proc/stat a few times a second)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="machine-load")

    def _run(self) -> None:
        last = _busy_idle()
        while not self._stop.wait(SAMPLE_S):
            now = _busy_idle()
            busy, idle = now[0] - last[0], now[1] - last[1]
            if busy + idle > 0:
                self.samples.append(busy / (busy + idle))
            last = now

    def __enter__(self) -> MachineLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(2)

    @property
    def busy_mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0


def wait_quiet(busy_below: float = 0.4, seconds: float = 2.0, timeout: float = 60.0) -> None:
    """Until the machine has been mostly idle for ``seconds`` (the last run's work has drained)."""
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    last = _busy_idle()
    while time.monotonic() < deadline:
        time.sleep(SAMPLE_S)
        now = _busy_idle()
        busy, idle = now[0] - last[0], now[1] - last[1]
        last = now
        if busy + idle and busy / (busy + idle) >= busy_below:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= seconds:
            return


MAX_TARGET_CORES = 0.5  # a router (with its sidecar, Redis) that took more held the servers up


class RunCpu:
    """The CPU around one run on a real fleet: the router under test's process groups, this process
    (the load generator), the machine as a whole."""

    def __init__(self, target_pgids: Iterable[int]) -> None:
        self._target = GroupCpu(target_pgids)
        self._machine = MachineLoad()
        self.target_cores = self.client_cores = self.busy_mean = 0.0

    def __enter__(self) -> RunCpu:
        self._t0, self._c0 = time.monotonic(), self_cpu_seconds()
        self._target.__enter__()
        self._machine.__enter__()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._machine.__exit__(*exc)
        self._target.__exit__(*exc)
        self.client_cores = (self_cpu_seconds() - self._c0) / max(time.monotonic() - self._t0, 1e-9)
        self.target_cores, self.busy_mean = self._target.cores, self._machine.busy_mean

    def problem(self) -> str | None:
        if self.target_cores > MAX_TARGET_CORES:
            return f"the router took {self.target_cores:.2f} cores (servers held up)"
        return None

    def describe(self) -> str:
        return (
            f"router {self.target_cores:.2f} cores, load generator {self.client_cores:.2f}, "
            f"machine busy {self.busy_mean:.0%}"
        )
