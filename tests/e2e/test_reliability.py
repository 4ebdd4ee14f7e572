"""Never the reason a request fails: what the gateway accepts, what counts against a backend, and
what a backend that cuts, hangs or fails costs the clients. All through real Nginx, sidecar, Redis and
simulated backends."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, chat, start_backends

pytestmark = pytest.mark.e2e


class Stack:
    def __init__(self, sup: Supervisor, n: int = 3, **kw: Any) -> None:
        self.redis_port = free_port()
        sup.start_redis(self.redis_port)
        self.sim = start_backends(sup, n)
        self.n = n
        self.gw = Gateway(sup, "gw", self.redis_port, self.sim, n, **kw)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.sim + i}"

    def fault(self, i: int, **f: Any) -> None:
        assert http_json("POST", self.url(i) + "/sim/faults", f)[0] == 200

    def backends(self) -> dict[str, dict[str, Any]]:
        return self.gw.sidecar.backends()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    sup = Supervisor(tmp_path_factory.mktemp("reliability") / "run")
    try:
        yield Stack(sup)
    finally:
        sup.stop_all()


def raw(port: int, request: bytes) -> tuple[int, Any]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return status, json.loads(body)


def post(port: int, body: bytes, extra: str = "") -> tuple[int, Any]:
    return raw(
        port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + extra.encode()
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body,
    )


MSG = b'"messages":[{"role":"user","content":"hi"}]'


@pytest.mark.parametrize(
    "body, extra, param",
    [
        (b"[1, 2]", "", None),
        (b'{"model":"sim-model",' + MSG + b',"max_tokens":NaN}', "", None),
        (b'{"model":"sim-model",' + MSG + b',"max_tokens":0x10}', "", None),
        (b'{"model":"sim-model",' + MSG + b',"max_tokens":1e400}', "", "max_tokens"),
        (b'{"model":"sim-model",' + MSG + b',"max_tokens":"5"}', "", "max_tokens"),
        (b'{"model":"sim-model",' + MSG + b',"max_tokens":2.5}', "", "max_tokens"),
        (b'{"model":"sim-model",' + MSG + b',"stream":"yes"}', "", "stream"),
        (b'{"model":"sim-model",' + MSG + b',"n":0}', "", "n"),
        (b'{"model":"sim-model",' + MSG + b',"n":129}', "", "n"),  # each an engine request in vLLM
        (b'{"model":"sim-model","prompt":["a","b","c"],"n":43}', "", "n"),  # 129 with the batch's 3
        (b'{"model":"sim-model",' + MSG + b',"n":2.5}', "", "n"),
        (b'{"model":"sim-model",' + MSG + b',"n":"2"}', "", "n"),
        (b'{"model":["x"],' + MSG + b"}", "", "model"),
        (b'{"model":"sim-model","user":"' + b"u" * 513 + b'",' + MSG + b"}", "", "user"),
        (b'{"model":"sim-model",' + MSG + b"}", "X-Session-ID: " + "s" * 513 + "\r\n", None),
        (b'{"model":"sim-model",' + MSG + b"}", "X-Session-ID: a\r\nX-Session-ID: b\r\n", None),
        (b'{"a":' * 70 + b"1" + b"}" * 70, "", None),
    ],
)
def test_what_the_gateway_does_not_accept_is_a_json_400(
    shared: Stack, body: bytes, extra: str, param: str | None
) -> None:
    status, err = post(shared.gw.port, body, extra)
    assert status == 400 and err["error"]["code"] == 400 and err["error"]["param"] == param, err


def test_a_request_without_host_gets_a_json_400_from_the_gateway(shared: Stack) -> None:
    body = b'{"model":"sim-model",' + MSG + b"}"
    status, err = raw(
        shared.gw.port,
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(body)
        + body,
    )
    assert status == 400 and "Host" in err["error"]["message"]


def test_what_nginx_cannot_read_is_answered_as_json_without_a_log_line_per_request(shared: Stack) -> None:
    """A malformed chunked body on an API route (whose error_page list replaces the server's) and an
    unknown HTTP version: OpenAI-style JSON, never Nginx's HTML page. Neither writes a warning that
    quotes the client's request line (a client-made log flood)."""
    port = shared.gw.port
    before = shared.gw.error_log.read_text() if shared.gw.error_log.exists() else ""
    status, err = raw(
        port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nzz\r\nnot a chunk\r\n0\r\n\r\n",
    )
    assert status == 400 and err["error"]["code"] == 400, err
    status, err = raw(port, b"GET /v1/models HTTP/9.9\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 505 and err["error"]["code"] == 505, err
    log = shared.gw.error_log.read_text()[len(before) :]
    assert "uninitialized" not in log, log


def test_a_lone_surrogate_escape_in_a_prompt_is_served_as_vllm_serves_it(shared: Stack) -> None:
    """Python's json (vLLM's) takes "\\ud800"; lua-cjson refused it, so the gateway answered 400. The
    gateway reads it now (a high-low pair stays a pair) and the backend gets the body as sent."""
    for content in (b"hi \\ud800 there", b"\\udfff", b"pair \\ud83d\\ude00 and lone \\udc00"):
        body = (
            b'{"model":"sim-model","messages":[{"role":"user","content":"' + content + b'"}],"max_tokens":2}'
        )
        status, reply = post(shared.gw.port, body)
        assert status == 200 and reply["choices"], (content, reply)
    # In a field the gateway reads as text, it is no text: refused as before.
    status, err = post(shared.gw.port, b'{"model":"sim-\\ud800",' + MSG + b"}")
    assert status == 400 and err["error"]["param"] == "model", err


def test_a_binding_that_is_no_backend_id_in_redis_is_repaired_on_the_next_turn(shared: Stack) -> None:
    """Anyone who can write to Redis can write any bytes as a session's binding. One that was not
    UTF-8 crashed every decision of that session (each fell open, the binding never changed)."""
    r = redis.Redis(port=shared.redis_port, socket_timeout=2)
    for key, value in (("bogus-bytes", b"\xff\xfe"), ("bogus-id", b"no-such-backend")):
        r.set(f"kvgate:s:h:{key}", value)
        routes = [
            http_json("POST", shared.gw.url + "/v1/chat/completions", chat(800, 1), {"X-Session-ID": key})
            for _ in range(3)
        ]
        assert all(status == 200 for status, _ in routes), routes
        wait_until(lambda k=key: (r.get(f"kvgate:s:h:{k}") or b"").startswith(b"sim-"), timeout=3)
    r.close()
    log = (shared.gw.stack.run_dir / f"{shared.gw.sidecar.name}.log").read_text()
    assert "Traceback" not in log


def test_long_session_values_are_stored_as_a_fixed_size_hash(shared: Stack) -> None:
    user = "user-" + "x" * 400
    status, _ = post(shared.gw.port, json.dumps({**chat(1, 1), "user": user}).encode())
    assert status == 200
    r = redis.Redis(port=shared.redis_port, socket_timeout=2)
    keys = [k.decode() for k in r.scan_iter("kvgate:s:*")]
    r.close()
    assert not any(user in k for k in keys)
    assert any(k.startswith("kvgate:s:u#") and len(k) == len("kvgate:s:u#") + 32 for k in keys), keys


def test_clients_that_leave_before_the_first_byte_never_eject_a_healthy_backend(shared: Stack) -> None:
    """An abort storm: 60 clients reset their connection during prefill; no abort counts against a
    backend (passive health), so none is ejected. Active health checks are another matter: on a
    starved machine one may time out and take a backend out for a round, which is not what this
    test is about, so it waits for them to settle instead of asserting on one instant."""
    before = {bid: (b["errors"], b["outlier"]["ejections"]) for bid, b in shared.backends().items()}
    body = chat(77, 1)
    body["messages"][-1]["content"] = " ".join(f"w{i}" for i in range(6000))
    body.update(stream=True, max_tokens=4)
    data = json.dumps(body).encode()

    def abort() -> None:
        with socket.create_connection(("127.0.0.1", shared.gw.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(data) + data
            )
            s.recv(10)  # the headers are coming: the request reached a backend
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    threads = [threading.Thread(target=abort) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wait_until(lambda: sum(b["inflight"] for b in shared.backends().values()) == 0, timeout=10)
    after = {bid: (b["errors"], b["outlier"]["ejections"]) for bid, b in shared.backends().items()}
    assert after == before, (before, after)
    assert all(b["outlier"]["consecutive_failures"] == 0 for b in shared.backends().values())
    wait_until(lambda: all(b["state"] == "healthy" for b in shared.backends().values()), timeout=5)
    assert http_json("POST", shared.gw.url + "/v1/chat/completions", chat(78, 1))[0] == 200


def test_a_backend_that_cuts_streams_is_ejected_and_clients_get_an_error_event(stack: Supervisor) -> None:
    s = Stack(stack, n=3)
    s.fault(1, abort_after_tokens=3)
    client = openai.OpenAI(base_url=s.gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
    errors: list[str] = []
    for i in range(40):
        try:
            for _ in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"conversation {i}"}],
                max_tokens=8,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                pass
        except openai.APIError as exc:
            errors.append(str(exc))
        if s.backends()["sim-1"]["state"] == "ejected":
            break
    wait_until(lambda: s.backends()["sim-1"]["state"] == "ejected", timeout=5)
    b = s.backends()["sim-1"]
    assert b["outlier"]["last_failure"] == "cut stream" and b["outlier"]["ejections"] == 1
    assert errors and all("closed the stream before it finished" in e for e in errors), errors[:3]
    metrics = http_json("GET", s.gw.sidecar.http + "/metrics")[1]
    assert 'kvgate_backend_ejections_total{backend="sim-1"} 1.0' in metrics
    # While it is out, nothing goes there.
    for i in range(12):
        r = http_json("POST", s.gw.url + "/v1/chat/completions", chat(500 + i, 1))
        assert r[0] == 200


def at_once(url: str, bodies: list[dict[str, Any]], timeout: float) -> list[tuple[int, str, float]]:
    """Each body sent by its own client at the same time: (status, text, seconds)."""
    import time

    out: list[tuple[int, str, float]] = [(0, "", 0.0)] * len(bodies)

    def one(i: int) -> None:
        t0 = time.monotonic()
        status, text = http_json("POST", url + "/v1/chat/completions", bodies[i], timeout=timeout)
        out[i] = (status, str(text), time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_hung_backend_costs_a_stream_the_first_byte_timeout_then_the_next_candidate(
    stack: Supervisor,
) -> None:
    """The backend accepts and stays silent (its /health still answers, so only requests tell): each
    stream waits one first-byte timeout there at most (here the ceiling: nothing learned yet), then is
    answered by the other backend. Nginx has no retry deadline shorter than a try: a fixed 10 s one
    made every try that timed out after it the request's 504."""
    # Round robin, so requests meet the hung backend first whatever the prefix affinity would do
    # (kvgate's policy may send every one of these same-system-prompt chats to the other backend).
    s = Stack(stack, n=2, first_byte_timeout_ms=11_000, policy="round_robin")
    s.fault(0, latency_ms=60_000)
    results = at_once(s.gw.url, [{**chat(900 + i, 1), "stream": True} for i in range(2)], 30)
    for status, text, seconds in results:
        assert status == 200 and "[DONE]" in text and seconds < 14.0, (status, text[:200], seconds)
    assert max(seconds for *_, seconds in results) > 10.5  # one met the hung backend first
    wait_until(
        lambda: (
            'kvgate_outcomes_total{backend="sim-0",status="504"}'
            in http_json("GET", s.gw.sidecar.http + "/metrics")[1]
        ),
        timeout=2,
    )


def test_a_backend_that_hangs_after_answering_quickly_is_left_after_the_learned_budget(
    stack: Supervisor,
) -> None:
    """With the default 60 s ceiling: a backend whose first bytes came within milliseconds is given
    the 5 s floor, not 60 s, before the next candidate is tried (they used to wait 60 s and fail).
    That is a JSON request's wait; a stream waits at least first_byte_stream_min_ms (30 s), since
    past its headers the timeout would only cut it (tests/e2e/test_lua_phases.py)."""
    s = Stack(stack, n=2, policy="round_robin")
    for i in range(14):  # seven first bytes from each: more than the fit needs
        status, text = http_json(
            "POST", s.gw.url + "/v1/chat/completions", {**chat(950 + i, 1), "stream": True}, timeout=10
        )
        assert status == 200 and "[DONE]" in str(text)
    assert all(b["first_byte"]["samples"] >= 5 for b in s.backends().values()), s.backends()
    s.fault(0, latency_ms=120_000)
    results = at_once(s.gw.url, [chat(980 + i, 1) for i in range(4)], 30)
    for status, text, seconds in results:
        assert status == 200 and "choices" in text and seconds < 9.0, (status, text[:200], seconds)
    assert max(seconds for *_, seconds in results) > 4.5  # some met the hung backend first


def test_slow_metrics_and_health_on_every_backend_never_empty_the_fleet(stack: Supervisor) -> None:
    """vLLM under heavy load answers /metrics and /health late on every replica. Those are missing
    signals, not dead servers: every backend stays in, and every request is served (they all got
    503 "No healthy backend" once, while every backend served). Round robin, so that every backend
    serves (which is what keeps one in; an idle one may still be taken out, never more than the
    outlier share of the fleet)."""
    s = Stack(stack, n=3, policy="round_robin")
    for i in range(3):
        assert http_json("POST", s.gw.url + "/v1/chat/completions", chat(700 + i, 1))[0] == 200
    for i in range(3):
        s.fault(i, metrics="slow", metrics_delay_ms=1000, health_delay_ms=1000)
    import time

    deadline = time.monotonic() + 3.0  # many scrape rounds (100 ms apart, 80 ms timeout) fail
    n = 0
    while time.monotonic() < deadline:
        status, body = http_json("POST", s.gw.url + "/v1/chat/completions", chat(710 + n, 1))
        assert status == 200, (status, body)
        n += 1
    backends = s.backends()
    assert all(b["state"] == "healthy" for b in backends.values()), backends
    assert all(b["last_error"] for b in backends.values())  # the failed scrapes are shown
    for i in range(3):
        assert http_json("DELETE", s.url(i) + "/sim/faults")[0] == 200


def test_huge_requests_that_stall_the_backends_do_not_fail_the_next(stack: Supervisor) -> None:
    """Three 15 MB prompts hold the simulator's event loop (three instances in one process) for about
    three seconds while it reads and tokenizes them; every scrape times out meanwhile. The next legal
    requests are served, not refused for want of a healthy backend (they got 503 once)."""
    s = Stack(stack, n=3, client_max_body_size="20m")
    for i in range(3):
        assert http_json("POST", s.gw.url + "/v1/chat/completions", chat(720 + i, 1))[0] == 200
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3_000_000}], "max_tokens": 1}
    results: list[int] = []

    def send_huge() -> None:
        results.append(http_json("POST", s.gw.url + "/v1/chat/completions", huge, timeout=60)[0])

    threads = [threading.Thread(target=send_huge) for _ in range(3)]
    for t in threads:
        t.start()
    import time

    time.sleep(1.5)  # past the health threshold and a fail-open peer refresh: the stall goes on
    for i in range(5):
        status, body = http_json("POST", s.gw.url + "/v1/chat/completions", chat(730 + i, 1), timeout=60)
        assert status == 200, (status, body)
    for t in threads:
        t.join(60)
    assert sorted(results) == [400, 400, 400], results  # over the model's length: vLLM's own 400


def test_a_sidecar_told_to_stop_serves_until_its_gateway_has_gone(stack: Supervisor) -> None:
    """SIGTERM (a pod going away: Kubernetes signals both containers while Nginx drains its streams)
    used to stop the sidecar at once, and the draining gateway routed on its own. Now the sidecar
    keeps deciding while Nginx runs, and stops once Nginx has gone."""
    import os
    import signal
    import time

    s = Stack(stack, n=2)
    sidecar = stack.procs[s.gw.sidecar.name]
    os.kill(sidecar.pid, signal.SIGTERM)
    time.sleep(1.5)  # past the quiet second it would need if nothing were connected
    for i in range(5):
        status = http_json("POST", s.gw.url + "/v1/chat/completions", chat(990 + i, 1))[0]
        assert status == 200
    assert sidecar.poll() is None
    routes = http_json("GET", s.gw.url + "/kvgate/metrics")[1]
    assert "kvgate_gateway_failopen_total{" not in routes, routes  # every one was decided
    stack.stop(s.gw.replica.nginx_name)
    t0 = time.monotonic()
    sidecar.wait(10)
    assert time.monotonic() - t0 < 5
    assert "drained: stopping" in (stack.run_dir / f"{s.gw.sidecar.name}.log").read_text()


def test_a_sidecar_told_to_stop_at_once_stops_with_an_http_request_half_sent(stack: Supervisor) -> None:
    """SIGINT stops at once. An HTTP request still in progress (here, one whose body never comes)
    used to hold the sidecar for aiohttp's default 60 s, deciding on its socket with its HTTP port
    closed; it now gets ``STOP_GRACE_S``."""
    import os
    import signal
    import time
    from urllib.parse import urlsplit

    s = Stack(stack, n=1)
    sidecar = stack.procs[s.gw.sidecar.name]
    addr = urlsplit(s.gw.sidecar.http)
    with socket.create_connection((addr.hostname, addr.port), timeout=5) as conn:
        conn.sendall(b"POST /v1/decide HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        time.sleep(0.3)  # the handler is reading the body
        t0 = time.monotonic()
        os.kill(sidecar.pid, signal.SIGINT)
        sidecar.wait(20)
        assert time.monotonic() - t0 < 6
