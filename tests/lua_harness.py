"""A small harness for testing kvgate's Lua phases in a real Nginx without the rest of the stack.

``PhaseNginx`` renders kvgate's own include files (the same templates as production) into a test
``nginx.conf`` whose other ``server {}`` blocks play the backends, and starts it under a supervisor.
``MockSidecar`` plays the sidecar's unix socket: it answers decisions, peers and models as a test
scripts them and records every message it gets, reports included.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate import protocol
from kvgate.nginx_conf import DEBIAN_MODULES, NginxSettings, find_nginx, render, user_directive
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port, get_json, wait_listening, wait_ready

# A reply (wire JSON without ``pv``), None for silence, or a list of replies and pauses (seconds)
# sent in order on the connection: a queued request's heartbeats, then its decision.
Answer = Callable[[dict[str, Any]], dict[str, Any] | list[dict[str, Any] | float] | None]


class MockSidecar:
    """Speaks the sidecar's line protocol on a unix socket. ``answer(msg)`` returns the reply to a
    decide message (as wire JSON, without ``pv``), or None to say nothing and let Nginx time out."""

    def __init__(self, path: Path, peers: list[tuple[str, str]]) -> None:
        self.path = path
        self.peers = peers
        self.peers_version = 1
        self.messages: list[dict[str, Any]] = []
        self.answer: Answer = lambda msg: None
        self.version = protocol.VERSION
        self.delay_s = 0.0
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        mock = self

        class Handler(socketserver.StreamRequestHandler):
            def setup(self) -> None:
                super().setup()
                with mock.lock:
                    mock.conns.append(self.connection)

            def handle(self) -> None:
                for raw in self.rfile:
                    msg = json.loads(raw)
                    with mock.lock:
                        mock.messages.append(msg)
                    reply = mock.reply(msg)
                    if reply is None:
                        continue
                    if mock.delay_s:
                        time.sleep(mock.delay_s)
                    try:
                        for part in reply if isinstance(reply, list) else [reply]:
                            if isinstance(part, float | int):
                                time.sleep(part)
                                continue
                            self.wfile.write(protocol.line({"pv": mock.version, **part}))
                            self.wfile.flush()
                    except OSError:
                        return  # Nginx gave up on this connection

        self.server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        path.chmod(0o666)  # Nginx's workers may be another user (nobody, when tests run as root)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def reply(self, msg: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any] | float] | None:
        op = msg.get("op")
        if op == "peers":
            return {"v": self.peers_version, "peers": [{"id": i, "addr": a} for i, a in self.peers]}
        if op == "models":
            return {"data": [{"id": "m", "object": "model"}]}
        if op == "decide":
            return self.answer(msg)
        return None  # reports are not answered

    def outcomes(self) -> list[dict[str, Any]]:
        with self.lock:
            return [o for m in self.messages if m.get("op") == "report" for o in m["o"]]

    def reports(self) -> list[dict[str, Any]]:
        with self.lock:
            return [m for m in self.messages if m.get("op") == "report"]

    def decides(self) -> list[dict[str, Any]]:
        with self.lock:
            return [m for m in self.messages if m.get("op") == "decide"]

    def close(self) -> None:
        """Stop listening and drop every open connection, as a dead sidecar would."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self.path.unlink(missing_ok=True)


def _modules(nginx: str) -> str:
    from kvgate.nginx_conf import _needs_modules

    if not _needs_modules(nginx):
        return ""
    return "\n".join(f"load_module {m};" for m in DEBIAN_MODULES if Path(m).exists())


def main_conf_head(run: Path, workers: int = 1) -> str:
    """The start of a test nginx.conf under ``run`` (its own pid, logs and temp dirs), up to the
    inside of ``http {``; the caller writes the rest and closes it."""
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run / "tmp" / sub).mkdir(parents=True, exist_ok=True)
    return f"""{_modules(find_nginx())}
{user_directive()}
worker_processes {workers};
daemon off;
pid {run}/nginx.pid;
error_log {run}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {run}/tmp/body;
    proxy_temp_path {run}/tmp/proxy;
    fastcgi_temp_path {run}/tmp/fastcgi;
    uwsgi_temp_path {run}/tmp/uwsgi;
    scgi_temp_path {run}/tmp/scgi;"""


class PhaseNginx:
    """Nginx with kvgate's include files and the test's own server blocks (``servers``)."""

    def __init__(
        self,
        sup: Supervisor,
        sidecar_socket: Path,
        servers: str,
        workers: int = 1,
        **settings: Any,
    ) -> None:
        self.sup = sup
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        run = sup.run_dir / "phase-nginx"
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (run / "tmp" / sub).mkdir(parents=True, exist_ok=True)
        self.error_log = run / "error.log"
        conf_dir = run / "conf"
        # The phase tests read which candidate answered from the route headers.
        settings.setdefault("route_headers", True)
        s = NginxSettings(
            listen=f"127.0.0.1:{self.port}", socket=str(sidecar_socket), run_dir=str(run), **settings
        )
        render(s, conf_dir, standalone=False)
        nginx = find_nginx()
        # The golden files are read by the workers (another user when tests run as root): a copy in
        # the run dir, so the checkout's own permissions do not matter.
        golden = run / "golden"
        shutil.copytree(GOLDEN_DIR, golden, dirs_exist_ok=True)
        main = conf_dir / "nginx.conf"
        main.write_text(
            f"""{main_conf_head(run, workers)}
    include {conf_dir}/kvgate-http.conf;
    server {{
        listen 127.0.0.1:{self.port};
        include {conf_dir}/kvgate-server.conf;
        location = /test/golden {{
            set $golden_dir {golden};
            content_by_lua_file {golden}/golden.lua;
        }}
    }}
    {servers}
}}
"""
        )
        proc = sup.spawn("phase-nginx", [nginx, "-p", str(run), "-c", str(main), "-e", str(self.error_log)])
        wait_listening(proc, port=self.port)
        wait_ready(
            proc,
            "its /kvgate/health answers",
            lambda: get_json(self.url + "/kvgate/health")["master_pid"] == proc.pid,
        )

    def log(self) -> str:
        return self.error_log.read_text() if self.error_log.exists() else ""


def stream_server(port: int, first_after_s: float, events: int, every_s: float) -> str:
    """A server block that streams like vLLM: headers at once, the first event after ``first_after_s``
    (its prefill), then ``events`` more every ``every_s``, then [DONE]."""
    return f"""server {{ listen 127.0.0.1:{port}; location / {{ content_by_lua_block {{
        ngx.header["Content-Type"] = "text/event-stream"
        ngx.send_headers()
        ngx.flush(true)
        ngx.sleep({first_after_s})
        for i = 1, {events} do
            ngx.print('data: {{"n":' .. i .. '}}\\n\\n')
            ngx.flush(true)
            ngx.sleep({every_s})
        end
        ngx.print("data: [DONE]\\n\\n")
    }} }} }}"""


def backend_server(port: int, body: str = "", status: int = 200, sleep_s: float = 0.0) -> str:
    """A server block that answers every request like a tiny backend."""
    if sleep_s:
        action = f'content_by_lua_block {{ ngx.sleep({sleep_s}); ngx.say("late") }}'
    else:
        action = f"default_type application/json; return {status} '{body}';"
    return f"server {{ listen 127.0.0.1:{port}; location / {{ {action} }} }}"


GOLDEN_DIR = Path(__file__).parent / "golden"
