"""A real gateway whose only backends come from resolving a DNS name."""

from __future__ import annotations

from pathlib import Path

from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, start_backends


def test_a_gateway_routes_to_backends_it_found_by_resolving_a_name(tmp_path: Path) -> None:
    """No backend listed: the sidecar resolves `localhost` (as it would a headless Service) and the
    simulator on its port serves the requests the real Nginx sends."""
    stack = Supervisor(tmp_path / "run")
    try:
        redis_port = free_port()
        stack.start_redis(redis_port)
        sim = start_backends(stack, 1)
        gw = Gateway(
            stack,
            "gw",
            redis_port,
            sim,
            0,
            extra={"discovery": [{"dns": "localhost", "port": sim, "interval_ms": 500}]},
        )
        expected = f"localhost@127.0.0.1:{sim}"
        wait_until(lambda: gw.sidecar.backends().get(expected, {}).get("state") == "healthy", timeout=10)
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "found by DNS"}]}
        for _ in range(3):
            status, _ = http_json("POST", gw.url + "/v1/chat/completions", body)
            assert status == 200
        wait_until(lambda: gw.sidecar.backends()[expected]["inflight"] == 0, timeout=2)  # reports arrive
        assert http_json("GET", gw.url + "/kvgate/health")[1]["eligible_backends"] >= 1
    finally:
        stack.stop_all()
