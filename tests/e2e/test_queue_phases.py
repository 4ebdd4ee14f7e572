"""The gateway queue as Nginx sees it, in a real Nginx with kvgate's Lua and a mock sidecar: a queued
request waits past the decision budget while heartbeats come, falls open when they stop, gets 429
JSON when refused, leaves the queue when its client goes away, and carries its priority."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import http_json, wait_until
from tests.e2e.test_lua_phases import CHAT, Phase
from tests.lua_harness import MockSidecar, PhaseNginx

pytestmark = pytest.mark.e2e
HEARTBEAT_MS = 100


@pytest.fixture
def phase(stack: Supervisor) -> Iterator[Phase]:
    p = Phase(stack, queue=True, queue_heartbeat_ms=HEARTBEAT_MS)
    try:
        yield p
    finally:
        p.sidecar.close()


def queued_then(phase: Phase, beats: int, last: dict[str, Any] | None) -> None:
    """The mock answers every decision 'queued', sends ``beats`` more heartbeats a heartbeat apart,
    then ``last`` (None: silence, as a sidecar that died)."""
    pause = HEARTBEAT_MS / 1000

    def answer(msg: dict[str, Any]) -> list[dict[str, Any] | float]:
        lines: list[dict[str, Any] | float] = [{"i": msg["i"], "q": 1}]
        for _ in range(beats):
            lines += [pause, {"i": msg["i"], "q": 1}]
        if last is not None:
            lines += [pause, {"i": msg["i"], **last}]
        return lines

    phase.sidecar.answer = answer


def test_a_queued_request_waits_past_the_budget_and_goes_where_it_is_dispatched(phase: Phase) -> None:
    queued_then(phase, 4, {"c": [["ok-b", phase.addr("ok-b")]], "r": "ring"})
    t0 = time.monotonic()
    status, headers, body = phase.post()
    waited = time.monotonic() - t0
    assert status == 200 and json.loads(body) == {"served_by": "ok-b"}
    assert headers["X-Kvgate-Route"] == "ring"  # the sidecar's decision, not a fail-open
    assert waited >= 0.4  # five heartbeat periods, far past the 50 ms decision budget
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(lambda: any(o["k"] == "end" and o.get("i") == did for o in phase.sidecar.outcomes()))
    assert not [o for o in phase.sidecar.outcomes() if o["k"] == "drop"]


def test_heartbeats_that_stop_mean_a_dead_sidecar_and_the_request_falls_open(phase: Phase) -> None:
    queued_then(phase, 2, None)
    t0 = time.monotonic()
    status, headers, _ = phase.post(headers={"X-Session-ID": "stranded"})
    waited = time.monotonic() - t0
    assert status == 200 and headers["X-Kvgate-Route"] == "fail-open"
    # Two heartbeats came (0.2 s); then silence for 4 heartbeats + the 50 ms budget.
    assert 0.6 <= waited < 1.5
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(lambda: {"k": "drop", "i": did} in phase.sidecar.outcomes(), timeout=2)


@pytest.mark.parametrize("code", ["queue_full", "queue_timeout"])
def test_a_refusal_from_the_queue_is_a_429_with_retry_after(phase: Phase, code: str) -> None:
    refusal = {"e": code, "msg": "Every backend is busy; retry later.", "ra": 7}
    if code == "queue_full":
        phase.sidecar.answer = lambda msg: refusal
    else:
        queued_then(phase, 1, refusal)
    status, headers, body = phase.post()
    assert status == 429 and headers["Retry-After"] == "7"
    assert headers["Content-Type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["type"] == "RateLimitError" and err["code"] == code and "busy" in err["message"]


def test_a_client_that_goes_away_while_queued_takes_its_request_out(phase: Phase) -> None:
    queued_then(phase, 50, {"c": [["ok-a", phase.addr("ok-a")]], "r": "ring"})  # 5 s of waiting
    body = json.dumps(CHAT).encode()
    host, port = "127.0.0.1", phase.nginx.port
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: bool(phase.sidecar.decides()), timeout=2)
        time.sleep(0.3)
    did = phase.sidecar.decides()[-1]["i"]
    t0 = time.monotonic()
    wait_until(lambda: {"k": "drop", "i": did} in phase.sidecar.outcomes(), timeout=2)
    assert time.monotonic() - t0 < 1.0  # the queue hears of it at once, not when its turn comes


def test_the_clients_priority_goes_to_the_sidecar_and_bad_ones_are_refused(phase: Phase) -> None:
    # The client's X-Priority reaches the sidecar as the request's class.
    phase.route("ok-a")
    status, _, _ = phase.post(headers={"X-Priority": "-3"})
    assert status == 200 and phase.sidecar.decides()[-1]["f"]["pr"] == -3
    status, _, _ = phase.post({**CHAT, "priority": 4})
    assert status == 200 and phase.sidecar.decides()[-1]["f"]["pr"] == 4
    for bad in ("high", 1.5, 1e20, [1]):
        status, _, body = phase.post({**CHAT, "priority": bad})
        assert status == 400 and json.loads(body)["error"]["param"] == "priority", bad


def test_the_completions_a_request_asks_for_go_to_the_sidecar_and_too_many_are_refused(
    stack: Supervisor,
) -> None:
    """vLLM runs each of n completions of each prompt of a batch as an engine request: the sidecar
    hears how many (rate limits count each one's tokens, the in-flight ledger each request) and the
    bytes of all the prompts, and more than gateway.max_engine_requests is a JSON 400 naming n."""
    p = Phase(stack, max_engine_requests=12)
    try:
        p.route("ok-a")
        batch = {"model": "m", "prompt": ["a b", "c d", "e f"], "max_tokens": 2}
        cases = (
            (CHAT, None),
            ({**CHAT, "n": 1}, None),
            ({**CHAT, "n": 4}, 4),
            (batch, 3),
            ({**batch, "n": 4}, 12),
            ({**batch, "prompt": [1, 2, 3], "n": 2}, 2),  # one prompt of token ids
            ({**batch, "prompt": [[1, 2], [3, 4]], "n": 2}, 4),  # two of them
        )
        for body, sent in cases:
            status, _, answer = p.post(body)
            assert status == 200 and p.sidecar.decides()[-1]["f"].get("n") == sent, (body, answer)
        p.post(batch)  # the sidecar counts the prompt bytes of the whole batch (admission, prefill)
        assert p.sidecar.decides()[-1]["f"]["b"] == len("a bc de f")
        for body in ({**CHAT, "n": 13}, {**batch, "n": 5}, {**CHAT, "n": 0}, {**CHAT, "n": 1.5}):
            status, _, answer = p.post(body)
            assert status == 400 and json.loads(answer)["error"]["param"] == "n", (body, answer)
    finally:
        p.sidecar.close()


@pytest.mark.parametrize("forward", [True, False])
def test_the_decided_priority_is_written_into_the_body_the_backend_gets(
    stack: Supervisor, forward: bool
) -> None:
    """forward_priority: vLLM schedules by the body's priority, so the class the sidecar decided goes
    there, over one the client wrote (the sidecar decided with it where clients may choose; where they
    may not, theirs would overtake every request inside vLLM). Without it the body is the client's."""
    port = free_port()
    echo = f"""server {{ listen 127.0.0.1:{port}; location / {{ content_by_lua_block {{
        ngx.req.read_body()
        ngx.header["Content-Type"] = "application/json"
        ngx.print(ngx.req.get_body_data())
    }} }} }}"""
    mock = MockSidecar(stack.run_dir / "mock.sock", [("echo", f"127.0.0.1:{port}")])
    try:
        nginx = PhaseNginx(stack, mock.path, echo, queue=True, forward_priority=forward)
        # Fields a decode-and-re-encode would change: an empty list (cjson: {}), a long integer.
        fragile = {**CHAT, "stop": [], "logit_bias": {}, "seed": 12345678901234567}
        # (the client's priority, the decided class (none: 0), what the backend reads with it, without)
        cases = (
            (None, 2, 2, None),
            (None, None, None, None),
            (5, 2, 2, 5),
            (5, None, 0, 5),
            (-3, -3, -3, -3),
        )
        for asked, decided, forwarded, kept in cases:
            reply: dict[str, Any] = {"c": [["echo", f"127.0.0.1:{port}"]], "r": "ring"}
            if decided is not None:
                reply["pr"] = decided
            mock.answer = lambda msg, reply=reply: {"i": msg["i"], **reply}  # type: ignore[misc]
            body = fragile if asked is None else {**fragile, "priority": asked}
            status, got = http_json("POST", nginx.url + "/v1/chat/completions", body)
            backend_gets = forwarded if forward else kept
            assert status == 200 and got.get("priority") == backend_gets, (asked, decided, got)
            assert {k: v for k, v in got.items() if k != "priority"} == {
                k: v for k, v in body.items() if k != "priority"
            }
        # A body the gateway does not read (a multipart upload, a GET) goes as it came, class or not.
        mock.answer = lambda msg: {"i": msg["i"], "c": [["echo", f"127.0.0.1:{port}"]], "r": "ring", "pr": 2}
        upload = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b--\r\n'
        headers = {"Content-Type": "multipart/form-data; boundary=b"}
        status, got_raw = raw_post(nginx.url + "/v1/audio/transcriptions", upload, headers)
        assert status == 200 and got_raw == upload, (status, got_raw[:200])
    finally:
        mock.close()


def raw_post(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()
