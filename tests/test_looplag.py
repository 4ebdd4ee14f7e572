"""The sidecar's own view of whether it keeps up: event-loop lag and time spent waiting for a core."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvgate.looplag import CpuWaitCollector, SchedStat, lag_loop, parse_schedstat, read_schedstat
from prometheus_client import CollectorRegistry, Histogram


def observations_over(h: Histogram, registry: CollectorRegistry, bound: float) -> float:
    name = "t_lag_seconds"
    total = registry.get_sample_value(f"{name}_count") or 0.0
    under = registry.get_sample_value(f"{name}_bucket", {"le": str(bound)}) or 0.0
    return total - under


def test_a_held_loop_is_seen_as_lag() -> None:
    registry = CollectorRegistry()
    lag = Histogram("t_lag_seconds", "lag", buckets=(0.01, 0.1, 0.2, 1.0), registry=registry)

    async def run() -> None:
        task = asyncio.create_task(lag_loop(lag, interval_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.25)  # noqa: ASYNC251 - a callback holding the loop: the lag being provoked
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(run())
    assert registry.get_sample_value("t_lag_seconds_count") >= 3
    assert observations_over(lag, registry, 0.2) == 1  # the one wakeup the held loop delayed


def test_schedstat_is_read_as_seconds_waited_and_its_absence_yields_no_metric(tmp_path: Path) -> None:
    assert parse_schedstat("123456000 2500000000 77\n") == SchedStat(0.123456, 2.5, 77)
    stat = tmp_path / "schedstat"
    stat.write_text("1000 750000000 3\n")
    registry = CollectorRegistry()
    registry.register(CpuWaitCollector(str(stat)))
    assert registry.get_sample_value("kvgate_cpu_wait_seconds_total") == 0.75
    missing = CollectorRegistry()
    missing.register(CpuWaitCollector(str(tmp_path / "absent")))
    assert missing.get_sample_value("kvgate_cpu_wait_seconds_total") is None
    assert read_schedstat(str(tmp_path / "absent")) is None


def test_cpu_wait_grows_while_another_process_holds_the_only_core() -> None:
    # A child pinned to one core with three spinners pinned to the same core: the kernel shares the
    # core four ways, so while the child spins for 0.2 s of its own CPU it waits about 0.6 s for it.
    # Over 0.35 s tells the wait from the run time (the field beside it in schedstat: 0.2 s here).
    script = textwrap.dedent(
        """
        import os, subprocess, sys, time
        from kvgate.looplag import read_schedstat
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        spin = "import os, time\\nos.sched_setaffinity(0, {%d})\\n" % core
        spin += "t = time.time() + 5\\nwhile time.time() < t: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
        try:
            time.sleep(0.3)  # the spinners start and take their share
            before, cpu0 = read_schedstat().wait_s, time.process_time()
            while time.process_time() - cpu0 < 0.2:
                pass
            print(read_schedstat().wait_s - before)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert float(out.stdout) >= 0.35, out
