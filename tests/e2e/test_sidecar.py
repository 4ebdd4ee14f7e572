"""The sidecar against a real redis-server and real simulator backends over HTTP."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from kvgate import protocol
from kvgate.features import extract
from kvgate.messages import ErrorCode, ErrorReply, PeersQuery, PeersReply
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import http_json, wait_until
from tests.helpers import PATIENT_REDIS, chat, start_backends, start_sidecar


@pytest.fixture
def redis_port(stack: Supervisor) -> int:
    port = free_port()
    stack.start_redis(port)
    return port


def test_two_sidecars_on_one_redis_agree_on_every_binding(stack: Supervisor, redis_port: int) -> None:
    sim = start_backends(stack, 3)
    a = start_sidecar(stack, "a", redis_port, sim, 3, redis_extra=PATIENT_REDIS)
    b = start_sidecar(stack, "b", redis_port, sim, 3, redis_extra=PATIENT_REDIS)
    ca, cb = a.client(), b.client()
    for i in range(60):
        body = {"model": "sim-model", "messages": [{"role": "user", "content": f"hello {i}"}]}
        first = (ca if i % 2 else cb).decide_body(body, {"X-Session-ID": f"s{i}"})
        second = (cb if i % 2 else ca).decide_body(body, {"X-Session-ID": f"s{i}"})
        assert first.candidates[0] == second.candidates[0], i
        assert second.route == "session"
    ca.close()
    cb.close()


def test_sessions_survive_a_sidecar_restart(stack: Supervisor, redis_port: int) -> None:
    sim = start_backends(stack, 3)
    sc = start_sidecar(stack, "a", redis_port, sim, 3, redis_extra=PATIENT_REDIS)
    c = sc.client()
    bound = {i: c.decide_body(chat(i, 1)).candidates[0].id for i in range(30)}
    c.close()
    stack.stop(sc.name)
    sc.start()
    c = sc.client()
    after = {i: c.decide_body(chat(i, 2)) for i in range(30)}
    assert all(after[i].candidates[0].id == bound[i] and after[i].route == "session" for i in range(30))
    c.close()


def test_redis_down_routes_from_memory_and_recovers(stack: Supervisor, redis_port: int) -> None:
    sim = start_backends(stack, 3)
    sc = start_sidecar(stack, "a", redis_port, sim, 3)
    c = sc.client()
    before = c.decide_body(chat(1, 1))
    stack.stop("redis")
    during = [c.decide_body(chat(1, 2)), c.decide_body(chat(2, 1)), c.decide_body(chat(2, 2))]
    assert during[0].candidates[0] == before.candidates[0], "the local map keeps the session"
    assert during[2].candidates[0] == during[1].candidates[0]
    # Alone on its Redis, the sidecar answers before its claims return, so it learns that Redis is
    # gone when the first of them fails, just after the decision that made it.
    wait_until(lambda: http_json("GET", sc.http + "/healthz")[1]["redis"] == "down", timeout=2)
    metrics = http_json("GET", sc.http + "/metrics")[1]
    assert "kvgate_redis_fallbacks_total" in metrics and "kvgate_redis_errors_total" in metrics
    stack.start_redis(redis_port)
    r = redis.Redis(port=redis_port, socket_timeout=2)
    key = extract(chat(2, 1)).key
    # The next decisions after the retry interval reach Redis again and write back the binding made
    # while it was down.
    wait_until(lambda: bool(c.decide_body(chat(5, 1))) and r.get(f"kvgate:s:{key}") is not None, timeout=5)
    assert r.get(f"kvgate:s:{key}").decode() == during[1].candidates[0].id
    fresh = extract(chat(6, 1)).key
    d = c.decide_body(chat(6, 1))
    # The claim lands just after the decision (a lone sidecar does not wait for it).
    wait_until(lambda: r.get(f"kvgate:s:{fresh}") is not None, timeout=2)
    assert r.get(f"kvgate:s:{fresh}").decode() == d.candidates[0].id
    r.close()
    c.close()


def test_unhealthy_backend_is_skipped_and_readmitted(stack: Supervisor, redis_port: int) -> None:
    sim = start_backends(stack, 3)
    sc = start_sidecar(stack, "a", redis_port, sim, 3)
    victim = f"http://127.0.0.1:{sim + 1}"
    http_json("POST", victim + "/sim/faults", {"unhealthy": True})
    wait_until(lambda: sc.backends()["sim-1"]["state"] == "unhealthy", timeout=5)
    c = sc.client()
    picks = {c.decide_body(chat(i, 1)).candidates[0].id for i in range(40)}
    assert "sim-1" not in picks
    peers = c.call(PeersQuery())
    assert isinstance(peers, PeersReply) and {p.id for p in peers.peers} == {"sim-0", "sim-2"}
    http_json("DELETE", victim + "/sim/faults")
    wait_until(lambda: sc.backends()["sim-1"]["state"] == "healthy", timeout=5)
    again = c.call(PeersQuery())
    assert isinstance(again, PeersReply) and again.version > peers.version
    c.close()


def test_garbage_metrics_leave_a_backend_in_with_unknown_load_and_a_failed_health_takes_it_out(
    stack: Supervisor,
) -> None:
    """Metrics that cannot be read are a missing signal (the error is shown, the load goes
    unknown); /health answering 503 is a dead server."""
    sim = start_backends(stack, 2)
    sc = start_sidecar(stack, "a", None, sim, 2)
    http_json("POST", f"http://127.0.0.1:{sim}/sim/faults", {"metrics": "garbage"})
    wait_until(lambda: "no request gauges" in str(sc.backends()["sim-0"]["last_error"]), timeout=5)
    wait_until(lambda: not sc.backends()["sim-0"]["load"]["known"], timeout=5)
    assert sc.backends()["sim-0"]["state"] == "healthy"
    http_json("POST", f"http://127.0.0.1:{sim}/sim/faults", {"unhealthy": True})
    wait_until(lambda: sc.backends()["sim-0"]["state"] == "unhealthy", timeout=5)
    assert "/health answered 503" in sc.backends()["sim-0"]["last_error"]


def test_membership_changes_reach_every_sidecar(stack: Supervisor, redis_port: int) -> None:
    sim = start_backends(stack, 3)
    # Backends added at run time must be allowed by address, on every replica that adopts them.
    allow = {"membership": {"allow": [f"127.0.0.1:{sim}-{sim + 2}"]}}
    a = start_sidecar(stack, "a", redis_port, sim, 2, extra=allow)  # knows sim-0, sim-1
    b = start_sidecar(stack, "b", redis_port, sim, 2, extra=allow)
    assert a.admin("POST", "/admin/backends", {"id": "sim-2", "url": f"http://127.0.0.1:{sim + 2}"})[0] == 201
    wait_until(lambda: "sim-2" in b.backends(), timeout=3)
    assert a.admin("POST", "/admin/backends/sim-0/drain")[0] == 200
    wait_until(lambda: b.backends()["sim-0"]["state"] == "draining", timeout=3)
    cb = b.client()
    assert "sim-0" not in {cb.decide_body(chat(i, 1)).candidates[0].id for i in range(30)}
    assert a.admin("DELETE", "/admin/backends/sim-0")[0] == 200
    wait_until(lambda: "sim-0" not in b.backends(), timeout=3)
    assert http_json("POST", a.http + "/admin/backends", {"url": "http://x:1"})[0] == 401
    cb.close()


def test_unknown_model_is_refused(stack: Supervisor) -> None:
    sim = start_backends(stack, 1)
    sc = start_sidecar(stack, "a", None, sim, 1)
    c = sc.client()
    reply = c.decide(extract({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}))
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNKNOWN_MODEL
    assert http_json("GET", sc.http + "/v1/models")[1]["data"][0]["id"] == "sim-model"
    c.close()


def test_shared_system_prompt_200_conversations_spread_within_bound_and_stick(
    stack: Supervisor, redis_port: int
) -> None:
    sim = start_backends(stack, 4)
    sc = start_sidecar(stack, "a", redis_port, sim, 4, redis_extra=PATIENT_REDIS)
    c = sc.client()
    # Turn 1 of every conversation is in flight at once: the bounded walk spreads the new keys.
    first = {conv: c.decide_body(chat(conv, 1)) for conv in range(200)}
    home = {conv: d.candidates[0].id for conv, d in first.items()}
    for d in first.values():
        c.finish(d)
    for turn in (2, 3):
        for conv in range(200):
            d = c.decide_body(chat(conv, turn))
            assert d.candidates[0].id == home[conv] and d.route == "session", (conv, turn, d.route)
            c.finish(d)
    counts = Counter(home.values())
    assert len(counts) == 4
    assert max(counts.values()) <= math.ceil(1.25 * 200 / 4), counts
    c.close()


def test_sighup_and_admin_reload_apply_the_config_file(stack: Supervisor, redis_port: int) -> None:
    import signal

    import yaml

    sim = start_backends(stack, 3)
    sc = start_sidecar(stack, "a", redis_port, sim, 2)
    cfg = yaml.safe_load(sc.config_path.read_text())
    cfg["backends"].append({"id": "sim-2", "url": f"http://127.0.0.1:{sim + 2}"})
    sc.config_path.write_text(yaml.safe_dump(cfg))
    stack.procs[sc.name].send_signal(signal.SIGHUP)
    wait_until(lambda: "sim-2" in sc.backends(), timeout=3)
    cfg["backends"] = cfg["backends"][1:]
    sc.config_path.write_text(yaml.safe_dump(cfg))
    assert sc.admin("POST", "/admin/reload")[0] == 200
    assert "sim-0" not in sc.backends()
    sc.config_path.write_text("backends: [{url: ftp://bad}]")
    status, body = sc.admin("POST", "/admin/reload")
    assert status == 400 and "backends[0].url" in body["error"]["message"]
    assert set(sc.backends()) == {"sim-1", "sim-2"}


def test_hostile_bytes_on_the_socket_get_an_error_and_the_sidecar_lives(stack: Supervisor) -> None:
    """Lone surrogates (raw or escaped), bytes that are not UTF-8 and non-finite numbers are refused
    one line at a time; the connection and the process stay up."""
    import socket

    sim = start_backends(stack, 2)
    sc = start_sidecar(stack, "a", None, sim, 2)
    lines = [
        b'{"pv":4,"op":"decide","i":"a","f":{"m":"sim-model","k":"h:\xed\xa0\x80","ks":"header","b":1}}',
        b'{"pv":4,"op":"decide","i":"a","f":{"m":"sim-model","k":"h:\\ud800","ks":"header","b":1}}',
        b'{"pv":4,"op":"decide","i":"a","f":{"m":"sim-\xff","k":"h:x","ks":"header","b":1}}',
        b'{"pv":4,"op":"decide","i":"a","f":{"m":"sim-model","k":"u:x","ks":"user","b":Infinity}}',
        b'{"pv":4,"op":"report","o":[{"k":"end","i":Infinity,"b":"sim-0","s":200}]}',
        b'{"pv":4,"op":"decide","i":"a","f":{"m":"sim-model","h":[{"x":1}],"b":1}}',
        b'{"op":"decide","i":"a","f":{"m":"sim-model","b":1}}',
    ]
    assert protocol.VERSION == 4  # the lines above speak version 4
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sc.socket))
        f = s.makefile("rwb")
        for line in lines:
            f.write(line + b"\n")
            f.flush()
            if b'"report"' in line:
                continue
            reply = json.loads(f.readline())
            assert reply["e"] in ("bad_request", "protocol_version"), (line, reply)
        f.write(b'{"pv":4,"op":"peers"}\n')
        f.flush()
        assert len(json.loads(f.readline())["peers"]) == 2
    c = sc.client()
    assert c.decide_body(chat(1, 1)).candidates
    c.close()
    assert stack.alive()[sc.name]


def test_a_sidecar_on_uvloop_decides_like_one_on_asyncio(tmp_path: Path, redis_port: int) -> None:
    """`kvgate sidecar --event-loop uvloop` serves the socket and the HTTP API; its decisions agree
    with an asyncio sidecar's on the same Redis."""
    import os

    uv_stack = Supervisor(tmp_path / "uv", sidecar_args=("--event-loop", "uvloop"))
    plain_stack = Supervisor(tmp_path / "plain")
    try:
        sim = start_backends(plain_stack, 3)
        uv = start_sidecar(uv_stack, "uv", redis_port, sim, 3, redis_extra=PATIENT_REDIS)
        plain = start_sidecar(plain_stack, "plain", redis_port, sim, 3, redis_extra=PATIENT_REDIS)
        pid = http_json("GET", uv.http + "/healthz")[1]["pid"]
        with open(f"/proc/{pid}/maps") as maps:
            assert "uvloop" in maps.read()  # the loop really is libuv's
        cu, cp = uv.client(), plain.client()
        for i in range(20):
            body = {"model": "sim-model", "messages": [{"role": "user", "content": f"uv {i}"}]}
            first = cu.decide_body(body, {"X-Session-ID": f"uv{i}"})
            assert cp.decide_body(body, {"X-Session-ID": f"uv{i}"}).candidates[0] == first.candidates[0]
        # The memory diagnosis on a real process: a collection, the live objects by type, and where
        # the suspended coroutines wait (the socket's readers among them).
        status, full = plain.admin("GET", "/debug/memory?objects=1")
        assert status == 200 and full["objects"]["dict"] > 0 and full["collected"] >= 0
        # What imports left is frozen at startup, so full collections (and this walk) skip it: the
        # walk lists what the sidecar made since.
        assert full["frozen"] > 10_000 and sum(full["objects"].values()) < full["frozen"]
        assert full["coroutines"] and all(" line " in site for site in full["coroutines"])
        cu.close()
        cp.close()
        assert os.path.exists(uv.socket)
    finally:
        uv_stack.stop_all()
        plain_stack.stop_all()


def test_a_stopped_sidecar_reports_the_stall_in_its_loop_lag(stack: Supervisor) -> None:
    sim = start_backends(stack, 1)
    sc = start_sidecar(stack, "a", None, sim, 1)

    def lag() -> tuple[float, float]:
        """(observations, observations over 0.25 s) of the sidecar's event-loop lag."""
        text = http_json("GET", sc.http + "/metrics")[1]
        samples = {
            (s.name, s.labels.get("le")): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if fam.name in ("kvgate_event_loop_lag_seconds", "kvgate_cpu_wait_seconds")
        }
        assert ("kvgate_cpu_wait_seconds_total", None) in samples  # Linux: the kernel's run-queue wait
        count = samples[("kvgate_event_loop_lag_seconds_count", None)]
        return count, count - samples[("kvgate_event_loop_lag_seconds_bucket", "0.25")]

    wait_until(lambda: lag()[0] > 0, timeout=5)
    stalls = lag()[1]
    pid = stack.procs[sc.name].pid
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.4)  # the stall being provoked
    os.kill(pid, signal.SIGCONT)
    wait_until(lambda: lag()[1] >= stalls + 1, timeout=5)


def test_a_burst_of_new_connections_waits_in_the_backlog_not_refused(stack: Supervisor) -> None:
    """A cold burst of clients makes Nginx's workers open one connection per decision at once: while
    the sidecar is not accepting (stopped here), 300 connections wait in the listen backlog, where
    asyncio's default of 100 refused the 101st at once (EAGAIN) and its request fell open."""
    sim = start_backends(stack, 1)
    sc = start_sidecar(stack, "a", None, sim, 1)
    pid = stack.procs[sc.name].pid
    socks: list[socket.socket] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX)
            socks.append(s)
            s.settimeout(5)
            s.connect(str(sc.socket))
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        last = socks[-1]  # accepted and served once the sidecar runs again
        last.sendall(protocol.line(protocol.encode_message(PeersQuery())))
        reply = protocol.decode_reply(json.loads(last.makefile("rb").readline()))
        assert isinstance(reply, PeersReply) and reply.peers
    finally:
        for s in socks:
            s.close()
