"""One way to start kvgate's processes: ``kvgate up``, the tests and the benchmarks all launch here.

A ``Supervisor`` runs each process in the foreground in its own session, its output in
``<run_dir>/<name>.log``, and stops them in reverse order (then kills what lingers). A process is
ready when *it* owns the socket it was asked to open (``kvgate.tools.readiness``). ``supervise``
restarts a child that died, with exponential backoff, the way a supervisor of a gateway must: the
rest keeps serving meanwhile (Nginx falls open while its sidecar is away; the sidecar routes from
memory while Redis is).

``launch_replica`` starts one gateway replica the same way everywhere: write the sidecar's YAML, start
the sidecar, wait until it answers with its own pid, then (optionally) render and start Nginx and wait
until its fail-open peer list has arrived from the sidecar.

Over 300 lines: the supervisor and the replica launch are one lifecycle (what starts a replica is
what restarts and stops it), read together.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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
from kvgate.nginx_conf import NginxSettings, find_nginx, render, worker_identity
from kvgate.tools.readiness import (
    LOGS,
    get_json,
    wait_listening,
    wait_ready,
    write_private,
)


def executable(name: str) -> str:
    """A console script of this environment (next to the running interpreter), else from PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
    if not found:
        raise FileNotFoundError(f"{name} not found; run `make setup`")
    return found


# -- supervision -----------------------------------------------------------------------------------
Ready = Callable[[subprocess.Popen[bytes]], None]
RESTART_FIRST_S = 0.5  # first restart delay; doubles with each restart in a row
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0  # a child up this long starts its backoff over


def prioritise(pid: int, nice: int) -> None:
    """Run the process group led by ``pid`` (a child started in a session of its own, with whatever
    it forks later: Nginx's workers) at ``nice``. Where the kernel schedules by autogroup (one per
    session), a process's nice value only weighs against its own session, so the session's
    autogroup gets the value too. A value the user may not set (negative, without CAP_SYS_NICE) is
    a warning: the stack runs as it would without it."""
    try:
        os.setpriority(os.PRIO_PGRP, pid, nice)
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(nice))
    except OSError as exc:  # not permitted, or the child is gone already
        print(f"kvgate: could not run pid {pid} at nice {nice} ({exc}); it runs as started", file=sys.stderr)


@dataclass
class _Child:
    argv: list[str]
    env: Mapping[str, str] | None
    ready: Ready | None
    started: float = 0.0
    restarts: int = 0  # in a row
    died: float | None = None


@dataclass
class Supervisor:
    run_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _children: dict[str, _Child] = field(default_factory=dict)
    sidecar_args: tuple[str, ...] = ()  # appended to every `kvgate sidecar` it starts (log options)
    nice: dict[str, int] = field(default_factory=dict)  # children started at a nice value (prioritise)

    def __post_init__(self) -> None:
        self.run_dir = self.run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def spawn(
        self, name: str, argv: list[str], env: Mapping[str, str] | None = None, ready: Ready | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as ``name`` and wait until ``ready(proc)`` returns (it raises on failure).
        Children run in the caller's working directory, so a relative path in a config means the same
        to all. ``supervise`` restarts it the same way if it dies."""
        proc = self._start(name, argv, env)
        self._children[name] = _Child(argv, env, ready, time.monotonic())
        if ready is not None:
            ready(proc)
        return proc

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart children that died, each after its backoff; returns what happened, for the log."""
        now = time.monotonic() if now is None else now
        events = []
        for name, child in self._children.items():
            proc = self.procs.get(name)
            if proc is None:
                continue  # stopped on purpose
            if proc.poll() is None:
                if child.restarts and now - child.started > RESTART_RESET_S:
                    child.restarts = 0
                continue
            if child.died is None:
                child.died = now
                delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2**child.restarts)
                events.append(f"{name} exited with {proc.returncode}; restarting in {delay:g}s")
            if now - child.died < min(RESTART_MAX_S, RESTART_FIRST_S * 2**child.restarts):
                continue
            try:
                new = self._start(name, child.argv, child.env)
                if child.ready is not None:
                    child.ready(new)
            except (OSError, RuntimeError, TimeoutError) as exc:
                events.append(f"{name} failed to restart: {exc}")
                child.restarts += 1
                child.died = now
                continue
            child.restarts += 1
            child.started, child.died = now, None
            events.append(f"{name} restarted (pid {new.pid})")
        return events

    def _start(self, name: str, argv: list[str], env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
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
        if name in self.nice:
            prioritise(proc.pid, self.nice[name])
        LOGS[proc.pid] = self.run_dir / f"{name}.log"
        self.procs[name] = proc
        return proc

    def start_redis(self, port: int, name: str = "redis", *extra: str) -> subprocess.Popen[bytes]:
        """redis-server on 127.0.0.1:``port`` (``extra``: more of its options, e.g. --requirepass)."""
        return self.spawn(
            name,
            [
                executable("redis-server"),
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
                *extra,
            ],
            ready=lambda p: wait_listening(p, port=port),
        )

    def start_sim(
        self, port: int, instances: int = 1, name: str = "sim", *extra: str
    ) -> subprocess.Popen[bytes]:
        proc = self.spawn(
            name, [executable("vllm-sim"), "--port", str(port), "--instances", str(instances), *extra]
        )
        for i in range(instances):
            wait_listening(proc, port=port + i)
        return proc

    def write_config(self, data: Mapping[str, Any], name: str) -> Path:
        """``<run_dir>/<name>.yaml``, readable by this user only (it may hold the admin token)."""
        path = self.run_dir / f"{name}.yaml"
        write_private(path, yaml.safe_dump(dict(data), sort_keys=False))
        return path

    def start_sidecar(
        self,
        config_path: Path,
        socket_path: Path,
        name: str = "sidecar",
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        argv = [executable("kvgate"), "sidecar", "--config", str(config_path), *self.sidecar_args]
        return self.spawn(name, argv, env, ready=lambda p: wait_listening(p, unix=socket_path))

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
        """Everything, in reverse start order (Nginx before its sidecar), at once: SIGINT, which a
        sidecar takes as "stop now" (SIGTERM makes it serve until its Nginx has gone)."""
        for name in reversed(list(self.procs)):
            self.stop(name, signal.SIGINT)

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
        """Nginx's /kvgate/health (answered 503 while it refuses requests: it is up all the same)."""
        try:
            return get_json(self.url + "/kvgate/health")
        except urllib.error.HTTPError as exc:
            with exc:
                return json.loads(exc.read())

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
    if nginx is not None and os.geteuid() == 0 and parsed.listen.socket_group is None:
        # Nginx started as root runs its workers as another user: the socket is theirs by its group.
        env = {"KVGATE_LISTEN_SOCKET_GROUP": worker_identity(nginx.worker_user)[1], **(env or {})}
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
