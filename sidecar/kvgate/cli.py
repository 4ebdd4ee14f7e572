"""``kvgate``: run the sidecar, render Nginx's config, run the whole stack locally (``up``/``down``).

The benchmark has its own entry point, ``kvgate-bench``; ``kvgate bench ...`` hands over to it in a
new process, so the gateway never imports the benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate import logs, version
from kvgate.config import Config, ConfigError, reference
from kvgate.nginx_conf import LUA_DIR, NginxSettings, render

RUN_DIR = Path(".run")


def cmd_sidecar(args: argparse.Namespace) -> int:
    from kvgate.app import serve

    logs.setup(args)
    try:
        config = Config.from_file(args.config)
    except ConfigError as exc:
        print(f"kvgate: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            print("kvgate: --event-loop uvloop needs uvloop: pip install 'kvgate[fast]'", file=sys.stderr)
            return 2
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(serve(config, args.config))
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, args.config))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    try:
        config = Config.from_file(args.config)
    except ConfigError as exc:
        print(f"kvgate: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.drop_in:
        # The edge's own Lua access check must not be bypassed by kvgate's routes: read it first.
        from kvgate.edge_check import EdgeError, check

        if args.edge_conf is None:
            print(
                "kvgate: --drop-in needs --edge-conf FILE (the edge's nginx.conf): kvgate's routes "
                "would replace an access_by_lua the edge has at server or http level, so it is "
                "checked first",
                file=sys.stderr,
            )
            return 2
        try:
            check(Path(args.edge_conf), config.gateway.edge_access)
        except EdgeError as exc:
            print(f"kvgate: refusing to render the drop-in: {exc}", file=sys.stderr)
            return 2
    settings = NginxSettings.from_config(
        config,
        lua_dir=args.lua_dir,
        listen=args.listen,
        run_dir=args.run_dir,
        edge_lua=args.edge_lua,
        catch_all=not args.no_v1_catch_all,
        error_log=args.error_log,
    )
    main = render(settings, Path(args.out), standalone=not args.drop_in, openresty=args.openresty or None)
    print(f"wrote {main.parent}/ ({'include files only' if args.drop_in else 'standalone nginx.conf'})")
    return 0


def cmd_hash_key(args: argparse.Namespace) -> int:
    """Print the SHA-256 to put in auth.keys for the API key read from stdin (never an argument:
    it would stay in the shell's history and the process list)."""
    from kvgate.config import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print('kvgate: give the API key on stdin, e.g. `printf %s "$KEY" | kvgate hash-key`', file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    print(reference(Config), end="")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from kvgate.tools.demo import cmd_up as up

    return up(args)


def cmd_down(args: argparse.Namespace) -> int:
    from kvgate.tools.demo import cmd_down as down

    return down(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        # The benchmark is a separate tool with its own dependencies: run it, do not import it.
        os.execv(sys.executable, [sys.executable, "-m", "kvgate_bench", *argv[1:]])
    p = argparse.ArgumentParser(prog="kvgate", description="Prefix-cache-aware gateway for vLLM fleets.")
    p.add_argument("--version", action="version", version=f"kvgate {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sidecar", help="run the routing sidecar")
    s.add_argument("--config", required=True)
    s.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="uvloop (libuv) instead of asyncio's own loop (needs kvgate[fast])",
    )
    logs.add_arguments(s)
    s.set_defaults(func=cmd_sidecar)
    u = sub.add_parser("up", help="run the whole stack as local processes (demo, or --config for real vLLM)")
    u.add_argument("--config", help="sidecar config with real backend URLs (no simulators are started)")
    u.add_argument("--run-dir", default=str(RUN_DIR))
    u.add_argument("--port", type=int, default=8080)
    u.add_argument("--sim-port", type=int, default=8001)
    u.add_argument("--backends", type=int, default=3, help="simulated backends of the demo")
    u.add_argument(
        "--real-vllm",
        type=int,
        default=0,
        metavar="N",
        help="N real vLLM servers (CPU build, tiny model; `make real-vllm` installs them) "
        "instead of the simulators",
    )
    u.add_argument("--redis-port", type=int, default=6380)
    u.add_argument(
        "--redis",
        choices=("server", "sentinel", "cluster"),
        default="server",
        help="the demo's Redis: one server on --redis-port; a primary, its replica and three "
        "Sentinels on the five ports from it; or a six-node Cluster (three primaries, a replica each)",
    )
    u.add_argument(
        "--sidecar-port", type=int, default=None, help="the sidecar's loopback HTTP API (default 9100)"
    )
    u.add_argument("--time-scale", type=float, default=1.0)
    u.add_argument(
        "--gateway-nice",
        type=int,
        default=None,
        metavar="N",
        help="run the sidecar and Nginx at nice N (e.g. -10; negative needs root or CAP_SYS_NICE): "
        "ahead of other work on the host's cores, so decisions keep their 50 ms budget when "
        "those cores are saturated",
    )
    logs.add_arguments(u)  # handed to the sidecar it starts
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
    r.add_argument(
        "--edge-conf",
        help="with --drop-in: the edge's nginx.conf, checked for Lua access handlers kvgate's routes "
        "would bypass (required)",
    )
    r.add_argument("--lua-dir", default=str(LUA_DIR), help="where Nginx will find lua/kvgate")
    r.add_argument(
        "--edge-lua",
        action="store_true",
        help="the edge has its own lua_package_path/init_by_lua: write kvgate-init.lua for it to call",
    )
    r.add_argument(
        "--no-v1-catch-all",
        action="store_true",
        help="no `location /v1/` for other /v1/ routes (the edge has its own)",
    )
    r.add_argument("--openresty", action="store_true", help="target OpenResty (no load_module lines)")
    r.add_argument(
        "--error-log", default="", help="Nginx's error log (default: run dir; containers: /dev/stderr)"
    )
    r.set_defaults(func=cmd_render)
    h = sub.add_parser("hash-key", help="print the SHA-256 of an API key read from stdin, for auth.keys")
    h.set_defaults(func=cmd_hash_key)
    c = sub.add_parser("config-reference", help="print every config key: default, range, meaning (Markdown)")
    c.set_defaults(func=cmd_config_reference)
    sub.add_parser("bench", help="benchmarks (the kvgate-bench command)", add_help=False)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
