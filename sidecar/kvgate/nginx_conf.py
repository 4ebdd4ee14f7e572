"""Renders kvgate's Nginx files from ``nginx/*.in`` templates.

Two uses: a standalone gateway (``nginx.conf`` + includes, run by ``kvgate up`` under its own prefix
and ports), and a drop-in for an existing Nginx edge (only the include files; see README).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvgate.agreement import fingerprint, gateway_settings
from kvgate.config import DEFAULT_SOCKET, Config

# The Lua code and the templates ship inside the package (``kvgate/assets``: links to the checkout's
# lua/ and nginx/ in a source tree, copies in a wheel), so an installed kvgate renders on its own.
ASSETS = Path(__file__).resolve().parent / "assets"
LUA_DIR = (ASSETS / "lua").resolve()
TEMPLATES = (ASSETS / "nginx").resolve()
DEBIAN_MODULES = (
    "/usr/lib/nginx/modules/ndk_http_module.so",
    "/usr/lib/nginx/modules/ngx_http_lua_module.so",
)


LUA = "lua"  # field metadata: the setting goes to lua/kvgate/conf.lua, under the field's name
_TAKEN = gateway_settings(Config())  # a default config's: each default is declared in kvgate.config


def _taken(name: str, lua: bool = True) -> Any:
    """A setting Nginx takes from the kvgate config (``kvgate.agreement.gateway_settings``)."""
    return field(default=_TAKEN[name], metadata={LUA: lua})


def _lua(default: Any) -> Any:
    return field(default=default, metadata={LUA: True})


@dataclass(frozen=True, slots=True)
class NginxSettings:
    """Everything one rendering of Nginx's files needs. Where it runs (listen, workers, run_dir, ...)
    is the launcher's; the settings taken from the config have their defaults there; the fields
    marked ``LUA`` are handed, by name, to lua/kvgate/conf.lua once per Nginx start."""

    listen: str = "127.0.0.1:8080"
    socket: str = DEFAULT_SOCKET
    run_dir: str = ".run"
    workers: int = 2
    decision_timeout_ms: int = _taken("decision_timeout_ms")
    session_header: str = _taken("session_header")
    tenant_header: str = _taken("tenant_header")  # "": off
    route_headers: bool = _taken("route_headers")
    max_tries: int = _taken("max_tries")
    retry_statuses: tuple[int, ...] = _taken("retry_statuses", lua=False)
    connect_timeout_ms: int = _lua(2000)  # to a backend, per try
    upstream_keepalive_timeout: str = "4s"  # below the backends' idle close (vLLM: 5 s)
    first_byte_timeout_ms: int = _taken("first_byte_timeout_ms")
    first_byte_stream_min_ms: int = _taken("first_byte_stream_min_ms")
    token_timeout_ms: int = _taken("token_timeout_ms")
    max_read_timeout_ms: int = _taken("max_read_timeout_ms")
    client_max_body_size: str = _taken("client_max_body_size")
    max_engine_requests: int = _taken("max_engine_requests")  # n x a batch's prompts, at most
    client_body_buffer_size: str = "4m"
    access_log: bool = False
    error_log: str = ""  # where Nginx logs errors ("": nginx-error.log in run_dir; containers: /dev/stderr)
    lua_dir: str = str(LUA_DIR)  # where the gateway will find lua/kvgate/*.lua
    worker_user: str | None = _taken("worker_user", lua=False)
    auth: bool = _taken("auth")  # check API keys (the config has some)
    open_routes: tuple[str, ...] = _taken("open_routes")
    catch_all: bool = True  # a `location /v1/` for the other /v1/ routes
    limits: bool = _taken("limits")  # rate limits apply
    client_requests_per_minute: int = _taken("client_requests_per_minute")  # fail-open: per address
    client_tokens_per_minute: int = _taken("client_tokens_per_minute")
    queue: bool = _taken("queue", lua=False)  # the gateway queue is on (the sidecar's business)
    queue_heartbeat_ms: int = _taken("queue_heartbeat_ms")
    client_priority: bool = _taken("client_priority")  # fail-open: the client's priority counts
    forward_priority: bool = _taken("forward_priority")  # fail-open: the priority goes in the body
    # Drop-in into an edge that has its own Lua setup: kvgate-http.conf leaves out lua_package_path,
    # init_by_lua and init_worker_by_lua (one of each per http{}); the edge's own call kvgate's
    # (kvgate-init.lua, and require("kvgate.gateway").init_worker()).
    edge_lua: bool = False
    edge_access: str = _taken("edge_access")  # the edge's Lua module whose access() runs first
    tokenize_bytes: int = _taken("tokenize_bytes")  # bodies up to this size go with their decision
    usage: bool = _taken("usage")  # read each response's usage (asked of the backend for streams)
    # Of the settings above taken from the config (kvgate.agreement): Nginx sends it to the sidecar,
    # which says whether it runs the same config.
    fingerprint: str = _lua("")

    @classmethod
    def from_config(cls, config: Config, **overrides: Any) -> NginxSettings:
        """The settings a kvgate config asks for (its gateway section, the socket, the session header)."""
        own = gateway_settings(config)
        taken = {**own, **overrides}
        # What this Nginx will run, overrides included: a setting changed here is a mismatch too.
        runs = fingerprint({k: taken[k] for k in own})
        return cls(**{"socket": config.listen.socket, **taken, "fingerprint": runs})


def lua_literal(value: Any) -> str:
    """A setting as Lua source: strings quoted, a list of names as a set (``{ models = true }``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "{ " + "".join(f"{v} = true, " for v in value) + "}"
    raise TypeError(f"no Lua form for {value!r}")


def configure_lua(settings: NginxSettings) -> str:
    """The call handing Nginx's settings to lua/kvgate/conf.lua, once per start: every field marked
    ``LUA``, under its own name, and the decision socket."""
    lines = [f"    socket = {lua_literal('unix:' + str(Path(settings.socket).resolve()))},"]
    for f in fields(settings):
        if f.metadata.get(LUA):
            lines.append(f"    {f.name} = {lua_literal(getattr(settings, f.name))},")
    return 'require("kvgate.gateway").configure({\n' + "\n".join(lines) + "\n})"


def find_nginx() -> str:
    for name in ("openresty", "nginx"):
        path = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
        if path:
            return path
    raise FileNotFoundError("no nginx or openresty binary found; run `make setup`")


def _needs_modules(nginx: str) -> bool:
    """Debian's nginx loads the Lua module dynamically; OpenResty has it built in."""
    out = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=10, check=False)
    return "openresty" not in (out.stderr + out.stdout).lower()


def worker_identity(user: str | None) -> tuple[str, str]:
    """(user, group) Nginx's workers run as when it starts as root: never root itself."""
    name = user or "nobody"
    return name, grp.getgrgid(pwd.getpwnam(name).pw_gid).gr_name


def user_directive(user: str | None = None) -> str:
    """Only a root master switches users: then the workers run as ``user`` (default nobody), and the
    sidecar's socket must be given to their group (``listen.socket_group``). Not root: no directive,
    the workers are the invoking user."""
    if os.geteuid() != 0:
        return ""
    name, group = worker_identity(user)
    return f"user {name} {group};"


def _nginx_text(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def render(
    settings: NginxSettings,
    out_dir: Path,
    standalone: bool = True,
    nginx: str | None = None,
    openresty: bool | None = None,
) -> Path:
    """Write the include files (and nginx.conf when standalone) to ``out_dir``; returns the main file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(settings.run_dir).resolve()
    # Each ${name} of the templates: a setting as Nginx writes it, or a line made of settings.
    values = {f.name: _nginx_text(getattr(settings, f.name)) for f in fields(settings)}
    values.update(
        {
            "retry_statuses": "".join(f" http_{s}" for s in settings.retry_statuses),
            "conf_dir": str(out_dir.absolute()),
            "run_dir": str(run_dir),
            "access_log": f"{run_dir}/nginx-access.log kvgate" if settings.access_log else "off",
            "error_log": settings.error_log or f"{run_dir}/nginx-error.log",
            "user_directive": user_directive(settings.worker_user),
            # The client's key is the gateway's business: it does not travel on to the backends.
            "upstream_authorization": 'proxy_set_header Authorization "";' if settings.auth else "",
            "load_modules": "",
        }
    )
    configure = configure_lua(settings)
    lua_path = f'"{settings.lua_dir}/?.lua;;"'
    if settings.edge_lua:
        values["lua_package_path"] = (
            "# lua_package_path, init_by_lua, init_worker_by_lua: the edge's own (edge_lua)"
        )
        values["init_by_lua"] = ""
        values["init_worker_by_lua"] = ""
        (out_dir / "kvgate-init.lua").write_text(
            "-- kvgate, for an edge with its own Lua setup: run from the edge's init_by_lua*\n"
            f'--   dofile("{out_dir.absolute()}/kvgate-init.lua")\n'
            '-- and call require("kvgate.gateway").init_worker() from its init_worker_by_lua*.\n'
            f'package.path = "{settings.lua_dir}/?.lua;" .. package.path\n'
            f"{configure}\n"
        )
    else:
        values["lua_package_path"] = f"lua_package_path {lua_path};"
        values["init_by_lua"] = "init_by_lua_block {\n    " + configure.replace("\n", "\n    ") + "\n}"
        values["init_worker_by_lua"] = 'init_worker_by_lua_block { require("kvgate.gateway").init_worker() }'
    # Other /v1/ routes go to a backend serving the model; a drop-in into an edge that has its own
    # `location /v1/` leaves that one alone (catch_all False).
    values["v1_catch_all"] = (
        "location /v1/ {   # other /v1/ routes: to a backend serving the model\n"
        "    set $kvgate_kind json;\n"
        f"    include {values['conf_dir']}/kvgate-limits.conf;\n"
        f"    include {values['conf_dir']}/kvgate-route.conf;\n"
        "}"
        if settings.catch_all
        else ""
    )
    names = [
        "kvgate-http.conf",
        "kvgate-server.conf",
        "kvgate-proxy.conf",
        "kvgate-route.conf",
        "kvgate-limits.conf",
    ]
    if standalone:
        if openresty is None:
            openresty = not _needs_modules(nginx or find_nginx())
        if not openresty:
            values["load_modules"] = "\n".join(
                f"load_module {m};" for m in DEBIAN_MODULES if os.path.exists(m)
            )
        names.append("nginx.conf")
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (run_dir / "nginx-tmp" / sub).mkdir(parents=True, exist_ok=True)
    for name in names:
        text = (TEMPLATES / f"{name}.in").read_text()
        # Only ${name} is ours; Nginx's own $variables pass through untouched.
        (out_dir / name).write_text(re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text))
    return out_dir / names[-1]
