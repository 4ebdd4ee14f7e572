"""What each real vLLM server gets from the host it runs on: ports below the ephemeral range, a core
of its own, a directory for its sockets. Per process, so that every fleet a test or benchmark
starts draws from the same record."""

from __future__ import annotations

import atexit
import itertools
import os
import random
import shutil
import socket
import tempfile
from pathlib import Path

from kvgate.tools.readiness import free_port

_HANDED_OUT: set[int] = set()  # ports service_port gave this process: chosen, perhaps not yet bound


def service_port() -> int:
    """A free port below the kernel's ephemeral range, never one it gave before. A server binds its
    ports a minute after they were chosen (its side channel later still), and meanwhile every process
    that binds port 0 (vLLM's own internal sockets among them) draws from the ephemeral range: a port
    chosen there can be gone by then, and a NIXL handshake once timed out talking to the wrong
    listener. A port handed out but not yet bound looks free, hence the record."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(10_000, max(10_001, low - 1))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    return free_port()


# Cores handed to servers in the order they start, across every fleet of this process (a test that
# starts a second fleet beside the first puts its servers on the next cores, not the same ones).
_NEXT_CORE = itertools.count()


def next_core() -> int | None:
    """The core the next pinned server runs on, or None where pinning means nothing (one core) or
    ``taskset`` is missing."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return None
    return cores[next(_NEXT_CORE) % len(cores)]


def on_core(argv: list[str], core: int | None) -> list[str]:
    """``argv`` run with its processes (and all they start) bound to ``core``; as is for None."""
    taskset = shutil.which("taskset")
    return argv if core is None or taskset is None else [taskset, "--cpu-list", str(core), *argv]


def ipc_dir() -> str:
    """A directory for the servers' ZMQ sockets, removed when this process exits. vLLM makes them
    in the system's temporary directory and leaves them there when it is killed (thousands over the
    real suite's runs); a short path, since a Unix socket's name is limited to 107 bytes."""
    path = tempfile.mkdtemp(prefix="kvgate-vllm-")
    atexit.register(shutil.rmtree, path, True)
    return path
