"""``kvgate up`` / ``kvgate down``: the whole stack as local processes under one supervisor.

Without ``--config`` it is the demo: redis-server, simulated vLLM backends, the sidecar and Nginx, all
on loopback with their state in the run directory; ``--real-vllm N`` puts N real vLLM servers (the
CPU build and tiny model of ``make real-vllm``) in place of the simulators. With ``--config`` it
fronts the backends the config lists (no simulators); a Redis URL on this machine's loopback is
started here too.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.config import Config, ConfigError
from kvgate.nginx_conf import NginxSettings
from kvgate.tools import redis_topologies
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import write_private

DEMO_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REAL_MODEL = "kvgate-tiny"  # what vllm_real's fleet serves


def demo_config(
    backends: list[tuple[str, str]], redis_port: int, run_dir: Path, token: str, sidecar_port: int
) -> dict[str, Any]:
    """The demo's sidecar config over ``backends`` (id, url)."""
    return {
        "listen": {"socket": str(run_dir / "sidecar.sock"), "http_port": sidecar_port, "admin_token": token},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
        "gateway": {"route_headers": True},  # the demo shows which backend served each request, and why
        "backends": [{"id": bid, "url": url} for bid, url in backends],
    }


def _start_real_vllm(sup: Supervisor, n: int) -> list[tuple[str, str]]:
    from vllm_real.fleet import Fleet, ServerSpec

    print(f"starting {n} real vLLM server(s) (CPU build, tiny model; about a minute or two)", flush=True)
    urls = Fleet(sup).start([ServerSpec()] * n)
    return [(f"vllm-{i + 1}", url) for i, url in enumerate(urls)]


def _local_redis_port(url: str | None) -> int | None:
    if url and (url.startswith("redis://127.0.0.1:") or url.startswith("redis://localhost:")):
        return int(url.rsplit(":", 1)[1].split("/")[0])
    return None


def _answers_ping(port: int) -> bool:
    """Whether a Redis (any server answering PING, even with an auth error) listens on the port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


DEFAULT_SIDECAR_PORT = 9100
STACK = "kvgate"  # the replica name: its children are kvgate-sidecar and kvgate-nginx


def cmd_up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pid_file = run_dir / "kvgate-up.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
            print(
                f"kvgate: a stack already runs from {run_dir} (pid {pid_file.read_text().strip()}); "
                "stop it with `kvgate down`",
                file=sys.stderr,
            )
            return 1
        except (ProcessLookupError, ValueError):
            pid_file.unlink()
    sup = Supervisor(run_dir, sidecar_args=("--log-level", args.log_level, "--log-format", args.log_format))
    if args.gateway_nice is not None:
        sup.nice = {f"{STACK}-sidecar": args.gateway_nice, f"{STACK}-nginx": args.gateway_nice}
    # What the sidecar gets on top of its config (KVGATE_* overrides, see kvgate.config).
    env: dict[str, str] = {}
    try:
        if args.config:
            config_path = Path(args.config).resolve()
            config = Config.from_file(config_path)
            # The config's own admin token stands; without one, a fresh one for this stack.
            token = (
                config.listen.admin_token or os.environ.get("KVGATE_ADMIN_TOKEN") or secrets.token_urlsafe(16)
            )
            # A relative socket path means relative to where `kvgate up` runs, for the sidecar
            # (started in its run dir) and for Nginx alike.
            env["KVGATE_LISTEN_SOCKET"] = str(Path(config.listen.socket).resolve())
            if args.sidecar_port is not None:
                env["KVGATE_LISTEN_HTTP_PORT"] = str(args.sidecar_port)
            config = Config.from_file(config_path, {**os.environ, **env})
        else:
            token = os.environ.get("KVGATE_ADMIN_TOKEN") or secrets.token_urlsafe(16)
            if args.real_vllm:
                backends = [(f"vllm-{i + 1}", "http://127.0.0.1:0") for i in range(args.real_vllm)]
            else:
                backends = [
                    (f"sim-{i + 1}", f"http://127.0.0.1:{args.sim_port + i}") for i in range(args.backends)
                ]
            demo = demo_config(
                backends,
                args.redis_port,
                run_dir,
                token,
                args.sidecar_port if args.sidecar_port is not None else DEFAULT_SIDECAR_PORT,
            )
            if args.redis != "server":
                demo["redis"]["url"] = redis_topologies.url(args.redis, args.redis_port)
            config = Config.from_mapping(demo, {})  # checked now; written once the backends are known
    except ConfigError as exc:
        print(f"kvgate: invalid config: {exc}", file=sys.stderr)
        return 2
    env["KVGATE_ADMIN_TOKEN"] = token
    write_private(run_dir / "admin-token", token + "\n")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    pid_file.write_text(str(os.getpid()))
    try:
        redis_port = _local_redis_port(config.redis.url)
        if not args.config and args.redis != "server":
            print(f"starting a local Redis {args.redis} from port {args.redis_port}: {config.redis.url}")
            redis_topologies.start(sup, args.redis, args.redis_port)
        elif redis_port is not None and _answers_ping(redis_port):
            # A Redis already runs there (Debian's own on 6379, say): use it, start none.
            print(f"using the Redis already running on 127.0.0.1:{redis_port}")
        elif redis_port is not None:
            print(f"starting redis-server on 127.0.0.1:{redis_port}")
            sup.start_redis(redis_port)
        if not args.config and args.real_vllm:
            demo["backends"] = [{"id": b, "url": u} for b, u in _start_real_vllm(sup, args.real_vllm)]
        elif not args.config:
            last = args.sim_port + args.backends - 1
            print(f"starting {args.backends} simulated vLLM backends on ports {args.sim_port}..{last}")
            sup.start_sim(
                args.sim_port,
                args.backends,
                "sim",
                "--model",
                DEMO_MODEL,
                "--time-scale",
                str(args.time_scale),
            )
        if not args.config:
            config_path = sup.write_config(demo, "kvgate-sidecar")
            config = Config.from_file(config_path)
        print("starting the kvgate sidecar and nginx")
        settings = NginxSettings.from_config(config, listen=f"127.0.0.1:{args.port}", run_dir=str(run_dir))
        launch_replica(sup, STACK, config_path, settings, env, wait_peers=False)
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"kvgate: failed to start the stack: {exc}; logs in {run_dir}", file=sys.stderr)
        sup.stop_all()
        pid_file.unlink(missing_ok=True)
        return 1
    base = f"http://127.0.0.1:{args.port}"
    model = "<your model>" if args.config else REAL_MODEL if args.real_vllm else DEMO_MODEL
    print(
        f"""
kvgate is up: gateway {base}  (sidecar API http://127.0.0.1:{config.listen.http_port}, logs in {run_dir})

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-ID: demo-1' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}' -i

  {sys.executable} -c 'import openai; c = openai.OpenAI(base_url="{base}/v1", api_key="unused"); \\
r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi"}}]); \\
print(r.choices[0].message.content)'

  curl -s http://127.0.0.1:{config.listen.http_port}/v1/backends     # state, load and weights per backend

Ctrl-C (or `kvgate down`) stops everything this command started.""",
        flush=True,
    )
    try:
        while not stopping:
            # A child that dies is restarted with backoff; the others keep serving meanwhile.
            for event in sup.supervise():
                print(f"kvgate: {event} (logs in {run_dir})", file=sys.stderr, flush=True)
            time.sleep(0.5)
    finally:
        print("stopping kvgate")
        sup.stop_all()
        pid_file.unlink(missing_ok=True)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    pid_file = Path(args.run_dir).resolve() / "kvgate-up.pid"
    if not pid_file.exists():
        print("kvgate: no stack is running from this directory")
        return 0
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        return 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not pid_file.exists():
            print("kvgate: stopped")
            return 0
        time.sleep(0.1)
    print("kvgate: the stack did not stop within 20 s", file=sys.stderr)
    return 1
