"""The drop-in's check of an existing edge (``kvgate.edge_check``): a Lua access handler at server or
http level, which kvgate's locations would replace, stops the render unless it is chained through
gateway.edge_access; other access checks and location-level Lua pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kvgate.edge_check import EdgeError, bypassed_access, check, parse

LUA_AUTH = """
http {
    include conf.d/*.conf;
}
"""
SERVER = """
server {
    listen 443;
    # the edge's own key check, in Lua: { braces; and semicolons } in the code are not Nginx's
    access_by_lua_block {
        local t = { a = 1; b = 2 }
        if ngx.var.http_x_key ~= "s;e{c}ret" then return ngx.exit(401) end
    }
    location /app { proxy_pass http://app; }
}
"""


def edge(tmp_path: Path, main: str, **files: str) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "nginx.conf").write_text(main)
    return tmp_path / "nginx.conf"


def test_a_server_level_lua_check_in_an_included_file_is_found_by_file_and_line(tmp_path: Path) -> None:
    conf = edge(tmp_path, LUA_AUTH, **{"conf.d/api.conf": SERVER})
    found = bypassed_access(parse(conf))
    assert found == [f"{tmp_path / 'conf.d' / 'api.conf'}:5"]
    with pytest.raises(EdgeError, match=r"gateway\.edge_access"):
        check(conf, None)
    check(conf, "edge.auth")  # chained: kvgate's routes call it first


@pytest.mark.parametrize(
    "http_body",
    [
        "access_by_lua_file /etc/nginx/auth.lua; server { listen 80; }",
        "server { listen 80; access_by_lua 'return'; }",
    ],
)
def test_http_and_server_level_handlers_are_refused(tmp_path: Path, http_body: str) -> None:
    conf = edge(tmp_path, "http { " + http_body + " }")
    with pytest.raises(EdgeError, match="access_by_lua"):
        check(conf, None)


def test_other_access_checks_and_location_level_lua_pass(tmp_path: Path) -> None:
    conf = edge(
        tmp_path,
        """
        http {
            server {
                listen 443;
                auth_request /auth;
                allow 10.0.0.0/8; deny all;
                location /auth { internal; access_by_lua_block { return } proxy_pass http://auth; }
                location = /x { content_by_lua_block { ngx.say("}") } }
            }
        }
        """,
    )
    check(conf, None)


def test_only_the_servers_that_host_kvgate_count_once_one_does(tmp_path: Path) -> None:
    """A second server with its own Lua check but no kvgate routes is no concern of kvgate's."""
    other = "server { listen 8443; access_by_lua_block { return } }"
    hosting = "server { listen 443; location = /_kvgate/error { internal; } }"
    conf = edge(tmp_path, "http { " + other + hosting + " }")
    check(conf, None)


def test_the_cli_renders_a_drop_in_only_for_an_edge_it_has_checked(tmp_path: Path) -> None:
    kvgate = str(Path(sys.executable).parent / "kvgate")
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"backends": [{"url": "http://10.0.0.5:8000"}]}))
    base = [kvgate, "render-nginx", "--config", str(config), "--out", str(tmp_path / "out"), "--drop-in"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)

    missing = run()
    assert missing.returncode == 2 and "--edge-conf" in missing.stderr
    risky = run("--edge-conf", str(edge(tmp_path / "a", LUA_AUTH, **{"conf.d/api.conf": SERVER})))
    assert risky.returncode == 2 and "api.conf:5" in risky.stderr
    assert not (tmp_path / "out").exists()
    clean = run("--edge-conf", str(edge(tmp_path / "b", "http { server { listen 80; } }")))
    assert clean.returncode == 0, clean.stderr
    assert (tmp_path / "out" / "kvgate-server.conf").exists()
