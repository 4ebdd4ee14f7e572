"""Shared fixtures: real processes (redis-server, vllm-sim, sidecar, nginx) on free ports in temp dirs."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

MODEL = "sim-model"


def http_json(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            if "json" not in resp.headers.get("Content-Type", ""):
                return resp.status, raw.decode(errors="replace")
            return resp.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        exc.close()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass  # not listening yet: keep waiting
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")


@pytest.fixture(scope="session", autouse=True)
def _traversable_temp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Started as root, Nginx's workers run as nobody and must reach sockets in the tests' temporary
    directories, which pytest creates 0700: let others through them (not list them)."""
    base = tmp_path_factory.getbasetemp()
    for d in (base.parent, base):
        d.chmod(d.stat().st_mode | 0o011)
    original = tmp_path_factory.mktemp

    def mktemp(basename: str, numbered: bool = True) -> Path:
        path = original(basename, numbered)
        path.chmod(path.stat().st_mode | 0o011)
        return path

    tmp_path_factory.mktemp = mktemp  # type: ignore[method-assign]


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    tmp_path.chmod(tmp_path.stat().st_mode | 0o011)
    return tmp_path


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Supervisor]:
    """A supervisor of this test's processes, in its own temp dir; everything stops at the end."""
    s = Supervisor(tmp_path / "run")
    try:
        yield s
    finally:
        s.stop_all()


def require_binary(name: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make setup` (tests never skip missing parts)")
    return path


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free port, for one test module."""
    sup = Supervisor(tmp_path_factory.mktemp("redis"))
    port = free_port()
    sup.start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        sup.stop_all()
