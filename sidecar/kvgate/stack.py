"""Starts and stops kvgate's processes: redis-server, simulated backends, the sidecar and Nginx.

``kvgate up`` uses it for the demo stack; the end-to-end tests use it to start their own stacks on free
ports in temporary directories. Each process runs in the foreground under this supervisor, its output
in ``<run_dir>/<name>.log``; ``stop`` terminates them in reverse order, then kills what lingers.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.nginx_conf import NginxSettings, find_nginx, render

READY_TIMEOUT_S = 20.0


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


def wait_tcp(
    port: int, timeout: float = READY_TIMEOUT_S, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f}s")


def wait_unix(
    path: Path, timeout: float = READY_TIMEOUT_S, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {path} opened")
        if path.exists():
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(0.2)
                    s.connect(str(path))
                    return
            except OSError:
                pass
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {path} after {timeout:.0f}s")


def _bin(name: str) -> str:
    """A console script of this environment (next to the running interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
    if not found:
        raise FileNotFoundError(f"{name} not found; run `make setup`")
    return found


@dataclass
class Stack:
    run_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = self.run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child process
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.run_dir,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_redis(self, port: int, name: str = "redis") -> subprocess.Popen[bytes]:
        proc = self._spawn(
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
        wait_tcp(port, proc=proc)
        return proc

    def start_sim(
        self, port: int, instances: int = 1, name: str = "sim", *extra: str
    ) -> subprocess.Popen[bytes]:
        proc = self._spawn(
            name, [_bin("vllm-sim"), "--port", str(port), "--instances", str(instances), *extra]
        )
        for i in range(instances):
            wait_tcp(port + i, proc=proc)
        return proc

    def write_sidecar_config(self, data: dict[str, Any], name: str = "sidecar") -> Path:
        path = self.run_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    def start_sidecar(
        self, config_path: Path, socket_path: Path, name: str = "sidecar", env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        proc = self._spawn(name, [_bin("kvgate"), "sidecar", "--config", str(config_path)], env)
        wait_unix(socket_path, proc=proc)
        return proc

    def start_nginx(self, settings: NginxSettings, port: int, name: str = "nginx") -> subprocess.Popen[bytes]:
        conf_dir = self.run_dir / f"{name}-conf"
        nginx = find_nginx()
        main = render(settings, conf_dir, standalone=True, nginx=nginx)
        proc = self._spawn(
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
        wait_tcp(port, proc=proc)
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
