"""One config for both halves: Nginx's settings carry a fingerprint of the config they were rendered
from, the sidecar compares it with its own, and where API keys or rate limits differ Nginx refuses
requests instead of serving them unchecked. Unit checks of the fingerprint, then the pod's container
split through real Nginx, sidecar and simulated backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvgate.agreement import Agreement
from kvgate.config import Config, hash_key
from kvgate.nginx_conf import NginxSettings
from kvgate.tools.launcher import Supervisor, free_port, launch_replica

from tests.conftest import http_json, wait_until
from tests.helpers import sidecar_config, start_backends
from tests.test_auth_limits import call

KEY = "sk-team-a-0123456789"


def cfg(**sections: Any) -> Config:
    return Config.from_mapping({"backends": [{"url": "http://10.0.0.1:8000"}], **sections}, {})


def test_a_render_and_its_sidecar_agree_and_any_gateway_setting_changes_the_fingerprint() -> None:
    base = cfg()
    assert NginxSettings.from_config(base, listen="0.0.0.0:80").fingerprint == Agreement(base).fingerprint
    others = [
        cfg(gateway={"route_headers": True}),
        cfg(auth={"keys": [{"name": "a", "sha256": hash_key(KEY)}]}),
        cfg(limits={"per_key": {"requests_per_minute": 10}}),
        cfg(gateway={"first_byte_timeout_ms": 30_000}),
        cfg(routing={"session_header": "X-Conversation"}),
    ]
    prints = {Agreement(c).fingerprint for c in [base, *others]}
    assert len(prints) == 1 + len(others)
    # A setting overridden at render time is what Nginx runs: the fingerprint says so.
    overridden = NginxSettings.from_config(base, route_headers=True)
    assert overridden.fingerprint == Agreement(others[0]).fingerprint
    # Deployment details (where Nginx listens, its workers) are not the config's.
    assert NginxSettings.from_config(base, workers=8).fingerprint == Agreement(base).fingerprint


def test_the_sidecar_says_mismatch_while_a_gateway_with_other_settings_asks() -> None:
    a = Agreement(cfg())
    assert a.state(0.0) == "unknown"
    assert a.observe(a.fingerprint, 1.0) and a.state(1.0) == "ok"
    assert not a.observe("0123456789abcdef", 2.0) and a.state(2.0) == "mismatch"
    assert a.observe(a.fingerprint, 20.0) and a.state(20.0) == "ok"  # the other one went away


def keyed(socket: Path, sim: int) -> dict[str, Any]:
    """The sidecar's config as the pod's ConfigMap gives it: keys on, route headers off."""
    c = sidecar_config(socket, free_port(), None, sim, 2)
    c["auth"] = {"keys": [{"name": "team-a", "sha256": hash_key(KEY)}]}
    c["gateway"] = {"route_headers": False}
    return c


def nginx_from(config: dict[str, Any], run_dir: Path) -> NginxSettings:
    return NginxSettings.from_config(
        Config.from_mapping(config, {}), listen=f"127.0.0.1:{free_port()}", run_dir=str(run_dir), workers=2
    )


@pytest.mark.e2e
def test_nginx_rendered_from_another_config_refuses_requests_and_says_why(
    stack: Supervisor, tmp_path: Path
) -> None:
    """The split that left keys off in containers: the sidecar has auth keys and route headers off,
    Nginx was rendered from a config without them (an image's baked-in file). Requests used to be
    served without a key, with X-Kvgate-Backend; now every one gets a 503, /kvgate/health answers 503
    'unsafe', the sidecar's /healthz says 'mismatch' and its log has the error."""
    sim = start_backends(stack, 2)
    socket = stack.run_dir / "gw.sock"
    sidecar_cfg = keyed(socket, sim)
    image_cfg = {k: v for k, v in sidecar_cfg.items() if k not in ("auth", "gateway")}
    gw = launch_replica(stack, "gw", sidecar_cfg, nginx_from(image_cfg, tmp_path / "nginx"))
    url = f"http://127.0.0.1:{gw.port}"
    wait_until(lambda: http_json("GET", url + "/kvgate/health")[0] == 503, timeout=5)
    status, health = http_json("GET", url + "/kvgate/health")
    assert status == 503 and health["config"] == "unsafe" and health["status"] == "down"
    for key in (None, "wrong", KEY):
        code, headers, body = call(url, key)
        assert code == 503 and "misconfigured" in body["error"]["message"], (key, code, body)
        assert "X-Kvgate-Backend" not in headers
    sidecar_health = http_json("GET", gw.http + "/healthz")[1]
    assert sidecar_health["config"] == "mismatch" and sidecar_health["status"] == "degraded"
    assert "kvgate_config_mismatch 1.0" in http_json("GET", gw.http + "/metrics")[1]
    log = (stack.run_dir / f"{gw.sidecar_name}.log").read_text()
    assert "config mismatch" in log


@pytest.mark.e2e
def test_nginx_rendered_from_the_sidecars_config_enforces_its_keys(stack: Supervisor, tmp_path: Path) -> None:
    """Both halves from one config: no key and a wrong key get 401, the right key is served, and
    the route headers the config turned off are not sent."""
    sim = start_backends(stack, 2)
    sidecar_cfg = keyed(stack.run_dir / "gw.sock", sim)
    gw = launch_replica(stack, "gw", sidecar_cfg, nginx_from(sidecar_cfg, tmp_path / "nginx"))
    url = f"http://127.0.0.1:{gw.port}"
    wait_until(lambda: http_json("GET", url + "/kvgate/health")[1]["config"] == "ok", timeout=5)
    assert call(url, None)[0] == 401 and call(url, "wrong")[0] == 401
    code, headers, _ = call(url, KEY)
    assert code == 200 and "X-Kvgate-Backend" not in headers
    assert http_json("GET", gw.http + "/healthz")[1]["config"] == "ok"
