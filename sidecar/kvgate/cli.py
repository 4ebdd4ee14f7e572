"""``kvgate``: the sidecar, the demo stack supervisor and Nginx config rendering."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvgate.config import Config, ConfigError
from kvgate.nginx_conf import ROOT, NginxSettings, render

RUN_DIR = ROOT / ".run"
DEMO_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def cmd_sidecar(args: argparse.Namespace) -> int:
    from kvgate.app import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        config = Config.from_file(args.config)
    except ConfigError as exc:
        print(f"kvgate: invalid config: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, args.config))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    try:
        config = Config.from_file(args.config)
    except ConfigError as exc:
        print(f"kvgate: invalid config: {exc}", file=sys.stderr)
        return 2
    settings = NginxSettings(
        lua_dir=args.lua_dir,
        listen=args.listen,
        socket=config.listen.socket,
        run_dir=args.run_dir,
        session_header=config.routing.session_header,
        max_tries=config.routing.max_candidates,
    )
    main = render(settings, Path(args.out), standalone=not args.drop_in, openresty=args.openresty or None)
    print(f"wrote {main.parent}/ ({'include files only' if args.drop_in else 'standalone nginx.conf'})")
    return 0


def _demo_config(
    sim_port: int, instances: int, redis_port: int, run_dir: Path, token: str, sidecar_port: int
) -> dict[str, object]:
    return {
        "listen": {"socket": str(run_dir / "sidecar.sock"), "http_port": sidecar_port, "admin_token": token},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"},
        "backends": [
            {"id": f"sim-{i + 1}", "url": f"http://127.0.0.1:{sim_port + i}"} for i in range(instances)
        ],
    }


def cmd_up(args: argparse.Namespace) -> int:
    from kvgate.stack import Stack

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
    stack = Stack(run_dir)
    token = os.environ.get("KVGATE_ADMIN_TOKEN") or secrets.token_urlsafe(16)
    (run_dir / "admin-token").write_text(token + "\n")
    try:
        if args.config:
            config_path = Path(args.config).resolve()
            config = Config.from_file(config_path)
        else:
            config_path = stack.write_sidecar_config(
                _demo_config(
                    args.sim_port, args.backends, args.redis_port, run_dir, token, args.sidecar_port
                ),
                "kvgate",
            )
            config = Config.from_file(config_path)
    except ConfigError as exc:
        print(f"kvgate: invalid config: {exc}", file=sys.stderr)
        return 2
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    pid_file.write_text(str(os.getpid()))
    try:
        redis_url = config.redis.url or ""
        if redis_url.startswith("redis://127.0.0.1:") or redis_url.startswith("redis://localhost:"):
            port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
            print(f"starting redis-server on 127.0.0.1:{port}")
            stack.start_redis(port)
        if not args.config:
            print(
                f"starting {args.backends} simulated vLLM backends on ports {args.sim_port}.."
                f"{args.sim_port + args.backends - 1}"
            )
            stack.start_sim(
                args.sim_port,
                args.backends,
                "sim",
                "--model",
                DEMO_MODEL,
                "--time-scale",
                str(args.time_scale),
            )
        print("starting the kvgate sidecar")
        stack.start_sidecar(config_path, Path(config.listen.socket), env={"KVGATE_ADMIN_TOKEN": token})
        print(f"starting nginx on 127.0.0.1:{args.port}")
        settings = NginxSettings(
            listen=f"127.0.0.1:{args.port}",
            socket=config.listen.socket,
            run_dir=str(run_dir),
            session_header=config.routing.session_header,
            max_tries=config.routing.max_candidates,
        )
        stack.start_nginx(settings, args.port)
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"kvgate: failed to start the stack: {exc}; logs in {run_dir}", file=sys.stderr)
        stack.stop_all()
        pid_file.unlink(missing_ok=True)
        return 1
    base = f"http://127.0.0.1:{args.port}"
    model = DEMO_MODEL if not args.config else "<your model>"
    print(
        f"""
kvgate is up: gateway {base}  (sidecar API http://127.0.0.1:{config.listen.http_port}, logs in {run_dir})

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-ID: demo-1' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 16}}' -i

  python -c 'import openai; c = openai.OpenAI(base_url="{base}/v1", api_key="unused"); \\
r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi"}}]); \\
print(r.choices[0].message.content)'

  curl -s http://127.0.0.1:{config.listen.http_port}/v1/backends     # state, load and weights per backend

Ctrl-C (or `kvgate down`) stops everything this command started.""",
        flush=True,
    )
    code = 0
    try:
        while not stopping:
            dead = [n for n, alive in stack.alive().items() if not alive]
            if dead:
                print(
                    f"kvgate: {', '.join(dead)} exited; stopping the stack (logs in {run_dir})",
                    file=sys.stderr,
                )
                code = 1
                break
            time.sleep(0.5)
    finally:
        print("stopping kvgate")
        stack.stop_all()
        pid_file.unlink(missing_ok=True)
    return code


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
    for _ in range(200):
        if not pid_file.exists():
            print("kvgate: stopped")
            return 0
        time.sleep(0.1)
    print("kvgate: the stack did not stop within 20 s", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvgate", description="Prefix-cache-aware gateway for vLLM fleets.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sidecar", help="run the routing sidecar")
    s.add_argument("--config", required=True)
    s.add_argument("--log-level", default="WARNING")
    s.set_defaults(func=cmd_sidecar)
    u = sub.add_parser("up", help="run the whole stack as local processes (demo, or --config for real vLLM)")
    u.add_argument("--config", help="sidecar config with real backend URLs (no simulators are started)")
    u.add_argument("--run-dir", default=str(RUN_DIR))
    u.add_argument("--port", type=int, default=8080)
    u.add_argument("--sim-port", type=int, default=8001)
    u.add_argument("--backends", type=int, default=3)
    u.add_argument("--redis-port", type=int, default=6380)
    u.add_argument("--sidecar-port", type=int, default=9100, help="the sidecar's loopback HTTP API")
    u.add_argument("--time-scale", type=float, default=1.0)
    u.set_defaults(func=cmd_up)
    d = sub.add_parser("down", help="stop the stack `kvgate up` started")
    d.add_argument("--run-dir", default=str(RUN_DIR))
    d.set_defaults(func=cmd_down)
    r = sub.add_parser("render-nginx", help="write Nginx config (standalone, or --drop-in include files)")
    r.add_argument("--config", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--listen", default="127.0.0.1:8080")
    r.add_argument("--run-dir", default=str(RUN_DIR))
    r.add_argument("--drop-in", action="store_true", help="only the http{}/server{} include files")
    r.add_argument("--lua-dir", default=str(ROOT / "lua"), help="where Nginx will find lua/kvgate")
    r.add_argument("--openresty", action="store_true", help="target OpenResty (no load_module lines)")
    r.set_defaults(func=cmd_render)
    b = sub.add_parser(
        "bench", help="benchmarks: virtual-time replay, live runs, side-by-side compare", add_help=False
    )
    b.set_defaults(func=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from kvgate_bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
