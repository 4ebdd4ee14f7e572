"""The fault suite: faults injected into a live stack under a steady load, each scored from the
clients' side.

One stack (simulated backends, redis-server, one sidecar, Nginx) runs under a supervisor that heals
what dies, as ``kvgate up`` does; ``concurrency`` clients keep streaming chat requests. Each scenario
injects a fault, holds it, heals it, and keeps the load on a little longer. Every request is one of:

* ok: a 200 whose stream ended with ``[DONE]``;
* failed by design: what no gateway can hide: a stream the backend cut after tokens had reached the
  client (it gets an error event), or a refusal while no backend at all could serve;
* failed: anything else, such as an error before the first byte while a healthy backend existed, a
  non-JSON error, a hang.

Reported per scenario: requests, ok, failed by design, failed, the time to recover (from the fault's
start, or from the heal for faults that need one, to the first second of only ok requests), and
whether every in-flight count was back to zero within 5 s of idle. The test suite runs short
versions (``tests/e2e/test_faults.py``); ``kvgate-bench faults`` runs them at length, the fuzz corpus, and a
soak that checks memory.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from kvgate.public import Config, NginxSettings, hash_key
from kvgate.tools.launcher import (
    Replica,
    Supervisor,
    free_port,
    free_ports,
    get_json,
    launch_replica,
    process_tree,
)

from kvgate_bench import fuzz, report

MODEL = "sim-model"
OK, BY_DESIGN, FAILED = "ok", "failed by design", "failed"
# The stack checks API keys: the load's key, a key under a token limit, and one that floods the queue.
LOAD_KEY, LIMITED_KEY, FLOOD_KEY = "sk-fault-load-000001", "sk-fault-limited-0002", "sk-fault-flood-00003"
LIMITED_TOKENS = 1500  # the limited key's tokens a minute
# How long in-flight counts may take to reach 0 once the load stops: reports reach the sidecar
# within a flush or two, but on a loaded machine (CI) a restarted sidecar's first ones come later.
IDLE_WAIT_S = 5.0


@dataclass(frozen=True, slots=True)
class Result:
    start: float
    end: float
    outcome: str
    detail: str = ""


def one_stream(port: int, n: int, session: str | None = None, key: str = LOAD_KEY) -> Result:
    """One streaming chat request over a fresh connection, classified."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {n} " + "w " * 40}],
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if session:
        headers["X-Session-ID"] = session
    t0 = time.monotonic()
    # A patient client (the openai SDK waits 600 s): a stream that met a hung backend is moved on
    # after the stream's floor (gateway.first_byte_stream_min_ms, 30 s), and must then be served.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        try:
            data = resp.read()
        except http.client.IncompleteRead as cut:
            data = cut.partial  # the connection closed mid-response: judge what arrived
    except (OSError, http.client.HTTPException) as exc:
        return Result(t0, time.monotonic(), FAILED, f"transport: {type(exc).__name__}")
    finally:
        conn.close()
    end = time.monotonic()
    text = data.decode(errors="replace")
    if resp.status == 200:
        if text.rstrip().endswith("data: [DONE]"):
            return Result(t0, end, OK)
        if "closed the stream before it finished" in text and '"content"' in text:
            return Result(t0, end, BY_DESIGN, "stream cut after tokens")
        return Result(t0, end, FAILED, "stream ended without [DONE]")
    try:
        json.loads(text)
    except ValueError:
        return Result(t0, end, FAILED, f"{resp.status} not JSON")
    return Result(t0, end, FAILED, f"status {resp.status}")


class Load:
    """``concurrency`` clients streaming requests back to back until stopped."""

    def __init__(self, port: int, concurrency: int) -> None:
        self.port = port
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._n = 0
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(concurrency)
        ]

    def _client(self, i: int) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._n += 1
                n = self._n
            r = one_stream(self.port, n, f"client-{i}" if i % 2 else None)
            with self._lock:
                self.results.append(r)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


@dataclass
class Stack:
    """The stack under test, and how to hurt it."""

    sup: Supervisor
    sim_port: int
    backends: int
    redis_port: int
    replica: Replica
    supervising: threading.Event = field(default_factory=threading.Event)
    # What a scenario's attacker saw (tokens a limited key got, connections a rogue listener got),
    # by scenario name: the faults' own promises, beside the load's score.
    observed: dict[str, dict[str, Any]] = field(default_factory=dict)
    _attack: list[threading.Thread] = field(default_factory=list)
    _attacking: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(
        cls,
        run_dir: Path,
        backends: int = 3,
        prefix_index_blocks: int | None = None,
        local_sessions: int | None = None,
        trace_memory: bool = False,
    ) -> Stack:
        sup = Supervisor(run_dir)
        try:
            return cls._start(sup, backends, prefix_index_blocks, local_sessions, trace_memory)
        except BaseException:
            sup.stop_all()  # a stack that failed to start leaves no process behind
            raise

    @classmethod
    def _start(
        cls,
        sup: Supervisor,
        backends: int,
        prefix_index_blocks: int | None,
        local_sessions: int | None,
        trace_memory: bool,
    ) -> Stack:
        sim = free_ports(backends)
        sup.start_sim(sim, backends, "sim", "--model", MODEL, "--seed", "7")
        redis_port = free_port()
        sup.start_redis(redis_port, "redis", "--enable-debug-command", "local")  # for DEBUG SLEEP
        sock = str(sup.run_dir / "sidecar.sock")
        cfg = {
            "listen": {"socket": sock, "http_port": free_port(), "admin_token": "t"},
            "redis": {
                "url": f"redis://127.0.0.1:{redis_port}/0",
                "retry_after_ms": 500,
                **({} if local_sessions is None else {"local_sessions": local_sessions}),
            },
            "scrape": {"interval_ms": 200, "timeout_ms": 150, "stale_after_ms": 1000, "unhealthy_after": 2},
            "outlier": {"base_ejection_ms": 2000},
            "auth": {
                "keys": [
                    {"name": "load", "sha256": hash_key(LOAD_KEY)},
                    {
                        "name": "limited",
                        "sha256": hash_key(LIMITED_KEY),
                        "rate": {"tokens_per_minute": LIMITED_TOKENS},
                    },
                    {"name": "flood", "sha256": hash_key(FLOOD_KEY)},
                ]
            },
            "limits": {"sync_ms": 200},
            # The queue takes a flood of long prompts; one key may hold half of it.
            "queue": {"enabled": True, "max_size": 32, "max_key_share": 0.5, "max_wait_ms": 30_000},
            # A smaller index reaches its bound within minutes: memory growth after that is a leak.
            "routing": {} if prefix_index_blocks is None else {"prefix_index_blocks": prefix_index_blocks},
            "backends": [{"id": f"sim-{i}", "url": f"http://127.0.0.1:{sim + i}"} for i in range(backends)],
        }
        port = free_port()
        # One config for both halves, with the shipped timeouts: a hung backend costs what it costs
        # a user of the defaults (the learned first-byte budget, its floor, then the next candidate).
        settings = NginxSettings.from_config(
            Config.from_mapping(cfg, {}), listen=f"127.0.0.1:{port}", run_dir=str(sup.run_dir)
        )
        # tracemalloc in the sidecar (slower): GET /debug/memory then names the allocation sites.
        env = {"PYTHONTRACEMALLOC": "1"} if trace_memory else None
        replica = launch_replica(sup, "gw", cfg, settings, env=env)
        stack = cls(sup, sim, backends, redis_port, replica)
        threading.Thread(target=stack._supervise, daemon=True).start()
        return stack

    def _supervise(self) -> None:
        while not self.supervising.is_set():
            self.sup.supervise()
            time.sleep(0.2)

    def stop(self) -> None:
        self.supervising.set()
        self.sup.stop_all()

    def sidecar_memory(self, objects: bool = False) -> dict[str, Any]:
        """The sidecar's ``GET /debug/memory``; empty when it does not answer (a fault may hold it)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.replica.http_port, timeout=30)
        try:
            conn.request(
                "GET",
                "/debug/memory" + ("?objects=1" if objects else ""),
                headers={"Authorization": "Bearer t"},
            )
            resp = conn.getresponse()
            return json.loads(resp.read()) if resp.status == 200 else {}
        except OSError:
            return {}
        finally:
            conn.close()

    @property
    def port(self) -> int:
        assert self.replica.port is not None
        return self.replica.port

    def sim(self, i: int) -> str:
        return f"http://127.0.0.1:{self.sim_port + i}"

    def fault(self, i: int, **faults: Any) -> None:
        _post(self.sim(i) + "/sim/faults", faults)

    def heal(self) -> None:
        for i in range(self.backends):
            _post(self.sim(i) + "/sim/faults", None, "DELETE")

    def signal(self, name: str, sig: int) -> None:
        proc = self.sup.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    def inflight(self) -> int:
        backends = get_json(self.replica.http + "/v1/backends")["backends"]
        return int(sum(b["inflight"] + b["inflight_tokens"] for b in backends))

    def admin(self, method: str, path: str, body: Any = None) -> None:
        _post(self.replica.http + path, body, method, {"Authorization": "Bearer t"})


def _post(url: str, body: Any, method: str = "POST", headers: dict[str, str] | None = None) -> None:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


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


@dataclass
class Score:
    scenario: str
    requests: int
    ok: int
    failed_by_design: int
    failed: int
    recover_s: float | None
    idle_zero_s: float | None  # seconds until every in-flight count was 0, once idle (None: not in 5 s)
    failures: list[str] = field(default_factory=list)


def score(name: str, results: Sequence[Result], fault_at: float, heal_at: float, total_outage: bool) -> Score:
    ok = sum(1 for r in results if r.outcome == OK)
    by_design = sum(1 for r in results if r.outcome == BY_DESIGN)
    failed = [r for r in results if r.outcome == FAILED]
    if total_outage:
        # No backend could serve between the fault and the heal: those refusals are by design.
        designed = [r for r in failed if r.start < heal_at and r.end > fault_at]
        by_design += len(designed)
        failed = [r for r in failed if r not in designed]
    # Recovered: the last request that was not ok, counted from the heal (which for a fault that heals
    # itself is the fault), when ok requests came after it.
    recover = None
    ends = sorted(results, key=lambda r: r.end)
    last_bad = max((r.end for r in ends if r.outcome != OK and r.end >= fault_at), default=None)
    if last_bad is None:
        recover = 0.0
    elif any(r.outcome == OK and r.start > last_bad for r in ends):
        recover = max(0.0, last_bad - heal_at)
    return Score(
        name, len(results), ok, by_design, len(failed), recover, None, sorted({r.detail for r in failed})
    )


def run_scenario(
    stack: Stack, sc: Scenario, concurrency: int, before: float, hold: float, after: float
) -> Score:
    with Load(stack.port, concurrency) as load:
        time.sleep(before)
        fault_at = time.monotonic()
        sc.inject(stack)
        time.sleep(hold)
        sc.heal(stack)
        heal_at = time.monotonic()  # once healed: requests that started before may still fail by design
        time.sleep(after)
    s = score(sc.name, load.results, fault_at, fault_at if sc.self_healing else heal_at, sc.total_outage)
    idle = time.monotonic()
    while time.monotonic() - idle < IDLE_WAIT_S:
        try:
            if stack.inflight() == 0:
                s.idle_zero_s = round(time.monotonic() - idle, 2)
                break
        except OSError:
            pass
        time.sleep(0.05)
    return s


def table(scores: Sequence[Score]) -> str:
    lines = [
        "| scenario | requests | ok | failed by design | failed | recovered after s | in flight 0 idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        rec = "n/a" if s.recover_s is None else f"{s.recover_s:.1f}"
        idle = "no" if s.idle_zero_s is None else f"yes ({s.idle_zero_s:.2f} s)"
        lines.append(
            f"| {s.scenario} | {s.requests} | {s.ok} | {s.failed_by_design} | {s.failed} | {rec} | {idle} |"
        )
    return "\n".join(lines)


def rss_kb(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def gateway_pids(stack: Stack) -> list[int]:
    out = []
    for name in (stack.replica.sidecar_name, stack.replica.nginx_name):
        proc = stack.sup.procs.get(name)
        if proc is not None:
            out += process_tree(proc.pid)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvgate-bench faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--before", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=10.0)
    p.add_argument("--after", type=float, default=10.0)
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), help="names from the list above")
    p.add_argument("--fuzz", type=int, default=12_000, help="malformed requests to send (0: none)")
    p.add_argument("--soak", type=float, default=0.0, help="seconds of soak with faults, measuring memory")
    p.add_argument(
        "--prefix-index-blocks",
        type=int,
        default=None,
        help="the sidecar's prefix-index bound (smaller: reached early, so later growth is a leak)",
    )
    p.add_argument(
        "--local-sessions",
        type=int,
        default=None,
        help="the sidecar's local session-map bound (each unkeyed soak request makes a new prefix key)",
    )
    p.add_argument(
        "--trace-memory",
        action="store_true",
        help="run the sidecar under tracemalloc; the soak then reports the allocation sites that grew",
    )
    p.add_argument("--out", default="bench-results/faults")
    args = p.parse_args(argv)
    out = Path(args.out)
    stack = Stack.start(
        out / "run",
        prefix_index_blocks=args.prefix_index_blocks,
        local_sessions=args.local_sessions,
        trace_memory=args.trace_memory,
    )
    scores: list[Score] = []
    extra: dict[str, Any] = {}
    try:
        for name in args.scenarios:
            sc = SCENARIOS[name]
            s = run_scenario(stack, sc, args.concurrency, args.before, args.hold, args.after)
            scores.append(s)
            print(table([s]).splitlines()[-1], flush=True)
            if name in stack.observed:  # what the scenario's attacker saw
                print(f"  {name}: {json.dumps(stack.observed[name])}", flush=True)
        if args.fuzz:
            extra["fuzz"] = asdict(fuzz.run(stack.port, args.fuzz, key=LOAD_KEY))
            print(f"fuzz: {extra['fuzz']}", flush=True)
        if args.soak:
            extra["soak"] = soak(stack, args.soak, args.concurrency)
            print(f"soak: {extra['soak']}", flush=True)
    finally:
        stack.stop()
    md = table(scores)
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md + "\n")
    report.write_json(
        out / "report.json",
        {
            "header": report.header(["faults", *(argv or [])]),
            "scores": [asdict(s) for s in scores],
            "observed": stack.observed,
            **extra,
        },
    )
    return 0


def soak(stack: Stack, seconds: float, concurrency: int) -> dict[str, Any]:
    """Load with faults cycling through the scenarios for ``seconds`` (those that replace a gateway
    process left out); every request classified; the resident memory of the sidecar and each Nginx
    process after a warm-up and at the end; the sidecar's live objects by type after the warm-up and
    once the load has stopped."""
    cycle = [s for s in SCENARIOS.values() if not s.total_outage and not s.replaces_gateway]
    with Load(stack.port, concurrency) as load:
        time.sleep(30)
        pids = gateway_pids(stack)
        start_rss = {pid: rss_kb([pid]) for pid in pids}
        first = stack.sidecar_memory(objects=True)
        samples: list[tuple[float, int]] = []  # (seconds into the soak, total RSS kB), once a minute
        structures: list[tuple[float, dict[str, int]]] = []  # the sidecar's bounded structures, likewise
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < seconds:
            if not samples or time.monotonic() - t0 - samples[-1][0] >= 60:
                at = round(time.monotonic() - t0)
                samples.append((at, rss_kb(pids)))
                structures.append((at, stack.sidecar_memory().get("structures", {})))
            sc = cycle[i % len(cycle)]
            sc.inject(stack)
            time.sleep(5)
            sc.heal(stack)
            time.sleep(10)
            i += 1
        end_rss = {pid: rss_kb([pid]) for pid in pids}
        samples.append((round(time.monotonic() - t0), rss_kb(pids)))
    # The closing heap walk once the load has stopped and its connections have closed, so that what
    # it counts is what stays, not what was in use at that instant.
    time.sleep(3)
    last = stack.sidecar_memory(objects=True)
    structures.append((round(time.monotonic() - t0), last.get("structures", {})))
    lived = [pid for pid in pids if end_rss[pid] > 0]
    start, end = sum(start_rss[p] for p in lived), sum(end_rss[p] for p in lived)
    failures: dict[str, int] = {}
    for r in load.results:
        if r.outcome == FAILED:
            failures[r.detail] = failures.get(r.detail, 0) + 1
    return {
        "seconds": seconds,
        "scenarios": [s.name for s in cycle],
        "faults_injected": i,
        "requests": len(load.results),
        "ok": sum(1 for r in load.results if r.outcome == OK),
        "failed_by_design": sum(1 for r in load.results if r.outcome == BY_DESIGN),
        "failed": sum(failures.values()),
        "failures": failures,
        "processes": len(pids),
        "processes_lived_through": len(lived),
        "rss_start_kb": start,
        "rss_end_kb": end,
        "rss_growth": (end - start) / start if start else None,
        "rss_by_process_kb": {str(p): [start_rss[p], end_rss[p]] for p in pids},
        "rss_samples_kb": samples,
        "sidecar_structures": structures,
        "sidecar_objects_grown": _grown(first.get("objects", {}), last.get("objects", {})),
        "sidecar_allocations_grown": _grown(
            {a["site"]: a["kb"] for a in first.get("allocations", [])},
            {a["site"]: a["kb"] for a in last.get("allocations", [])},
        ),
    }


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What grew between two top-N listings, largest growth first (a name absent before counts from 0)."""
    delta = {k: round(v - before.get(k, 0), 1) for k, v in after.items()}
    return dict(sorted(((k, d) for k, d in delta.items() if d > 0), key=lambda kv: -kv[1])[:15])
