"""Nginx's settings: declared once in Python, handed by name to lua/kvgate/conf.lua."""

from __future__ import annotations

import re
import subprocess
from dataclasses import fields
from pathlib import Path

from kvgate.config import Config
from kvgate.nginx_conf import LUA, NginxSettings, configure_lua, lua_literal

from tests.helpers import ROOT

LUA_CONSTANTS = {"dict", "limits_dict", "report_timeout_ms", "send_timeout_ms", "configure"}


def rendered_names() -> set[str]:
    return {"socket"} | {f.name for f in fields(NginxSettings) if f.metadata.get(LUA)}


def test_every_setting_the_lua_reads_is_rendered_and_every_rendered_one_is_read() -> None:
    read = set()
    for path in (ROOT / "lua" / "kvgate").glob("*.lua"):
        code = re.sub(r"--[^\n]*", "", path.read_text())  # comments name files like conf.lua
        read |= set(re.findall(r"\bconf\.([a-z_]+)", code))
    assert read - LUA_CONSTANTS == rendered_names()


def test_defaults_come_from_the_config_declaration() -> None:
    """No second default: a default config's Nginx settings are NginxSettings' own."""
    base = NginxSettings.from_config(Config.from_mapping({"backends": [{"url": "http://h:1"}]}))
    for f in fields(NginxSettings):
        if f.name not in ("socket", "fingerprint"):
            assert getattr(base, f.name) == getattr(NginxSettings(), f.name), f.name


def test_the_configure_call_carries_each_setting_under_its_own_name(tmp_path: Path) -> None:
    config = Config.from_mapping(
        {
            "backends": [{"url": "http://h:1"}],
            "gateway": {"decision_timeout_ms": 77, "client_max_body_size": "2m"},
            "auth": {"open_routes": ["models"], "keys": [{"name": "a", "sha256": "0" * 64}]},
        }
    )
    text = configure_lua(NginxSettings.from_config(config, socket=str(tmp_path / "s.sock")))
    assert "    decision_timeout_ms = 77,\n" in text
    assert '    client_max_body_size = "2m",\n' in text
    assert "    auth = true,\n" in text
    assert "    open_routes = { models = true, },\n" in text
    assert f'    socket = "unix:{tmp_path}/s.sock",\n' in text
    assert set(re.findall(r"^    ([a-z_]+) = ", text, re.M)) == rendered_names()


def test_lua_literals_cannot_break_out_of_their_string() -> None:
    assert lua_literal('X-"a"\\') == '"X-\\"a\\"\\\\"'
    assert lua_literal(False) == "false" and lua_literal(3) == "3"


def test_a_setting_never_configured_fails_loudly_at_its_first_use() -> None:
    """conf.lua holds no defaults: a hand-written configure() that misses a setting must not turn
    into nil arithmetic later. Run with the plain Lua interpreter luacheck brings (conf.lua is pure
    Lua), as Nginx's init_by_lua would load it."""
    script = (
        f'package.path = "{ROOT}/lua/?.lua;" .. package.path\n'
        'local conf = require("kvgate.conf")\n'
        "conf.configure({ decision_timeout_ms = 40 })\n"
        "assert(conf.decision_timeout_ms == 40 and conf.dict == 'kvgate')\n"
        "local ok, err = pcall(function() return conf.session_header end)\n"
        "assert(not ok and err:find('setting session_header was not configured', 1, true), err)\n"
        "local ok2, err2 = pcall(conf.configure, { dict = 'other' })\n"
        "assert(not ok2 and err2:find('dict is not a setting', 1, true), err2)\n"
        "print('ok')\n"
    )
    out = subprocess.run(["lua", "-"], input=script, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
