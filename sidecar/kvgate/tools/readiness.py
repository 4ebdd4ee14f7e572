"""Free ports, and when a started process is ready: it owns the socket it was asked to open (the
listening TCP port or unix socket looked up in /proc/net and its inode found among the process's,
or its children's, open files), so a foreign process already holding the port never passes for
ours; a child that exits first fails the wait with its exit code and last log lines."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 20.0
POLL_S = 0.02
LOGS: dict[int, Path] = {}  # pid -> the log file a Supervisor gave it, for failure messages


# -- ports ------------------------------------------------------------------------------------------
# Ports are drawn below the kernel's ephemeral range: a port the kernel handed out (bind to 0) is
# the next one it gives an outgoing connection too, and any client connection made between our
# choice and the server's bind() takes it ("Address already in use"). Ports handed out by this
# process are not handed out again.
_FLOOR = 10000
_GIVEN: set[int] = set()


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    return free_ports(1)


def free_ports(n: int) -> int:
    """First of n consecutive free ports (vllm-sim --instances serves port..port+n-1), outside
    the ephemeral range and not given out before by this process."""
    top = max(_ephemeral_low(), _FLOOR + 1000) - n
    for _ in range(500):
        base = random.randrange(_FLOOR, top)
        run = range(base, base + n)
        if any(p in _GIVEN for p in run) or not all(_bindable(p) for p in run):
            continue
        _GIVEN.update(run)
        return base
    raise RuntimeError("no run of free ports found")


# -- readiness: the socket belongs to the process we started -------------------------------------
def _tcp_listen_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in lines:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def _unix_listen_inodes(path: Path) -> set[str]:
    wanted = str(path)
    inodes: set[str] = set()
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return inodes
    for row in lines:
        cols = row.split()
        # Flags 00010000 is __SO_ACCEPTCON: a listening socket.
        if len(cols) >= 8 and cols[-1] == wanted and cols[3] == "00010000":
            inodes.add(cols[6])
    return inodes


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def owns_socket(pid: int, inodes: set[str]) -> bool:
    if not inodes:
        return False
    targets = {f"socket:[{i}]" for i in inodes}
    for p in process_tree(pid):
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    return True
            except OSError:
                continue
    return False


def last_words(pid: int, lines: int = 3) -> str:
    """The end of a process's log, so a failure to start says why (port in use, bad flag) on the
    terminal and not only in a file."""
    path = LOGS.get(pid)
    try:
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:] if path else []
    except OSError:
        tail = []
    return (": " + " | ".join(line.strip() for line in tail)) if tail else ""


def wait_ready(
    proc: subprocess.Popen[bytes],
    what: str,
    check: Callable[[], bool],
    timeout: float = READY_TIMEOUT_S,
) -> None:
    """Poll ``check`` until it holds; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {what}{last_words(proc.pid)}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not after {timeout:.0f}s")


def wait_listening(
    proc: subprocess.Popen[bytes],
    port: int | None = None,
    unix: Path | None = None,
    timeout: float = READY_TIMEOUT_S,
) -> None:
    """Until ``proc`` itself listens on ``port`` (TCP, any address) or on the unix socket ``unix``."""
    if port is not None:
        wait_ready(
            proc,
            f"it listens on port {port}",
            lambda: owns_socket(proc.pid, _tcp_listen_inodes(port)),
            timeout,
        )
    if unix is not None:
        path = unix.resolve()
        wait_ready(
            proc, f"it listens on {path}", lambda: owns_socket(proc.pid, _unix_listen_inodes(path)), timeout
        )


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read, from its creation on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())
