"""One way to start kvgate's processes: ``kvgate up``, the tests and the benchmarks all launch here.

A ``Supervisor`` runs each process in the foreground in its own session, its output in
``<run_dir>/<name>.log``, and stops them in reverse order (then kills what lingers). A process is
ready when *it* owns the socket it was asked to open: the listening TCP port or unix socket is looked
up in ``/proc/net`` and its inode found among the process's (or its children's) open files, so a
foreign process already holding the port can never pass for ours. A child that exits first fails the
start with its exit code, not a timeout.

``launch_replica`` starts one gateway replica the same way everywhere: write the sidecar's YAML, start
the sidecar, wait until it answers with its own pid, then (optionally) render and start Nginx and wait
until its fail-open peer list has arrived from the sidecar.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.config import Config
from kvgate.nginx_conf import NginxSettings, find_nginx, render

READY_TIMEOUT_S = 20.0
POLL_S = 0.02


# -- ports ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """First of n consecutive free ports (vllm-sim --instances serves port..port+n-1)."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
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


def _family(pid: int) -> list[int]:
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
    for p in _family(pid):
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
            raise RuntimeError(f"process exited with {proc.returncode} before {what}")
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


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _bin(name: str) -> str:
    """A console script of this environment (next to the running interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
    if not found:
        raise FileNotFoundError(f"{name} not found; run `make setup`")
    return found


# -- supervision -----------------------------------------------------------------------------------
@dataclass
class Supervisor:
    run_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = self.run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def spawn(
        self, name: str, argv: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as ``name``; readiness is the caller's (``wait_listening``). Children run in
        the caller's working directory, so a relative path in a config means the same to all."""
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child process
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_redis(self, port: int, name: str = "redis") -> subprocess.Popen[bytes]:
        proc = self.spawn(
            name,
            [
                _bin("redis-server"),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.run_dir),
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
            ],
        )
        wait_listening(proc, port=port)
        return proc

    def start_sim(
        self, port: int, instances: int = 1, name: str = "sim", *extra: str
    ) -> subprocess.Popen[bytes]:
        proc = self.spawn(
            name, [_bin("vllm-sim"), "--port", str(port), "--instances", str(instances), *extra]
        )
        for i in range(instances):
            wait_listening(proc, port=port + i)
        return proc

    def write_config(self, data: Mapping[str, Any], name: str) -> Path:
        path = self.run_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(dict(data), sort_keys=False))
        return path

    def start_sidecar(
        self,
        config_path: Path,
        socket_path: Path,
        name: str = "sidecar",
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        proc = self.spawn(name, [_bin("kvgate"), "sidecar", "--config", str(config_path)], env)
        wait_listening(proc, unix=socket_path)
        return proc

    def start_nginx(self, settings: NginxSettings, port: int, name: str = "nginx") -> subprocess.Popen[bytes]:
        conf_dir = self.run_dir / f"{name}-conf"
        nginx = find_nginx()
        main = render(settings, conf_dir, standalone=True, nginx=nginx)
        proc = self.spawn(
            name,
            [
                nginx,
                "-p",
                str(self.run_dir),
                "-c",
                str(main),
                "-e",
                str(Path(settings.run_dir).resolve() / "nginx-error.log"),
            ],
        )
        wait_listening(proc, port=port)
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        # Nginx's master stops its workers on SIGTERM (fast) and SIGQUIT (graceful).
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def kill(self, name: str) -> None:
        """Abrupt death (SIGKILL), for failure tests."""
        self.stop(name, signal.SIGKILL)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self.procs.items()}


# -- one gateway replica ---------------------------------------------------------------------------
@dataclass
class Replica:
    """A sidecar (and optionally Nginx in front of it) started by ``launch_replica``."""

    sup: Supervisor
    name: str
    config_path: Path
    socket: Path
    http_port: int
    env: Mapping[str, str] = field(default_factory=dict)
    nginx: NginxSettings | None = None
    port: int | None = None  # the gateway's port when Nginx runs

    @property
    def sidecar_name(self) -> str:
        return f"{self.name}-sidecar"

    @property
    def nginx_name(self) -> str:
        return f"{self.name}-nginx"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        assert self.port is not None, "this replica runs no Nginx"
        return f"http://127.0.0.1:{self.port}"

    def start_sidecar(self) -> None:
        proc = self.sup.start_sidecar(self.config_path, self.socket, self.sidecar_name, self.env)
        wait_ready(
            proc, "its /healthz answers", lambda: get_json(self.http + "/healthz").get("pid") == proc.pid
        )

    def health(self) -> Any:
        return get_json(self.url + "/kvgate/health")

    def start_nginx(self, wait_peers: bool = True) -> None:
        """Start Nginx; ready when its own master answers ``/kvgate/health`` and, with ``wait_peers``,
        when the fail-open peer list has arrived from the sidecar."""
        assert self.nginx is not None and self.port is not None
        proc = self.sup.start_nginx(self.nginx, self.port, self.nginx_name)
        wait_ready(proc, "its /kvgate/health answers", lambda: self.health()["master_pid"] == proc.pid)
        if wait_peers:
            wait_ready(proc, "its fail-open peer list arrived", lambda: self.health()["fail_open_peers"] > 0)


def launch_replica(
    sup: Supervisor,
    name: str,
    config: Path | Mapping[str, Any],
    nginx: NginxSettings | None = None,
    env: Mapping[str, str] | None = None,
    wait_peers: bool = True,
) -> Replica:
    """Start a sidecar on ``config`` (a config file, or a mapping written to ``<name>-sidecar.yaml``),
    and Nginx in front of it when ``nginx`` is given (its ``listen`` must be host:port)."""
    if isinstance(config, Path):
        config_path, parsed = config, Config.from_file(config, {**os.environ, **(env or {})})
    else:
        config_path, parsed = (
            sup.write_config(config, f"{name}-sidecar"),
            Config.from_mapping(config, env or {}),
        )
    replica = Replica(
        sup,
        name,
        config_path,
        Path(parsed.listen.socket),
        parsed.listen.http_port,
        dict(env or {}),
        nginx,
        None if nginx is None else int(nginx.listen.rsplit(":", 1)[1]),
    )
    replica.start_sidecar()
    if nginx is not None:
        replica.start_nginx(wait_peers)
    return replica
