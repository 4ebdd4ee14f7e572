"""The drop-in inside a realistic existing edge: its own Lua setup (package path, init hooks), its own
access checks (a Lua bearer check, auth_basic, auth_request, allow/deny), its own `location /v1/`
and `/app/`, its own body limit. kvgate's routes must keep every check the edge had, and the edge's
other locations must keep their own error pages and limits."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvgate.nginx_conf import NginxSettings, find_nginx, render
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port, wait_listening, wait_ready

from tests.lua_harness import MockSidecar, backend_server, main_conf_head

pytestmark = pytest.mark.e2e
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

EDGE_AUTH = """
local _M = {}
-- The edge's own Lua check: a bearer token, on the servers that set $edge_lua_auth.
function _M.access()
    if ngx.var.edge_lua_auth == "on" and ngx.var.http_authorization ~= "Bearer edge-secret" then
        return ngx.exit(401)
    end
end
return _M
"""


class Edge:
    def __init__(self, sup: Supervisor) -> None:
        run = sup.run_dir / "edge"
        (run / "lua" / "edge").mkdir(parents=True)
        (run / "lua" / "edge" / "auth.lua").write_text(EDGE_AUTH)
        (run / "htpasswd").write_text("alice:{PLAIN}wonder\n")
        backend = free_port()
        self.sidecar = MockSidecar(sup.run_dir / "mock.sock", [("b", f"127.0.0.1:{backend}")])
        self.sidecar.answer = lambda msg: {"i": msg["i"], "c": [["b", f"127.0.0.1:{backend}"]], "r": "ring"}
        self.ports = {name: free_port() for name in ("lua", "basic", "request", "deny")}
        conf = run / "kvgate"
        settings = NginxSettings(
            listen="unused",
            socket=str(self.sidecar.path),
            run_dir=str(run),
            catch_all=False,
            edge_lua=True,
            edge_access="edge.auth",
        )
        render(settings, conf, standalone=False)
        kv = f"include {conf}/kvgate-server.conf;"
        # The backend lives in the same http {}: it must not inherit the edge's 1k body limit.
        upstream = backend_server(backend, '{"served_by":"b"}').replace(
            "{ listen", "{ client_max_body_size 16m; listen", 1
        )
        main = run / "nginx.conf"
        main.write_text(
            f"""{main_conf_head(run)}
    client_max_body_size 1k;                        # the edge's own limit
    lua_package_path "{run}/lua/?.lua;;";            # the edge's own Lua setup
    init_by_lua_block {{ dofile("{conf}/kvgate-init.lua") }}
    init_worker_by_lua_block {{ require("kvgate.gateway").init_worker() }}
    include {conf}/kvgate-http.conf;
    {upstream}
    server {{
        listen 127.0.0.1:{self.ports["lua"]};
        set $edge_lua_auth on;
        access_by_lua_block {{ require("edge.auth").access() }}
        # (content, not `return`: a return answers in the rewrite phase, before any access check)
        location /app/ {{ content_by_lua_block {{ ngx.req.read_body(); ngx.print("app") }} }}
        location /v1/ {{ content_by_lua_block {{ ngx.print("edge v1") }} }}
        {kv}
    }}
    server {{
        listen 127.0.0.1:{self.ports["basic"]};
        auth_basic "edge";
        auth_basic_user_file {run}/htpasswd;
        {kv}
    }}
    server {{
        listen 127.0.0.1:{self.ports["request"]};
        auth_request /_edge_auth;
        location = /_edge_auth {{
            internal;
            if ($http_x_edge_pass = "yes") {{ return 204; }}
            return 401;
        }}
        {kv}
    }}
    server {{
        listen 127.0.0.1:{self.ports["deny"]};
        deny all;
        {kv}
    }}
}}
"""
        )
        nginx = find_nginx()
        check = subprocess.run(
            [nginx, "-t", "-p", str(run), "-c", str(main), "-e", str(run / "error.log")],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0, check.stderr
        proc = sup.spawn("edge-nginx", [nginx, "-p", str(run), "-c", str(main), "-e", str(run / "error.log")])
        for port in self.ports.values():
            wait_listening(proc, port=port)
        wait_ready(proc, "its fail-open peer list arrived", self._peers_known)

    def _peers_known(self) -> bool:
        status, body = call(self.url("lua", "/kvgate/health"), None, {"Authorization": "Bearer edge-secret"})
        return status == 200 and json.loads(body)["fail_open_peers"] > 0

    def url(self, server: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[server]}{path}"


def call(url: str, data: bytes | None = CHAT, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=data,
        method="POST" if data is not None else "GET",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        finally:
            exc.close()


@pytest.fixture
def edge(stack: Supervisor) -> Iterator[Edge]:
    e = Edge(stack)
    try:
        yield e
    finally:
        e.sidecar.close()


def test_kvgate_routes_keep_every_access_check_the_edge_had(edge: Edge) -> None:
    chat = "/v1/chat/completions"
    # The edge's Lua bearer check, chained through gateway.edge_access.
    assert call(edge.url("lua", chat))[0] == 401
    status, body = call(edge.url("lua", chat), headers={"Authorization": "Bearer edge-secret"})
    assert status == 200 and json.loads(body) == {"served_by": "b"}
    # auth_basic, auth_request and allow/deny apply to kvgate's locations as to any other.
    assert call(edge.url("basic", chat))[0] == 401
    assert call(edge.url("basic", chat), headers={"Authorization": "Basic YWxpY2U6d29uZGVy"})[0] == 200
    assert call(edge.url("request", chat))[0] == 401
    assert call(edge.url("request", chat), headers={"X-Edge-Pass": "yes"})[0] == 200
    assert call(edge.url("deny", chat))[0] == 403
    assert call(edge.url("deny", "/v1/models"), None)[0] == 403


def test_the_edges_own_locations_limits_and_lua_are_left_alone(edge: Edge) -> None:
    auth = {"Authorization": "Bearer edge-secret"}
    assert call(edge.url("lua", "/app/x"), None)[0] == 401  # the server's Lua check still guards /app/
    assert call(edge.url("lua", "/app/x"), None, auth) == (200, b"app")
    assert call(edge.url("lua", "/v1/other"), None, auth) == (200, b"edge v1")  # its own /v1/ location
    big = b'{"pad":"' + b"x" * 4000 + b'"}'
    status, body = call(edge.url("lua", "/app/x"), big, auth)
    assert status == 413 and not body.lstrip().startswith(b"{")  # the edge's limit and its own error page
    long_chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}).encode()
    assert call(edge.url("lua", "/v1/chat/completions"), long_chat, auth)[0] == 200  # kvgate's own limit


def test_render_for_an_edge_with_lua_leaves_the_lua_directives_to_the_edge(tmp_path: Path) -> None:
    settings = NginxSettings(listen="unused", socket="/tmp/x.sock", run_dir=str(tmp_path), edge_lua=True)
    render(settings, tmp_path / "conf", standalone=False)
    http = (tmp_path / "conf" / "kvgate-http.conf").read_text()
    directives = [line.split()[0] for line in http.splitlines() if line and not line.startswith("#")]
    assert not {"lua_package_path", "init_by_lua_block", "init_worker_by_lua_block"} & set(directives)
    init = (tmp_path / "conf" / "kvgate-init.lua").read_text()
    assert "package.path" in init and 'require("kvgate.gateway").configure' in init
