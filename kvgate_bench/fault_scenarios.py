"""The faults, each a scenario: what it breaks (inject), what repairs it (heal), and whether its
requests may fail by design. SCENARIOS names them for the suite and the command line."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from kvgate_bench.fault_stack import (
    FLOOD_KEY,
    LIMITED_KEY,
    MODEL,
    Stack,
)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    inject: Callable[[Stack], None]
    heal: Callable[[Stack], None]
    # A fault that leaves no backend able to serve: refusals then are by design.
    total_outage: bool = False
    # The fault heals itself (a restart by the supervisor): recovery counts from the fault.
    self_healing: bool = False
    # The fault replaces a gateway process (sidecar, Nginx workers): the soak leaves it out, so that
    # its memory figures are those of processes that lived through the whole soak.
    replaces_gateway: bool = False


def _noop(stack: Stack) -> None:
    pass


def _reloads(stack: Stack) -> None:
    for _ in range(5):
        stack.signal(stack.replica.nginx_name, signal.SIGHUP)
        time.sleep(0.3)


def _abort_storm(stack: Stack) -> None:
    import socket

    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x " * 4000}], "stream": True}
    )
    raw = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", stack.port), timeout=2) as s:
                s.sendall(raw)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass


def _slow_redis(stack: Stack) -> None:
    r = redis.Redis(port=stack.redis_port, socket_timeout=5)
    for _ in range(6):
        r.execute_command("DEBUG", "SLEEP", "0.3")  # type: ignore[no-untyped-call]  # Redis stalls 0.3 s
    r.close()


def _all_down(stack: Stack) -> None:
    for i in range(stack.backends):
        stack.fault(i, fail_rate=1.0, fail_status=503)


def _slow_metrics(stack: Stack) -> None:
    for i in range(stack.backends):
        stack.fault(i, metrics="slow", metrics_delay_ms=1000)


def _slow_probes(stack: Stack) -> None:
    """vLLM under heavy load: /metrics and /health both answer late on every replica."""
    for i in range(stack.backends):
        stack.fault(i, metrics="slow", metrics_delay_ms=1000, health_delay_ms=1000)


def _attack(stack: Stack, name: str, target: Callable[[], None], threads: int = 1) -> None:
    """Run ``target`` in a loop on ``threads`` threads until the scenario heals (``_calm``)."""
    stack._attacking.clear()

    def loop() -> None:
        while not stack._attacking.is_set():
            target()

    stack._attack = [threading.Thread(target=loop, daemon=True, name=name) for _ in range(threads)]
    for t in stack._attack:
        t.start()


def _calm(stack: Stack) -> None:
    stack._attacking.set()
    for t in stack._attack:
        t.join(60)
    stack._attack = []


def _stream_tokens(port: int, key: str, body: dict[str, Any]) -> tuple[int, int]:
    """(status, words streamed) of one stream with ``key``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return 0, 0
    finally:
        conn.close()
    words = 0
    for line in text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                words += len(((c.get("delta") or {}).get("content") or "").split())
    return resp.status, words


def _token_limit_attack(stack: Stack) -> None:
    """A key limited to LIMITED_TOKENS a minute streams without max_tokens, from two clients back to
    back: it gets at most its budget in any minute, then 429s; the load is not touched."""
    seen = stack.observed.setdefault("stream token limit", {"tokens_by_minute": {}, "statuses": {}})
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long story " * 20}],
        "ignore_eos": True,
    }

    def one() -> None:
        minute = str(int(time.time() // 60))  # the window it is admitted in
        status, words = _stream_tokens(stack.port, LIMITED_KEY, body)
        seen["tokens_by_minute"][minute] = seen["tokens_by_minute"].get(minute, 0) + words
        seen["statuses"][str(status)] = seen["statuses"].get(str(status), 0) + 1
        if status != 200:
            time.sleep(0.2)

    _attack(stack, "limited-key", one, threads=2)


def _rogue_port(stack: Stack) -> None:
    """A listener on another port of the backends' own host registers itself through Redis; it
    must never be adopted (no connection ever reaches it)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    seen = stack.observed.setdefault("rogue backend port", {"connections": 0})
    r = redis.Redis(port=stack.redis_port, socket_timeout=5)
    entry = {"id": "rogue", "url": f"http://127.0.0.1:{listener.getsockname()[1]}", "weight": 100.0}
    r.hset("kvgate:backends", "rogue", json.dumps({**entry, "labels": {}, "draining": False}))
    r.incr("kvgate:backends:v")
    r.close()

    def accept() -> None:
        try:
            conn, _ = listener.accept()
            conn.close()
            seen["connections"] += 1
        except OSError:
            if stack._attacking.is_set():
                listener.close()

    _attack(stack, "rogue-listener", accept)


def _rogue_gone(stack: Stack) -> None:
    _calm(stack)
    r = redis.Redis(port=stack.redis_port, socket_timeout=5)
    r.hdel("kvgate:backends", "rogue")
    r.incr("kvgate:backends:v")
    r.close()


def _queue_flood(stack: Stack) -> None:
    """One key sends long prompts from 40 clients at once: they saturate the backends and fill its
    share of the gateway queue (its excess is refused by name, by design); the load's key still gets
    in, waits its turn, and is served. Each prompt opens with its own words, as a flood meant to
    hurt would: one prompt sent again and again is a prefix-cache hit after the first, costs the
    backends almost nothing, and whether the key's share overflowed would depend on the machine."""
    seen = stack.observed.setdefault("queue flood", {"statuses": {}})
    sent = itertools.count()

    def one() -> None:
        content = f"flood {next(sent)} {os.getpid()} " + "flood " * 9000
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        status, _ = _stream_tokens(stack.port, FLOOD_KEY, body)
        seen["statuses"][str(status)] = seen["statuses"].get(str(status), 0) + 1

    _attack(stack, "flood", one, threads=40)


def _restart_redis(stack: Stack) -> None:
    stack.sup.start_redis(stack.redis_port, "redis", "--enable-debug-command", "local")


def _add_and_remove(stack: Stack) -> None:
    extra = stack.backends - 1  # re-register the last backend under a second id, then remove it
    stack.admin("POST", "/admin/backends", {"id": "extra", "url": stack.sim(extra)})
    time.sleep(1.0)
    stack.admin("DELETE", "/admin/backends/extra")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "backend refuses connections", lambda st: st.fault(0, refuse_for_s=3.0), _noop, self_healing=True
        ),
        Scenario(
            "backend hangs under load", lambda st: st.fault(0, latency_ms=120_000), lambda st: st.heal()
        ),
        Scenario(
            "backend answers 503",
            lambda st: st.fault(0, fail_rate=1.0, fail_status=503),
            lambda st: st.heal(),
        ),
        Scenario("backend cuts streams", lambda st: st.fault(0, abort_after_tokens=3), lambda st: st.heal()),
        Scenario("garbage metrics", lambda st: st.fault(0, metrics="garbage"), lambda st: st.heal()),
        Scenario("metrics slow everywhere", _slow_metrics, lambda st: st.heal()),
        Scenario("metrics and health slow everywhere", _slow_probes, lambda st: st.heal()),
        Scenario("backend 10x slow", lambda st: st.fault(0, latency_ms=300), lambda st: st.heal()),
        Scenario(
            "sidecar SIGKILL",
            lambda st: st.signal(st.replica.sidecar_name, signal.SIGKILL),
            _noop,
            self_healing=True,
            replaces_gateway=True,
        ),
        Scenario(
            "sidecar SIGSTOP",
            lambda st: st.signal(st.replica.sidecar_name, signal.SIGSTOP),
            lambda st: st.signal(st.replica.sidecar_name, signal.SIGCONT),
        ),
        Scenario(
            "sidecar restart",
            # SIGINT: stop at once (SIGTERM drains: it serves until the Nginx in front has gone).
            lambda st: st.signal(st.replica.sidecar_name, signal.SIGINT),
            _noop,
            self_healing=True,
            replaces_gateway=True,
        ),
        Scenario("redis SIGKILL", lambda st: st.sup.kill("redis"), _restart_redis),  # down until healed
        Scenario("slow redis", _slow_redis, _noop, self_healing=True),
        Scenario("all backends down", _all_down, lambda st: st.heal(), total_outage=True),
        Scenario("backend added and removed", _add_and_remove, _noop, self_healing=True),
        Scenario("stream token limit", _token_limit_attack, _calm),
        Scenario("rogue backend port", _rogue_port, _rogue_gone),
        Scenario("queue flood", _queue_flood, _calm),
        Scenario("five nginx reloads", _reloads, _noop, self_healing=True, replaces_gateway=True),
        Scenario("client abort storm", _abort_storm, _noop, self_healing=True),
    ]
}
