"""kvgate's Lua phases in a real Nginx, without the rest of the stack: the include files production
uses, a mock sidecar on the unix socket, and server blocks that play the backends."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import http_json, wait_until
from tests.lua_harness import MockSidecar, PhaseNginx, backend_server, stream_server

pytestmark = pytest.mark.e2e
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


class Phase:
    """Three live backends (ok-a, ok-b, ok-c), one answering 503, one refusing, one too slow."""

    def __init__(self, sup: Supervisor, extra_servers: str = "", **settings: Any) -> None:
        names = ("ok-a", "ok-b", "ok-c", "503", "refused", "refused-2", "slow", "stream")
        self.ports = {name: free_port() for name in names}
        servers = "\n".join(
            [
                *(backend_server(self.ports[n], f'{{"served_by":"{n}"}}') for n in ("ok-a", "ok-b", "ok-c")),
                backend_server(self.ports["503"], '{"error":"busy"}', status=503),
                backend_server(self.ports["slow"], sleep_s=3),
                stream_server(self.ports["stream"], first_after_s=0.3, events=5, every_s=0.1),
                extra_servers,
            ]
        )
        self.sidecar = MockSidecar(
            sup.run_dir / "mock.sock", [(n, self.addr(n)) for n in ("ok-a", "ok-b", "ok-c")]
        )
        settings.setdefault("first_byte_timeout_ms", 1000)
        self.nginx = PhaseNginx(sup, self.sidecar.path, servers, **settings)
        wait_until(lambda: http_json("GET", self.nginx.url + "/kvgate/health")[1]["fail_open_peers"] == 3)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def route(self, *names: str, route: str = "ring") -> None:
        """The mock sidecar answers every decision with these candidates, in order."""
        cands = [[n, self.addr(n)] for n in names]
        self.sidecar.answer = lambda msg: {"i": msg["i"], "c": cands, "r": route}

    def post(self, body: Any = CHAT, headers: dict[str, str] | None = None, raw: bytes | None = None) -> Any:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.nginx.url + "/v1/chat/completions",
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, dict(exc.headers), exc.read()
            finally:
                exc.close()


@pytest.fixture
def phase(stack: Supervisor) -> Iterator[Phase]:
    p = Phase(stack)
    try:
        yield p
    finally:
        p.sidecar.close()


# -- the golden files, from the Lua side -------------------------------------------------------------
def test_lua_features_match_the_golden_file(phase: Phase) -> None:
    status, got = http_json("GET", phase.nginx.url + "/test/golden?file=features")
    cases = json.loads((GOLDEN / "features.json").read_text())
    assert status == 200 and len(got) == len(cases)
    for case, lua in zip(cases, got, strict=True):
        lua["hashes"] = lua["hashes"] if lua.pop("n") else []  # cjson writes an empty table as {}
        assert lua.pop("ffi_md5") is True, "Nginx's MD5 should be reachable through the FFI"
        assert lua.pop("same_without_ffi") is True, case["name"]
        assert lua == case["expected"], case["name"]


def test_lua_protocol_matches_the_golden_file(phase: Phase) -> None:
    status, got = http_json("GET", phase.nginx.url + "/test/golden?file=protocol")
    golden = json.loads((GOLDEN / "protocol.json").read_text())
    assert status == 200 and got["version"] == golden["version"]
    assert got["decide"] == [c["wire"] for c in golden["decide"]]
    assert got["report"] == [c["wire"] for c in golden["report"]]
    assert got["peers"] == golden["peers"]["wire"] and got["models"] == golden["models"]["wire"]
    assert got["keys"] == golden["keys"]["wire"]
    for case, lua in zip(golden["replies"], got["replies"], strict=True):
        want = case["meaning"]
        if want["kind"] == "decision":
            assert lua["kind"] == "decision" and lua["decision_id"] == want["decision_id"]
            assert (lua["candidates"] if lua["n"] else []) == want["candidates"] and lua["route"] == want[
                "route"
            ]
            assert lua["priority"] == want["priority"]
            assert (lua["prefill"] if lua["np"] else []) == want["prefill"]
            assert (lua["first_byte_ms"] if lua["nfb"] else []) == want["first_byte_ms"]
            assert lua["max_tokens"] == want["max_tokens"]
        elif want["kind"] == "error":
            expected = {"kind": "error", "code": want["code"], "message": want["message"], "decision": False}
            if want["retry_after"] is not None:
                expected["retry_after"] = want["retry_after"]
            assert lua == expected
        elif want["kind"] == "peers":
            assert (lua["version"], lua["peers"], lua["known"]) == (
                want["version"],
                want["peers"],
                want["known"],
            )
            assert (lua["fingerprint"], lua["auth"], lua["limits"]) == (
                want["fingerprint"],
                want["auth"],
                want["limits"],
            )
        else:
            assert lua == want
    assert got["mismatch"]["accepted"] is False and "mismatch" in got["mismatch"]["error"]
    assert "protocol version mismatch" in phase.nginx.log()


# -- balancer: retries in candidate order ----------------------------------------------------------
def test_retries_go_to_the_next_candidate_and_every_try_is_reported(phase: Phase) -> None:
    phase.route("refused", "503", "ok-b")
    status, headers, body = phase.post()
    assert status == 200 and json.loads(body) == {"served_by": "ok-b"}
    assert headers["X-Kvgate-Backend"] == "ok-b" and headers["X-Kvgate-Route"] == "ring"
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(lambda: any(o["k"] == "end" for o in phase.sidecar.outcomes()))
    outcomes = phase.sidecar.outcomes()
    # A JSON response's first byte comes with its last: one report, its end, says all.
    assert not [o for o in outcomes if o["k"] == "first" and o["i"] == did]
    final = [o for o in outcomes if o["k"] in ("try", "end")]
    assert [(o["k"], o["b"], o["s"]) for o in final] == [
        ("try", "refused", 502),
        ("try", "503", 503),
        ("end", "ok-b", 200),
    ]
    end = final[-1]
    assert end["i"] == did and end["x"] is True and "t" not in end and end["d"] >= 0  # JSON: no TTFT


def test_all_candidates_failing_is_a_json_502_and_still_reported(phase: Phase) -> None:
    """error_page's internal redirect drops ngx.ctx; the outcome is reported all the same."""
    phase.route("refused", "refused-2")
    status, headers, body = phase.post()
    err = json.loads(body)["error"]
    assert status == 502 and headers["Content-Type"] == "application/json" and err["code"] == 502
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(lambda: any(o["k"] == "end" for o in phase.sidecar.outcomes()))
    final = [(o["k"], o["b"], o["s"]) for o in phase.sidecar.outcomes() if o["k"] in ("try", "end")]
    assert final == [("try", "refused", 502), ("end", "refused-2", 502)]
    assert [o["i"] for o in phase.sidecar.outcomes() if o["k"] == "end"] == [did]


def test_stream_ttft_is_the_first_body_byte_not_the_headers(phase: Phase) -> None:
    """The backend sends its headers at once and the first event 0.3 s later, as vLLM does: the
    first-byte report and the reported TTFT follow the event."""
    phase.route("stream")
    t0 = time.monotonic()
    status, headers, body = phase.post()
    assert status == 200 and body.count(b"data: ") == 6 and headers["X-Kvgate-Backend"] == "stream"
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(lambda: any(o["k"] == "end" for o in phase.sidecar.outcomes()))
    end = next(o for o in phase.sidecar.outcomes() if o["k"] == "end")
    assert end["i"] == did and 0.28 <= end["t"] <= 0.6 and end["d"] >= end["t"] + 0.4, end
    assert time.monotonic() - t0 >= 0.7
    assert {"k": "first", "i": did, "b": "stream"} in phase.sidecar.outcomes()


def test_a_client_gone_while_the_decision_is_asked_for_ends_it_as_dropped(phase: Phase) -> None:
    """Nginx ends a request whose client left while its Lua waited (lua_check_client_abort): the
    decision the sidecar is making must still end, or its count stays up until it expires."""
    import socket

    phase.route("ok-a")
    phase.sidecar.delay_s = 0.04  # within the 50 ms budget: the answer comes after the client left
    body = json.dumps(CHAT).encode()
    with socket.create_connection(("127.0.0.1", phase.nginx.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: bool(phase.sidecar.decides()), timeout=2, every=0.002)
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(
        lambda: any(o.get("i") == did and o["k"] in ("drop", "end") for o in phase.sidecar.outcomes()),
        timeout=2,
    )


def test_a_stream_retried_after_a_failed_candidate_is_not_taken_for_cut(phase: Phase) -> None:
    """After a retry $upstream_response_time reads "0.001, -": the stream's flushes while the second
    try runs are not the end of a cut stream."""
    phase.route("503", "stream")
    status, headers, body = phase.post()
    assert status == 200 and headers["X-Kvgate-Backend"] == "stream"
    assert b"closed the stream" not in body and body.count(b"data: ") == 6
    wait_until(lambda: any(o["k"] == "end" for o in phase.sidecar.outcomes()))
    end = next(o for o in phase.sidecar.outcomes() if o["k"] == "end")
    assert end["s"] == 200 and "c" not in end


def test_a_short_budget_moves_a_json_request_on_but_never_cuts_a_stream(stack: Supervisor) -> None:
    """The sidecar's first-byte budget (here 100 ms) is the whole read timeout of a JSON try: the slow
    backend is left for the next candidate. A stream's headers come at once, so past them the same
    timeout would only cut the stream at its first silence (the prefill, 0.3 s here; on a busy real
    vLLM 5-7 s): a stream's try waits at least first_byte_stream_min_ms."""
    p = Phase(stack, first_byte_timeout_ms=3000, first_byte_stream_min_ms=1000)
    try:

        def answer(names: tuple[str, ...]) -> Any:
            cands = [[n, p.addr(n)] for n in names]
            return lambda msg: {"i": msg["i"], "c": cands, "r": "ring", "fb": [100] * len(cands)}

        p.sidecar.answer = answer(("slow", "ok-a"))
        t0 = time.monotonic()
        status, headers, _ = p.post()
        assert status == 200 and headers["X-Kvgate-Backend"] == "ok-a"
        assert time.monotonic() - t0 < 2.0  # 0.1 s + 1 token x 0.1 s there, not the slow one's 3 s
        p.sidecar.answer = answer(("stream",))
        status, headers, body = p.post({**CHAT, "stream": True})
        assert status == 200 and headers["X-Kvgate-Backend"] == "stream"
        assert body.count(b"data: ") == 6 and b"closed the stream" not in body, body
    finally:
        p.sidecar.close()


def test_a_late_decision_is_dropped_and_the_request_falls_open(phase: Phase) -> None:
    """A sidecar that answers after the 50 ms budget may have counted the request: Nginx reports the
    decision it did not use as dropped, so the count ends."""
    phase.route("ok-a")
    phase.sidecar.delay_s = 0.2
    status, headers, _ = phase.post(headers={"X-Session-ID": "late"})
    assert status == 200 and headers["X-Kvgate-Route"] == "fail-open"
    did = phase.sidecar.decides()[-1]["i"]
    wait_until(lambda: {"k": "drop", "i": did} in phase.sidecar.outcomes(), timeout=2)
    wait_until(lambda: any(o["k"] == "end" and "i" not in o for o in phase.sidecar.outcomes()))
    metrics = http_json("GET", phase.nginx.url + "/kvgate/metrics")[1]
    assert 'kvgate_gateway_failopen_total{reason="timeout"} 1' in metrics


def test_an_answer_in_time_that_a_busy_worker_reads_late_is_used_not_dropped(stack: Supervisor) -> None:
    """Nginx expires timers before it reads sockets that became readable while it ran handlers: a
    decision that arrived within the budget while the only worker was busy must still be used (read
    once more before falling open), and counted as a late reply, not a fail-open."""
    spin_port = free_port()
    spin = f"""server {{ listen 127.0.0.1:{spin_port}; location / {{ content_by_lua_block {{
        local stop = ngx.now() + 0.6
        while ngx.now() < stop do ngx.update_time() end   -- the worker runs nothing else meanwhile
        ngx.say("spun")
    }} }} }}"""
    p = Phase(stack, extra_servers=spin, decision_timeout_ms=300)
    try:
        cands = [["ok-a", p.addr("ok-a")]]
        busy: list[threading.Thread] = []

        def answer(msg: dict[str, Any]) -> list[dict[str, Any] | float]:
            # The decision is being waited for: make the worker busy past its timer, then answer
            # while it is (150 ms, within the 300 ms budget; the spin lasts 600 ms).
            t = threading.Thread(target=urllib.request.urlopen, args=(f"http://127.0.0.1:{spin_port}/",))
            t.start()
            busy.append(t)
            return [0.15, {"i": msg["i"], "c": cands, "r": "ring"}]

        p.sidecar.answer = answer
        status, headers, _ = p.post(headers={"X-Session-ID": "busy"})
        assert status == 200 and headers["X-Kvgate-Route"] == "ring"
        metrics = http_json("GET", p.nginx.url + "/kvgate/metrics")[1]
        assert 'kvgate_gateway_late_replies_total{call="decide"} 1' in metrics
        assert "kvgate_gateway_failopen_total{" not in metrics
        for t in busy:
            t.join(5)
    finally:
        p.sidecar.close()


def test_reports_of_requests_still_open_at_a_reload_are_not_lost(phase: Phase, stack: Supervisor) -> None:
    """An exiting worker hands its reports to the shared dict; the new workers send them."""
    import os
    import signal
    import threading

    phase.route("stream")
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(phase.post()[0])) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(phase.sidecar.decides()) == 4)
    os.kill(stack.procs["phase-nginx"].pid, signal.SIGHUP)  # nginx -s reload
    for t in threads:
        t.join(10)
    assert results == [200] * 4
    wait_until(lambda: sum(1 for o in phase.sidecar.outcomes() if o["k"] == "end") == 4, timeout=5)


def test_the_last_candidates_own_error_passes_through(phase: Phase) -> None:
    phase.route("refused", "503")
    status, _, body = phase.post()
    assert status == 503 and json.loads(body) == {"error": "busy"}


def test_a_backend_too_slow_is_a_json_504(phase: Phase) -> None:
    phase.route("slow")
    t0 = time.monotonic()
    status, _, body = phase.post()
    assert status == 504 and json.loads(body)["error"]["type"] == "GatewayTimeoutError"
    assert time.monotonic() - t0 < 3


# -- fail-open ---------------------------------------------------------------------------------------
def rendezvous(key: str, ids: list[str]) -> list[str]:
    """The order Lua's failopen.order gives (ngx.crc32_long is zlib's crc32)."""
    return sorted(ids, key=lambda i: zlib.crc32(f"{key}|{i}".encode()), reverse=True)


@pytest.mark.parametrize("how", ["silent", "error", "version"])
def test_a_sidecar_that_fails_routes_fail_open_in_rendezvous_order(phase: Phase, how: str) -> None:
    if how == "silent":
        phase.sidecar.answer = lambda msg: None  # never answers: the 50 ms budget runs out
    elif how == "error":
        phase.sidecar.answer = lambda msg: {"e": "bad_request", "msg": "no"}
    else:
        phase.route("ok-a")
        phase.sidecar.version = 99
    for session in ("alpha", "beta", "gamma", "delta"):
        t0 = time.monotonic()
        status, headers, _ = phase.post(headers={"X-Session-ID": session})
        assert status == 200 and headers["X-Kvgate-Route"] == "fail-open"
        assert headers["X-Kvgate-Backend"] == rendezvous(f"h:{session}", ["ok-a", "ok-b", "ok-c"])[0]
        assert time.monotonic() - t0 < 1.0


def test_fail_open_retries_follow_the_rendezvous_order(phase: Phase, stack: Supervisor) -> None:
    phase.sidecar.answer = lambda msg: None
    key = "h:retry-order"
    first, second, _ = rendezvous(key, ["ok-a", "ok-b", "ok-c"])
    # The first choice's address now refuses connections: the second choice answers.
    phase.sidecar.peers = [
        (n, phase.addr("refused") if n == first else phase.addr(n)) for n in ("ok-a", "ok-b", "ok-c")
    ]
    phase.sidecar.peers_version = 2
    wait_until(lambda: http_json("GET", phase.nginx.url + "/kvgate/health")[1]["peers_version"] == 2)
    status, headers, _ = phase.post(headers={"X-Session-ID": "retry-order"})
    assert status == 200 and headers["X-Kvgate-Backend"] == second


def test_no_peer_and_no_sidecar_is_a_json_503(stack: Supervisor) -> None:
    sock = stack.run_dir / "none.sock"
    mock = MockSidecar(sock, [])
    try:
        mock.answer = lambda msg: {"e": "bad_request", "msg": "no"}
        nginx = PhaseNginx(stack, sock, "")
        status, body = http_json("POST", nginx.url + "/v1/chat/completions", CHAT)
        assert status == 503 and body["error"]["code"] == 503
    finally:
        mock.close()


# -- reports -----------------------------------------------------------------------------------------
def test_reports_are_batched_and_every_request_is_reported(phase: Phase) -> None:
    phase.route("ok-a")
    for _ in range(30):
        assert phase.post()[0] == 200
    wait_until(lambda: sum(1 for o in phase.sidecar.outcomes() if o["k"] == "end") == 30)
    ends = {o["i"] for o in phase.sidecar.outcomes() if o["k"] == "end"}
    assert ends == {m["i"] for m in phase.sidecar.decides()}  # one end per decision
    reports = phase.sidecar.reports()
    assert len(reports) < 30  # one line carries many outcomes (flushed every 100 ms)
    assert max(len(r["o"]) for r in reports) > 1


def test_reports_lost_to_a_dead_sidecar_never_hold_a_response(phase: Phase) -> None:
    phase.route("ok-c")
    phase.sidecar.close()  # decisions fail open and reports have nowhere to go
    t0 = time.monotonic()
    for _ in range(10):
        status, headers, _ = phase.post()
        assert status == 200 and headers["X-Kvgate-Route"] == "fail-open"
    assert time.monotonic() - t0 < 2
    wait_until(lambda: "dropped" in phase.nginx.log() or "failed to connect" in phase.nginx.log())


# -- every error the gateway makes --------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, headers, status, param",
    [
        (b"{not json", {}, 400, None),
        (b"", {}, 400, None),
        (b'{"model":"m","user":"\xed\xa0\x80","messages":[]}', {}, 400, "user"),
        (b'{"model":"unknown","messages":[{"role":"user","content":"x"}]}', {}, 404, "model"),
        (b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 20_000 + b'"}]}', {}, 413, None),
    ],
)
def test_gateway_made_errors_are_openai_json(
    stack: Supervisor, raw: bytes, headers: dict[str, str], status: int, param: str | None
) -> None:
    sock = stack.run_dir / "mock.sock"
    mock = MockSidecar(sock, [("ok", "127.0.0.1:1")])
    mock.answer = lambda msg: {"e": "unknown_model", "msg": "The model `unknown` does not exist."}
    try:
        nginx = PhaseNginx(stack, sock, "", client_max_body_size="16k")
        req = urllib.request.Request(
            nginx.url + "/v1/chat/completions", data=raw, method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                got, ctype, text = resp.status, resp.headers["Content-Type"], resp.read()
        except urllib.error.HTTPError as exc:
            got, ctype, text = exc.code, exc.headers["Content-Type"], exc.read()
            exc.close()
        err = json.loads(text)["error"]
        assert got == status and ctype == "application/json"
        assert err["code"] == status and err["param"] == param and err["message"]
    finally:
        mock.close()


def test_other_v1_routes_go_to_a_backend_and_odd_paths_are_refused(phase: Phase) -> None:
    phase.route("ok-b")
    status, body = http_json("GET", phase.nginx.url + "/v1/some/new-route")
    assert status == 200 and body == {"served_by": "ok-b"}
    status, body = http_json("GET", phase.nginx.url + "/v1/a%20b")
    assert status == 404 and body["error"]["type"] == "NotFoundError"


def test_no_lua_errors_in_the_log(phase: Phase) -> None:
    phase.route("refused", "ok-a")
    phase.post()
    phase.post(raw=b"{bad")
    text = phase.nginx.log()
    assert "lua entry thread aborted" not in text and "runtime error" not in text, text[-2000:]
