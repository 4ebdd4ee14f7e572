"""End to end: the official openai client -> real Nginx with the project's Lua -> real sidecar and
redis-server -> simulated vLLM backends over HTTP. Every failure is provoked for real."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests import scenarios
from tests.conftest import MODEL, http_json, wait_until
from tests.helpers import Gateway, chat, inflight, start_backends

pytestmark = pytest.mark.e2e
ROUTES = {"session", "prefix", "ring", "load", "ttft", "fail-open"}  # X-Kvgate-Route under the kvgate policy


class Env:
    def __init__(self, stack: Supervisor, replicas: int = 1, n: int = 3, **kw: Any) -> None:
        self.stack = stack
        self.redis_port = free_port()
        stack.start_redis(self.redis_port)
        self.sim_port = start_backends(stack, n)
        self.n = n
        self.gateways = [
            Gateway(stack, f"gw{i}", self.redis_port, self.sim_port, n, **kw) for i in range(replicas)
        ]
        self.gw = self.gateways[0]

    def backend_url(self, bid: str) -> str:
        return f"http://127.0.0.1:{self.sim_port + int(bid.rsplit('-', 1)[1])}"

    def fault(self, bid: str, **faults: Any) -> None:
        assert http_json("POST", self.backend_url(bid) + "/sim/faults", faults)[0] == 200

    def answers(self, bid: str) -> bool:
        try:
            return http_json("GET", self.backend_url(bid) + "/version", timeout=1)[0] == 200
        except OSError:
            return False


class Resp:
    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.text = body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.text)


def raw_post(url: str, data: bytes, headers: dict[str, str] | None = None, timeout: float = 20) -> Resp:
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Resp(resp.status, resp.headers, resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return Resp(exc.code, exc.headers, exc.read())
        finally:
            exc.close()


def post(
    url: str, body: Any, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions"
) -> Resp:
    return raw_post(url + path, json.dumps(body).encode(), headers)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    stack = Supervisor(tmp_path_factory.mktemp("e2e") / "run")
    try:
        yield Env(stack, replicas=2, client_max_body_size="256k")
    finally:
        stack.stop_all()


@pytest.fixture
def fresh(stack: Supervisor) -> Env:
    """A private stack for tests that kill or stop parts of it."""
    return Env(stack)


def test_openai_client_chat_and_completions_stream_and_not(env: Env) -> None:
    c = client(env.gw.url)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert len(r.choices[0].message.content.split()) == 6 and r.usage.completion_tokens == 6
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 5
    assert chunks[-1].usage.completion_tokens == 5
    t = c.completions.create(
        model=MODEL, prompt="one two three", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert len(t.choices[0].text.split()) == 3
    s = list(
        c.completions.create(
            model=MODEL, prompt="one two three", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(x.choices[0].text for x in s) == t.choices[0].text
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_the_shared_client_scenario_passes_on_local_processes(env: Env) -> None:
    """The scenario tests/deploy/test_containers.py runs against the container stack."""
    scenarios.a_client_session(env.gw.url, MODEL)


def test_streaming_is_not_buffered(env: Env) -> None:
    """Tokens reach the client one engine step at a time, not at the end."""
    times = []
    t0 = time.perf_counter()
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True})
    req = urllib.request.Request(
        env.gw.url + "/v1/completions",
        data=body.encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=20) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter() - t0)
    assert len(times) == 40
    assert times[-1] - times[0] > 0.15  # ~39 steps of ~7.4 ms arrive spread out


def test_route_headers_name_backend_and_reason(env: Env) -> None:
    r = post(env.gw.url, chat(1000, 1))
    assert r.status_code == 200
    assert r.headers["X-Kvgate-Backend"] in {f"sim-{i}" for i in range(env.n)}
    assert r.headers["X-Kvgate-Route"] in ROUTES - {"session", "fail-open"}  # a new conversation
    again = post(env.gw.url, chat(1000, 2))
    assert again.headers["X-Kvgate-Route"] == "session"
    assert again.headers["X-Kvgate-Backend"] == r.headers["X-Kvgate-Backend"]


@pytest.mark.parametrize("how", ["header", "user", "conversation"])
def test_a_session_sticks_across_turns_and_replicas(env: Env, how: str) -> None:
    seen = set()
    for turn in range(1, 6):
        body = chat(hash(how) % 10_000, turn)
        headers = {}
        if how == "header":
            headers["X-Session-ID"] = "sess-42"
        elif how == "user":
            body["user"] = "user-42"
        gw = env.gateways[turn % 2]  # alternate between the two replicas
        r = post(gw.url, body, headers)
        assert r.status_code == 200, r.text
        seen.add(r.headers["X-Kvgate-Backend"])
        if turn > 1:
            assert r.headers["X-Kvgate-Route"] == "session"
    assert len(seen) == 1


def test_many_conversations_spread_over_backends(env: Env) -> None:
    # Conversations that share nothing: a common system prompt would rightly draw them to the
    # backends that earlier tests of this stack left holding it (in some test orders, two of three).
    def own(i: int) -> dict[str, Any]:
        return chat(5000 + i, 1, system=f"You are assistant {i}. " * 20)

    backends = {post(env.gw.url, own(i)).headers["X-Kvgate-Backend"] for i in range(30)}
    assert len(backends) == env.n, env.gw.sidecar.backends()  # the sidecar's view, if they did not


def test_gateway_errors_are_openai_json(env: Env) -> None:
    r = raw_post(env.gw.url + "/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = raw_post(env.gw.url + "/v1/chat/completions", b"")
    assert r.status_code == 400 and "error" in r.json()
    r = post(env.gw.url, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]}
    r = post(env.gw.url, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    status, body = http_json("GET", env.gw.url + "/v1/nothing-here")  # vLLM's own 404, through kvgate
    assert status == 404 and body == {"detail": "Not Found"}
    status, body = http_json("GET", env.gw.url + "/not-an-api-route")  # Nginx's own, as JSON
    assert status == 404 and body["error"]["code"] == 404
    with pytest.raises(openai.NotFoundError):
        client(env.gw.url).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_backend_down_before_the_request_is_retried_elsewhere(fresh: Env) -> None:
    headers = {"X-Session-ID": "retry-me"}
    first = post(fresh.gw.url, chat(1, 1), headers)
    home = first.headers["X-Kvgate-Backend"]
    fresh.fault(home, refuse_for_s=3.0)
    wait_until(lambda: not fresh.answers(home), timeout=2)
    r = post(fresh.gw.url, chat(1, 2), headers)
    assert r.status_code == 200 and r.headers["X-Kvgate-Backend"] != home
    # A backend answering 503 is also skipped before the client sees anything.
    other = r.headers["X-Kvgate-Backend"]
    fresh.fault(other, fail_rate=1.0, fail_status=503)
    r = post(fresh.gw.url, chat(1, 3), headers)
    assert r.status_code == 200 and r.headers["X-Kvgate-Backend"] not in (other,)


@pytest.mark.parametrize("status", [500, 429])
def test_a_backend_failing_every_request_is_never_seen_by_clients(fresh: Env, status: int) -> None:
    """A backend that answers every request with a 500 (an engine that broke but still serves HTTP)
    or a 429 is skipped for the next candidate from the first request on, streams and JSON alike:
    the sessions whose home it is never see its error."""
    homed: list[str] = []
    for n in range(60):
        sid = f"failing-home-{status}-{n}"
        r = post(fresh.gw.url, chat(20 + n, 1), {"X-Session-ID": sid})
        if r.headers["X-Kvgate-Backend"] == "sim-0":
            homed.append(sid)
        if len(homed) == 4:
            break
    assert len(homed) == 4
    fresh.fault("sim-0", fail_rate=1.0, fail_status=status)
    for n, sid in enumerate(homed):
        r = post(fresh.gw.url, {**chat(20 + n, 2), "stream": n % 2 == 0}, {"X-Session-ID": sid})
        assert r.status_code == 200, r.text
        assert r.headers["X-Kvgate-Backend"] != "sim-0"
    # A 500 is the backend's failure (counted towards its ejection); a 429 is only its refusal.
    errors = fresh.gw.sidecar.backends()["sim-0"]["errors"]
    assert errors >= 1 if status == 500 else errors == 0
    wait_until(lambda: inflight(fresh.gw) == (0, 0, 0), timeout=2)


def test_backend_aborting_mid_stream_gives_a_clean_error_and_no_hang(fresh: Env) -> None:
    for i in range(fresh.n):
        fresh.fault(f"sim-{i}", abort_after_tokens=3)
    t0 = time.perf_counter()
    got = []
    with pytest.raises(openai.APIError):  # the stream ends with a transport error
        for ch in client(fresh.gw.url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=50,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            got.append(ch)
    assert 1 <= len(got) <= 4 and time.perf_counter() - t0 < 5


def test_all_backends_failing_gives_502_json(fresh: Env) -> None:
    for i in range(fresh.n):
        fresh.fault(f"sim-{i}", fail_rate=1.0, fail_status=502)
    r = post(fresh.gw.url, chat(2, 1))
    assert r.status_code == 502 and r.json()["error"]["code"] == 502


def test_backends_that_never_answer_give_504_json(stack: Supervisor) -> None:
    e = Env(stack, n=2, first_byte_timeout_ms=1000)
    for i in range(e.n):
        e.fault(f"sim-{i}", latency_ms=5000)  # accepts, answers far too late
    t0 = time.perf_counter()
    r = post(e.gw.url, chat(4, 1))
    assert r.status_code == 504 and r.json()["error"]["code"] == 504
    assert time.perf_counter() - t0 < 5  # bounded by the read timeout and the retry deadline


def test_no_healthy_backend_gives_503_json(fresh: Env) -> None:
    for i in range(fresh.n):
        fresh.fault(f"sim-{i}", unhealthy=True)
    wait_until(
        lambda: all(b["state"] == "unhealthy" for b in fresh.gw.sidecar.backends().values()), timeout=5
    )
    wait_until(
        lambda: http_json("GET", fresh.gw.url + "/kvgate/health")[1]["fail_open_peers"] == 0, timeout=5
    )
    r = post(fresh.gw.url, chat(3, 1))
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_kvgate_health_never_calls_a_fleet_with_an_excluded_backend_healthy(fresh: Env) -> None:
    """A backend whose health check fails is excluded, and the gateway's health says so until it is
    back (metrics that cannot be read only make its load unknown: it stays in); a sidecar that stops
    answering makes the gateway degraded too (it routes alone)."""

    def health() -> dict[str, Any]:
        return http_json("GET", fresh.gw.url + "/kvgate/health")[1]

    wait_until(lambda: health()["status"] == "ok", timeout=5)
    assert (health()["eligible_backends"], health()["known_backends"]) == (3, 3)
    fresh.fault("sim-1", metrics="garbage")
    wait_until(lambda: "metrics" in str(fresh.gw.sidecar.backends()["sim-1"]["last_error"]), timeout=5)
    assert fresh.gw.sidecar.backends()["sim-1"]["state"] == "healthy" and health()["status"] == "ok"
    fresh.fault("sim-1", metrics="ok", unhealthy=True)
    wait_until(lambda: health()["status"] == "degraded", timeout=5)
    h = health()
    assert (h["eligible_backends"], h["known_backends"], h["sidecar"]) == (2, 3, "ok")
    assert fresh.gw.sidecar.backends()["sim-1"]["state"] != "healthy"
    fresh.fault("sim-1", unhealthy=False)
    wait_until(lambda: health()["status"] == "ok", timeout=5)
    fresh.stack.kill(fresh.gw.sidecar.name)
    wait_until(lambda: health()["sidecar"] == "unreachable", timeout=6)
    assert health()["status"] == "degraded" and health()["eligible_backends"] == 3


def test_a_backend_without_metrics_is_detected_and_routed_on_in_flight_counts(fresh: Env) -> None:
    """metrics: auto (the default): a backend whose /metrics route is gone stays healthy, serves
    its share, and says so in /v1/backends; when /metrics is back, its load comes from them again."""
    fresh.fault("sim-2", metrics="absent")
    wait_until(lambda: fresh.gw.sidecar.backends()["sim-2"]["metrics"] == "none", timeout=5)
    assert fresh.gw.sidecar.backends()["sim-2"]["state"] == "healthy"
    served = {post(fresh.gw.url, chat(500 + i, 1)).headers["X-Kvgate-Backend"] for i in range(30)}
    assert "sim-2" in served
    fresh.fault("sim-2", metrics="ok")
    wait_until(lambda: fresh.gw.sidecar.backends()["sim-2"]["metrics"] == "auto", timeout=5)
    log = (fresh.stack.run_dir / f"{fresh.gw.sidecar.name}.log").read_text()
    assert "backend sim-2 has no /metrics" in log and "backend sim-2 serves /metrics now" in log


def test_sidecar_killed_fails_open_then_decisions_resume(fresh: Env) -> None:
    sc = fresh.gw.sidecar
    fresh.stack.kill(sc.name)
    routes = set()
    for i in range(10):
        r = post(fresh.gw.url, chat(100 + i, 1))
        assert r.status_code == 200
        routes.add(r.headers["X-Kvgate-Route"])
    assert routes == {"fail-open"}
    # Fail-open still keeps a conversation on one backend (rendezvous hash of its key).
    same = {post(fresh.gw.url, chat(7, t)).headers["X-Kvgate-Backend"] for t in range(1, 4)}
    assert len(same) == 1
    sc.start()
    wait_until(lambda: post(fresh.gw.url, chat(200, 1)).headers["X-Kvgate-Route"] != "fail-open", timeout=10)


def test_sidecar_hanging_costs_at_most_the_decision_timeout(fresh: Env) -> None:
    import os
    import signal

    sc = fresh.gw.sidecar
    proc = fresh.stack.procs[sc.name]
    os.kill(proc.pid, signal.SIGSTOP)  # accepts connections (kernel backlog) but never answers
    try:
        t0 = time.perf_counter()
        r = post(fresh.gw.url, chat(300, 1))
        assert r.status_code == 200 and r.headers["X-Kvgate-Route"] == "fail-open"
        assert time.perf_counter() - t0 < 1.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_redis_stopped_keeps_serving_and_bindings_resume(fresh: Env) -> None:
    fresh.stack.stop("redis")
    for turn in range(1, 4):
        r = post(fresh.gw.url, chat(400, turn), {"X-Session-ID": "redis-down"})
        assert r.status_code == 200
    fresh.stack.start_redis(fresh.redis_port)
    import redis

    r = redis.Redis(port=fresh.redis_port, socket_timeout=2)
    wait_until(
        lambda: (
            post(fresh.gw.url, chat(401, 1), {"X-Session-ID": "after"}).status_code == 200
            and r.get("kvgate:s:h:after") is not None
        ),
        timeout=10,
    )
    assert r.get("kvgate:s:h:redis-down") is not None  # written back after recovery
    r.close()


def test_nginx_never_logs_lua_errors(env: Env) -> None:
    """Good requests, hostile ones and retries through both replicas leave no Lua error behind."""
    for gw in env.gateways:
        assert post(gw.url, chat(9500, 1)).status_code == 200
        assert post(gw.url, chat(9500, 1), path="/v1/completions").status_code == 400
        assert raw_post(gw.url + "/v1/chat/completions", b'{"model": 5, "messages": 7}').status_code in (
            400,
            404,
        )
        assert raw_post(gw.url + "/v1/chat/completions", b"[1, 2]").status_code == 400
        assert raw_post(gw.url + "/v1/chat/completions", b"\xff\xfe").status_code == 400
        assert http_json("GET", gw.url + "/v1/models")[0] == 200
        text = gw.error_log.read_text()
        assert "lua entry thread aborted" not in text and "runtime error" not in text, text[-2000:]


def test_headers_can_be_switched_off(stack: Supervisor) -> None:
    e = Env(stack, n=1, route_headers=False)
    r = post(e.gw.url, chat(1, 1))
    assert r.status_code == 200 and "X-Kvgate-Backend" not in r.headers


def test_nginx_reuses_its_connections_to_backends(stack: Supervisor) -> None:
    """40 requests to one backend through Nginx's keepalive pool open a handful of connections (at
    most one per worker and concurrent request), not one per request."""
    e = Env(stack, n=1)
    before = http_json("GET", e.backend_url("sim-0") + "/sim/info")[1]["connections"]
    for i in range(40):
        assert post(e.gw.url, chat(9000 + i, 1)).status_code == 200
    opened = http_json("GET", e.backend_url("sim-0") + "/sim/info")[1]["connections"] - before
    assert 1 <= opened <= 4, opened


def raw_request(port: int, body: bytes, headers: dict[str, bytes]) -> tuple[int, Any]:
    """POST with header values sent byte for byte (urllib would re-encode them)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw)
    finally:
        conn.close()


@pytest.mark.parametrize(
    "body, headers, param",
    [
        (
            b'{"model":"sim-model","messages":[{"role":"user","content":"x"}]}',
            {"X-Session-ID": b"\xed\xa0\x80"},
            None,
        ),
        (
            b'{"model":"sim-model","messages":[{"role":"user","content":"x"}]}',
            {"X-Session-ID": b"s-\xff"},
            None,
        ),
        (
            b'{"model":"sim-model","user":"\xed\xa0\x80","messages":[{"role":"user","content":"x"}]}',
            {},
            "user",
        ),
        (b'{"model":"sim-\xc0\xaf","messages":[{"role":"user","content":"x"}]}', {}, "model"),
    ],
)
def test_text_that_is_not_utf8_gets_400_and_the_sidecar_lives(
    env: Env, body: bytes, headers: dict[str, bytes], param: str | None
) -> None:
    status, err = raw_request(env.gw.port, body, headers)
    assert status == 400 and "UTF-8" in err["error"]["message"] and err["error"]["param"] == param
    r = post(env.gw.url, chat(7100, 1))
    assert r.status_code == 200 and r.headers["X-Kvgate-Route"] != "fail-open"


@pytest.mark.parametrize("value", [b"a\x01b", b"a\x1fb", b"a\x7fb"])
def test_a_session_header_with_a_control_character_gets_400_from_the_gateway(env: Env, value: bytes) -> None:
    """Nginx would route on it and pass it on, and the backend's parser refuse it in plain text."""
    body = b'{"model":"sim-model","messages":[{"role":"user","content":"x"}]}'
    status, err = raw_request(env.gw.port, body, {"X-Session-ID": value})
    assert status == 400 and "control character" in err["error"]["message"], err
    status, _ = raw_request(env.gw.port, body, {"X-Session-ID": b"a\tb"})  # a tab is a header's own
    assert status == 200
