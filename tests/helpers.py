"""Test helpers: gateway replicas and sidecars started by the project's one launcher."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgate.config import Config
from kvgate.nginx_conf import NginxSettings
from kvgate.tools.decision_client import DecisionClient
from kvgate.tools.launcher import Replica, Supervisor, launch_replica
from kvgate.tools.readiness import free_port, free_ports

from tests.conftest import MODEL, http_json

ROOT = Path(__file__).resolve().parents[1]  # the checkout


def sidecar_config(
    socket_path: Path,
    http_port: int,
    redis_port: int | None,
    sim_port: int,
    n: int,
    redis_extra: Mapping[str, Any] | None = None,
    **routing: Any,
) -> dict[str, Any]:
    redis: dict[str, Any] = {
        "url": None if redis_port is None else f"redis://127.0.0.1:{redis_port}/0",
        "retry_after_ms": 200,
        **(redis_extra or {}),
    }
    return {
        "listen": {"socket": str(socket_path), "http_port": http_port, "admin_token": "test-token"},
        "redis": redis,
        "scrape": {
            "interval_ms": 100,
            "timeout_ms": 80,
            "stale_after_ms": 1000,
            "unhealthy_after": 2,
            "healthy_after": 2,
            "membership_refresh_ms": 200,
        },
        "routing": routing,
        "backends": [{"id": f"sim-{i}", "url": f"http://127.0.0.1:{sim_port + i}"} for i in range(n)],
    }


class Sidecar:
    """A test stack's sidecar: its socket, HTTP API and admin calls."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.stack = replica.sup
        self.socket = replica.socket
        self.name = replica.sidecar_name
        self.http = replica.http
        self.config_path = replica.config_path

    def start(self) -> None:
        self.replica.start_sidecar()

    def client(self) -> DecisionClient:
        return DecisionClient(self.socket)

    def backends(self) -> dict[str, dict[str, Any]]:
        return {b["id"]: b for b in http_json("GET", self.http + "/v1/backends")[1]["backends"]}

    def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return http_json(method, self.http + path, body, {"Authorization": "Bearer test-token"})


# Redis budgets for tests of what Redis answers (agreement between replicas, bindings that persist):
# on a busy machine a connect or a round trip can pass the defaults (50 ms to connect and 20 ms per
# command before Redis is marked down; past a 10 ms wait a decision goes on unconfirmed), and those
# answers are what these tests check. The defaults have tests of their own.
PATIENT_MS = 2000
PATIENT_REDIS = {"timeout_ms": PATIENT_MS, "connect_timeout_ms": PATIENT_MS, "decision_wait_ms": PATIENT_MS}


def start_sidecar(
    stack: Supervisor,
    name: str,
    redis_port: int | None,
    sim_port: int,
    n: int,
    redis_extra: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    **routing: Any,
) -> Sidecar:
    """A sidecar alone (no Nginx) over ``n`` simulated backends from ``sim_port``; ``extra``: more
    config sections."""
    cfg = {
        **sidecar_config(
            stack.run_dir / f"{name}.sock", free_port(), redis_port, sim_port, n, redis_extra, **routing
        ),
        **(extra or {}),
    }
    return Sidecar(launch_replica(stack, name, cfg))


def start_backends(stack: Supervisor, n: int, *extra: str) -> int:
    port = free_ports(n)
    stack.start_sim(port, n, "sim", "--model", MODEL, *extra)
    return port


def chat(conversation: int, turns: int, system: str = "You are a helpful assistant. " * 60) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {conversation} question {t} " * 20})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t} " * 40})
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


class Gateway:
    """A full kvgate gateway replica: sidecar + Nginx with the project's Lua, sharing Redis and backends."""

    def __init__(
        self,
        stack: Supervisor,
        name: str,
        redis_port: int | None,
        sim_port: int,
        n: int,
        client_max_body_size: str = "16m",
        route_headers: bool | None = True,  # None: the config's default
        first_byte_timeout_ms: int = 60_000,
        upstream_keepalive_timeout: str = "4s",
        decision_timeout_ms: int = 50,
        extra: dict[str, Any] | None = None,
        **routing: Any,
    ) -> None:
        """``extra``: more config sections (auth, limits, ...). One config drives both halves: the
        sidecar reads it, and Nginx's settings are rendered from it (``NginxSettings.from_config``)."""
        self.stack = stack
        self.name = name
        self.sim_port, self.n = sim_port, n
        run_dir = stack.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        socket = stack.run_dir / f"{name}.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        gateway: dict[str, Any] = {
            "client_max_body_size": client_max_body_size,
            "first_byte_timeout_ms": first_byte_timeout_ms,
            "decision_timeout_ms": decision_timeout_ms,
        }
        if route_headers is not None:
            gateway["route_headers"] = route_headers
        cfg = {**sidecar_config(socket, free_port(), redis_port, sim_port, n, **routing), **(extra or {})}
        cfg["gateway"] = {**gateway, **cfg.get("gateway", {})}
        self.settings = NginxSettings.from_config(
            Config.from_mapping(cfg, {}),
            listen=f"127.0.0.1:{self.port}",
            run_dir=str(run_dir),
            workers=2,
            client_body_buffer_size="1m",
            upstream_keepalive_timeout=upstream_keepalive_timeout,
        )
        self.replica = launch_replica(stack, name, cfg, self.settings)
        self.sidecar = Sidecar(self.replica)
        self.error_log = run_dir / "nginx-error.log"

    def start_nginx(self) -> None:
        self.replica.start_nginx()


def priorities(gw: Gateway) -> Counter[int]:
    """The chat and completion requests the gateway's simulated backends got, by the priority their
    bodies carried (none: 0), summed over the backends (``/sim/info``)."""
    out: Counter[int] = Counter()
    for port in range(gw.sim_port, gw.sim_port + gw.n):
        info = http_json("GET", f"http://127.0.0.1:{port}/sim/info")[1]
        out.update({int(p): n for p, n in info["priorities"].items()})
    return out


def inflight(gw: Gateway) -> tuple[int, int, int]:
    """The fleet's requests, prompt tokens and KV cache tokens in flight, as the gateway's sidecar
    counts them."""
    backends = gw.sidecar.backends().values()
    return (
        sum(b["inflight"] for b in backends),
        sum(b["inflight_tokens"] for b in backends),
        sum(b["inflight_kv_tokens"] for b in backends),
    )
