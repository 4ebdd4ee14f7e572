"""Security of the parts: Redis AUTH and TLS, membership entries from Redis checked against allowed
hosts, a dry-run /v1/decide, private files and socket, route headers off, normalized upstream paths."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from kvgate.config import BackendSpec, Config, ConfigError
from kvgate.membership import AddressPolicy
from kvgate.tools.decision_client import DecisionClient
from kvgate.tools.launcher import Supervisor, launch_replica
from kvgate.tools.readiness import free_port, wait_listening

from tests.conftest import http_json, wait_until
from tests.helpers import PATIENT_REDIS, Gateway, chat, sidecar_config, start_backends, start_sidecar

pytestmark = pytest.mark.e2e


def test_redis_with_a_password_and_a_sidecar_without_one(stack: Supervisor) -> None:
    port = free_port()
    stack.start_redis(port, "redis", "--requirepass", "s3cret")
    sim = start_backends(stack, 2)
    good = start_sidecar(stack, "good", port, sim, 2, redis_extra=PATIENT_REDIS)
    cfg_path = good.config_path
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["redis"]["password"] = "s3cret"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stack.stop(good.name)
    good.start()
    c = good.client()
    d = c.decide_body(chat(1, 1), {"X-Session-ID": "auth"})
    r = redis.Redis(port=port, password="s3cret", socket_timeout=2)
    # A lone sidecar answers before its claim; the binding lands just after.
    wait_until(lambda: r.get("kvgate:s:h:auth") is not None, timeout=2)
    assert r.get("kvgate:s:h:auth").decode() == d.candidates[0].id
    # Without the password the sidecar still routes (from memory) and says Redis is down.
    bad = start_sidecar(stack, "bad", port, sim, 2)
    cb = bad.client()
    assert cb.decide_body(chat(2, 1), {"X-Session-ID": "noauth"}).candidates
    assert http_json("GET", bad.http + "/healthz")[1]["redis"] == "down"
    assert r.get("kvgate:s:h:noauth") is None
    r.close()
    c.close()
    cb.close()


def test_redis_over_tls(stack: Supervisor, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    openssl = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(cert),
    ]
    subprocess.run(
        [*openssl, "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    port = free_port()
    tls = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    stack.spawn(
        "redis-tls",
        ["redis-server", "--save", "", "--dir", str(tmp_path), *tls],
        ready=lambda p: wait_listening(p, port=port),
    )
    sim = start_backends(stack, 2)
    cfg = sidecar_config(stack.run_dir / "tls.sock", free_port(), None, sim, 2)
    cfg["redis"] = {"url": f"rediss://127.0.0.1:{port}/0", "tls_ca_file": str(cert)}
    sc = launch_replica(stack, "tls", cfg)
    with DecisionClient(sc.socket) as c:
        d = c.decide_body(chat(3, 1), {"X-Session-ID": "over-tls"})
    r = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert), socket_timeout=2)
    wait_until(lambda: r.get("kvgate:s:h:over-tls") is not None, timeout=2)  # the claim lands after
    assert r.get("kvgate:s:h:over-tls").decode() == d.candidates[0].id
    r.close()


def rogue_is_refused(sc: Any, r: redis.Redis, name: str, host: str) -> socket.socket:
    """A listener on ``host`` registers itself through Redis (one HSET, one INCR): the sidecar counts
    it rejected, never lists it and never picks it. Returns the listener (for its address)."""
    listener = socket.socket()
    listener.bind((host, 0))
    listener.listen(16)
    entry = {"id": name, "url": f"http://{host}:{listener.getsockname()[1]}", "weight": 100.0}
    r.hset("kvgate:backends", name, json.dumps({**entry, "labels": {}, "draining": False}))
    r.incr("kvgate:backends:v")
    wait_until(
        lambda: "kvgate_membership_rejected_total 1.0" in http_json("GET", sc.http + "/metrics")[1], timeout=5
    )
    assert name not in sc.backends()
    with sc.client() as c:
        assert all(c.decide_body(chat(i, 1)).candidates[0].id != name for i in range(20))
    return listener


def test_membership_entries_from_redis_must_match_the_allowed_hosts(stack: Supervisor) -> None:
    """One HSET and one INCR used to send prompts to any listener."""
    port = free_port()
    stack.start_redis(port)
    sim = start_backends(stack, 2)
    sc = start_sidecar(stack, "a", port, sim, 2)
    r = redis.Redis(port=port, socket_timeout=2)
    listener = rogue_is_refused(sc, r, "evil", "127.0.0.2")
    status, body = sc.admin("POST", "/admin/backends", {"id": "evil2", "url": "http://10.1.2.3:8000"})
    assert status == 400 and "membership.allow" in body["error"]["message"]
    listener.close()
    r.close()


def test_a_listener_on_another_port_of_a_backend_host_is_never_adopted(stack: Supervisor) -> None:
    """The rogue shares a host with the real backends (127.0.0.1) and registers itself through
    Redis: the default policy admits exactly the configured addresses, and allow entries name ports
    (a host alone is refused at startup, since it admitted every port of that host)."""
    port = free_port()
    stack.start_redis(port)
    sim = start_backends(stack, 2)
    r = redis.Redis(port=port, socket_timeout=2)
    sc = start_sidecar(stack, "a", port, sim, 2)
    listener = rogue_is_refused(sc, r, "rogue", "127.0.0.1")
    rogue_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(ConfigError, match="must name a host and its ports"):
        Config.from_mapping(
            {**sidecar_config(Path("s"), 1, port, sim, 2), "membership": {"allow": ["127.0.0.1"]}}, {}
        )
    # A port range admits what is in it, and only that.
    allowed = Config.from_mapping(
        {
            **sidecar_config(Path("s"), 1, port, sim, 2),
            "membership": {"allow": [f"127.0.0.1:{sim}-{sim + 9}"]},
        },
        {},
    )
    policy = AddressPolicy(allowed.membership, allowed.backends)
    assert policy.allows(BackendSpec("in", f"http://127.0.0.1:{sim + 9}"))
    assert not policy.allows(BackendSpec("rogue", rogue_url))
    listener.close()
    r.close()


def test_files_and_socket_are_private(tmp_path: Path) -> None:
    """kvgate up: the admin token and the config holding it are 0600, the socket 0660."""
    from tests.e2e.test_cli_up import KVGATE

    run_dir = tmp_path / "run"
    port, sim, redis_port, sidecar = free_port(), free_port(), free_port(), free_port()
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    argv = [KVGATE, "up", "--run-dir", str(run_dir), "--port", str(port), "--sim-port", str(sim)]
    argv += ["--backends", "1", "--redis-port", str(redis_port), "--sidecar-port", str(sidecar)]
    up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "kvgate is up" in (tmp_path / "up.log").read_text(), timeout=40)
        for name in ("admin-token", "kvgate-sidecar.yaml"):
            assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
        mode = (run_dir / "sidecar.sock").stat()
        assert stat.S_IMODE(mode.st_mode) == 0o660
        if os.geteuid() == 0:
            import grp

            assert grp.getgrgid(mode.st_gid).gr_name == "nogroup"  # the workers' group, not root's
            workers = subprocess.run(["ps", "-eo", "user,cmd"], capture_output=True, text=True).stdout
            assert any(line.startswith("nobody") and "nginx: worker" in line for line in workers.splitlines())
    finally:
        up.terminate()
        up.wait(timeout=30)
        log.close()


def test_route_headers_off_from_the_config_and_the_upstream_path_is_normalized(stack: Supervisor) -> None:
    sim = start_backends(stack, 1)
    gw = Gateway(stack, "gw", None, sim, 1, route_headers=False)
    body = json.dumps(chat(1, 1)).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/./chat//completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 200") and b"X-Kvgate-Backend" not in head, head


def test_the_example_config_turns_route_headers_off(tmp_path: Path) -> None:
    from kvgate.cli import main

    root = Path(__file__).resolve().parents[2]
    assert main(["render-nginx", "--config", str(root / "kvgate.example.yaml"), "--out", str(tmp_path)]) == 0
    assert "route_headers = false" in (tmp_path / "kvgate-http.conf").read_text()


def test_config_secrets_are_not_printed(tmp_path: Path) -> None:
    from kvgate.config import Config

    one = {"backends": [{"url": "http://127.0.0.1:8001"}]}
    c = Config.from_mapping({**one, "redis": {"password": "hunter2"}}, {"KVGATE_ADMIN_TOKEN": "tok"})
    assert "hunter2" not in repr(c.redis)
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    assert Config.from_mapping({**one, "redis": {"password_file": str(pw)}}, {}).redis.password == "from-file"
    env: dict[str, Any] = {"KVGATE_REDIS_PASSWORD": "0123"}
    assert Config.from_mapping(one, env).redis.password == "0123"  # taken as written, not as a number
