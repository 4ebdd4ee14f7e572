"""Every decision ends: after any mix of traffic, faults, client disconnects, a stalled sidecar and a
reload, an idle fleet shows no request in flight within 2 s. And stale keepalive connections to
backends never surface to clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, chat, inflight, start_backends

pytestmark = pytest.mark.e2e


def stream_body(conversation: int, words: int = 50, max_tokens: int = 20) -> bytes:
    body = chat(conversation, 1)
    body["messages"][-1]["content"] = " ".join(f"w{conversation}-{i}" for i in range(words))
    body.update(stream=True, max_tokens=max_tokens, ignore_eos=True)
    return json.dumps(body).encode()


def raw_stream(port: int, body: bytes, headers: dict[str, str], cut_after: int | None) -> None:
    """POST a streaming request; read ``cut_after`` bytes of the response (headers included) then
    drop the connection, or read it all when None."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n{head}\r\n"
            ).encode()
            + body
        )
        got = 0
        while cut_after is None or got < cut_after:
            chunk = s.recv(65536)
            if not chunk:
                return
            got += len(chunk)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST


def test_every_count_returns_to_zero_after_a_storm(stack: Supervisor) -> None:
    redis_port = free_port()
    stack.start_redis(redis_port)
    sim = start_backends(stack, 3)
    gw = Gateway(stack, "gw", redis_port, sim, 3)

    def fault(i: int, **f: Any) -> None:
        assert http_json("POST", f"http://127.0.0.1:{sim + i}/sim/faults", f)[0] == 200

    fault(1, fail_rate=0.5, fail_status=503)
    fault(2, abort_after_tokens=3)
    jobs: list[threading.Thread] = []

    def spawn(fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        jobs.append(t)

    for i in range(30):  # whole streams, some in sessions
        spawn(raw_stream, gw.port, stream_body(i), {"X-Session-ID": f"s{i % 7}"}, None)
    for i in range(10):  # clients gone after the headers, before the first token (a long prefill)
        spawn(raw_stream, gw.port, stream_body(100 + i, words=6000, max_tokens=5), {}, 200)
    for i in range(10):  # clients gone mid-stream
        spawn(raw_stream, gw.port, stream_body(200 + i, max_tokens=200), {}, 1500)
    big = {"model": MODEL, "prompt": "x " * 6_000_000, "max_tokens": 1}  # 12 MB: a slow body to read
    spawn(lambda: http_json("POST", gw.url + "/v1/completions", big, timeout=30))
    sidecar = stack.procs[gw.sidecar.name]
    os.kill(sidecar.pid, signal.SIGSTOP)  # decisions time out and fall open meanwhile
    for i in range(10):
        spawn(raw_stream, gw.port, stream_body(300 + i), {}, None)
    time.sleep(0.3)  # the stall being provoked, not a wait for readiness
    os.kill(sidecar.pid, signal.SIGCONT)
    os.kill(stack.procs[gw.replica.nginx_name].pid, signal.SIGHUP)  # a reload with streams open
    for i in range(10):
        spawn(raw_stream, gw.port, stream_body(400 + i), {}, None)
    for t in jobs:
        t.join(60)
    assert not any(t.is_alive() for t in jobs)
    for i in (1, 2):
        assert http_json("DELETE", f"http://127.0.0.1:{sim + i}/sim/faults")[0] == 200
    idle_at = time.monotonic()
    wait_until(lambda: inflight(gw) == (0, 0, 0), timeout=2.0)
    assert time.monotonic() - idle_at <= 2.0
    metrics = http_json("GET", gw.sidecar.http + "/metrics")[1]
    assert "kvgate_decisions_dropped_total" in metrics
    text = gw.error_log.read_text()
    assert "runtime error" not in text and "lua entry thread aborted" not in text


def test_stale_keepalive_connections_never_reach_a_client(stack: Supervisor) -> None:
    """Backends close idle connections after 1 s while Nginx keeps them 60 s: a request that lands on
    a connection the backend has closed goes round to a fresh one; the client sees only 200s."""
    sim = start_backends(stack, 2, "--keep-alive-s", "1")
    gw = Gateway(stack, "gw", None, sim, 2, upstream_keepalive_timeout="60s")
    for round_ in range(3):
        for i in range(6):
            status, body = http_json("POST", gw.url + "/v1/chat/completions", chat(50 * round_ + i, 1))
            assert status == 200, body
        time.sleep(1.5)  # longer than the backends' keep-alive: every pooled connection goes stale
    text = gw.error_log.read_text()
    assert "runtime error" not in text


def test_the_default_upstream_keepalive_outlives_no_backend_idle_close(stack: Supervisor) -> None:
    """With vLLM's 5 s idle close and the gateway's defaults, an idle pause never costs a retry."""
    sim = start_backends(stack, 1)
    gw = Gateway(stack, "gw", None, sim, 1)
    assert http_json("POST", gw.url + "/v1/chat/completions", chat(1, 1))[0] == 200
    time.sleep(5.5)  # past the backend's keep-alive: the idle pause is the scenario
    assert http_json("POST", gw.url + "/v1/chat/completions", chat(1, 2))[0] == 200
    before = http_json("GET", gw.sidecar.http + "/metrics")[1]
    assert 'kvgate_outcomes_total{backend="sim-0",status="502"}' not in before
