"""`kvgate up` / `kvgate down`: the demo stack as a newcomer runs it, on free ports in a temp dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kvgate.tools.readiness import free_port, free_ports

from tests.conftest import http_json, wait_until

pytestmark = pytest.mark.e2e
KVGATE = str(Path(sys.executable).parent / "kvgate")


def pid_listening(port: int) -> int | None:
    """The pid of the process listening on a TCP port of this machine, from /proc."""
    from kvgate.tools.readiness import _tcp_listen_inodes

    inodes = {f"socket:[{i}]" for i in _tcp_listen_inodes(port)}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(entry.name)
        except OSError:
            continue
    return None


def nice_of(pid: int | None) -> int:
    assert pid is not None
    return os.getpriority(os.PRIO_PROCESS, pid)


def session_nice(pid: int | None) -> int | None:
    """The nice value of the process's autogroup (one per session), on kernels that have them."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    return int(autogroup.read_text().split()[-1]) if autogroup.exists() else None


def test_up_serves_the_demo_restarts_what_dies_and_down_stops_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port, sim, redis, sidecar = free_port(), free_ports(2), free_port(), free_port()
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    up = subprocess.Popen(
        [
            KVGATE,
            "up",
            "--run-dir",
            str(run_dir),
            "--port",
            str(port),
            "--sim-port",
            str(sim),
            "--backends",
            "2",
            "--redis-port",
            str(redis),
            "--sidecar-port",
            str(sidecar),
            "--log-level",
            "info",
            "--log-format",
            "json",
            "--gateway-nice",
            "3",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: "kvgate is up" in (tmp_path / "up.log").read_text(), timeout=40)
        status, body = http_json(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hello!"}],
            },
        )
        assert status == 200 and body["usage"]["completion_tokens"] <= 3
        assert len(http_json("GET", f"http://127.0.0.1:{sidecar}/v1/backends")[1]["backends"]) == 2
        # The openai one-liner it prints runs as written (its interpreter, which has openai).
        printed = (tmp_path / "up.log").read_text()
        one_liner = printed[printed.index("  /") : printed.index("print(r.choices[0].message.content)'") + 36]
        ran = subprocess.run(["bash", "-c", one_liner.strip()], capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0 and ran.stdout.strip(), (one_liner, ran.stderr)
        # The gateway runs at its own priority (3 here: a test may not be allowed below 0), Nginx's
        # workers included; what else the stack runs stays at the caller's.
        for pid in (pid_listening(sidecar), pid_listening(port)):
            assert nice_of(pid) == 3 and session_nice(pid) in (3, None), pid
        assert nice_of(pid_listening(sim)) == nice_of(os.getpid())
        # The log options reach the sidecar: JSON lines, INFO included.
        lines = [json.loads(x) for x in (run_dir / "kvgate-sidecar.log").read_text().splitlines() if x]
        assert any(x["level"] == "INFO" and x["msg"].startswith("ring rebuilt") for x in lines)
        chat = {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hello again"}],
        }
        # A child that dies is restarted; meanwhile the gateway keeps answering (fail-open).
        for name, port_of in (("kvgate-sidecar", sidecar), ("redis", redis)):
            old = pid_listening(port_of)
            os.kill(old, signal.SIGKILL)
            for _ in range(5):
                assert http_json("POST", f"http://127.0.0.1:{port}/v1/chat/completions", chat)[0] == 200
            wait_until(lambda name=name: f"{name} restarted" in (tmp_path / "up.log").read_text(), timeout=15)
            assert pid_listening(port_of) not in (None, old)
        assert nice_of(pid_listening(sidecar)) == 3  # a restarted sidecar too
        wait_until(
            lambda: http_json("GET", f"http://127.0.0.1:{sidecar}/healthz")[1]["redis"] == "ok", timeout=10
        )
        status, _ = http_json("POST", f"http://127.0.0.1:{port}/v1/chat/completions", chat)
        assert status == 200
        assert (
            subprocess.run(
                [KVGATE, "up", "--run-dir", str(run_dir)], capture_output=True, timeout=30
            ).returncode
            == 1
        )  # a second stack from the same dir is refused
        down = subprocess.run(
            [KVGATE, "down", "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=40
        )
        assert down.returncode == 0 and "stopped" in down.stdout
        up.wait(timeout=20)  # its children are stopped (and waited for) before it exits
        for p in (port, sim, redis, sidecar):
            with pytest.raises(OSError):
                http_json("GET", f"http://127.0.0.1:{p}/", timeout=1)
        assert not (run_dir / "kvgate-up.pid").exists()
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=20)
        log.close()


def test_up_with_a_config_as_written(tmp_path: Path) -> None:
    """`kvgate up --config` with what a user writes: a relative socket path (relative to where `up`
    runs), the config's own admin token (kept, not replaced), --sidecar-port (applied), and a loopback
    Redis that already runs (used, not started again: that failed on the busy port)."""
    from kvgate.tools.launcher import Supervisor

    work = tmp_path / "work"
    work.mkdir()
    sims = Supervisor(tmp_path / "sims")
    sim = free_ports(2)
    sims.start_sim(sim, 2, "sim", "--model", "m")
    port, redis, sidecar = free_port(), free_port(), free_port()
    sims.start_redis(redis)  # a Redis the user already runs there (Debian's own, say): it is used
    (work / "kvgate.yaml").write_text(
        f"""listen:
  socket: .run/kvgate-sidecar.sock
  admin_token: my-own-token
redis:
  url: redis://127.0.0.1:{redis}/0
backends:
  - {{id: a, url: "http://127.0.0.1:{sim}"}}
  - {{id: b, url: "http://127.0.0.1:{sim + 1}"}}
"""
    )
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    up = subprocess.Popen(
        [
            KVGATE,
            "up",
            "--config",
            "kvgate.yaml",
            "--run-dir",
            str(tmp_path / "run"),
            "--port",
            str(port),
            "--sidecar-port",
            str(sidecar),
        ],
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: "kvgate is up" in (tmp_path / "up.log").read_text(), timeout=40)
        assert f"using the Redis already running on 127.0.0.1:{redis}" in (tmp_path / "up.log").read_text()
        assert (work / ".run" / "kvgate-sidecar.sock").exists()
        chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        wait_until(lambda: http_json("POST", f"http://127.0.0.1:{port}/v1/chat/completions", chat)[0] == 200)
        admin = {"Authorization": "Bearer my-own-token"}
        status, _ = http_json("GET", f"http://127.0.0.1:{sidecar}/debug/decisions", None, admin)
        assert status == 200
        assert (tmp_path / "run" / "admin-token").read_text().strip() == "my-own-token"
    finally:
        subprocess.run([KVGATE, "down", "--run-dir", str(tmp_path / "run")], capture_output=True, timeout=40)
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=20)
        log.close()
        sims.stop_all()


def test_up_refuses_a_bad_log_level_before_starting_anything(tmp_path: Path) -> None:
    done = subprocess.run(
        [KVGATE, "up", "--run-dir", str(tmp_path / "run"), "--log-level", "loud"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "'loud' is not a log level" in done.stderr
    assert not (tmp_path / "run").exists()


def test_up_on_a_busy_port_says_why_on_the_terminal(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sim, redis, sidecar = free_ports(1), free_port(), free_port()
        done = subprocess.run(
            [
                KVGATE,
                "up",
                "--run-dir",
                str(tmp_path / "run"),
                "--port",
                str(port),
                "--sim-port",
                str(sim),
                "--backends",
                "1",
                "--redis-port",
                str(redis),
                "--sidecar-port",
                str(sidecar),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1
    assert "failed to start the stack" in done.stderr and "Address already in use" in done.stderr
    for p in (sim, redis, sidecar):  # what it had started is stopped again
        with pytest.raises(OSError):
            http_json("GET", f"http://127.0.0.1:{p}/", timeout=1)


@pytest.mark.parametrize("command", ["kvgate", "kvgate-bench", "vllm-sim"])
def test_every_command_says_its_version(command: str) -> None:
    done = subprocess.run(
        [str(Path(KVGATE).parent / command), "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith(command + " "), done.stdout + done.stderr
