"""One config for both halves, through real Nginx, sidecar and simulated backends: Nginx rendered from
another config refuses requests and says why; rendered from the sidecar's, it enforces its keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvgate.config import Config, hash_key
from kvgate.nginx_conf import NginxSettings
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port

from tests.conftest import http_json, wait_until
from tests.e2e.test_auth_limits import call
from tests.helpers import sidecar_config, start_backends

KEY = "sk-team-a-0123456789"


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
