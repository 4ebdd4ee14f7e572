"""The fault suite's stack and load: a gateway (Nginx, sidecar, Redis) over simulated backends with
API keys on, and steady clients streaming through it, each request's result classified."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.public import Config, NginxSettings, hash_key
from kvgate.tools.launcher import Replica, Supervisor, launch_replica
from kvgate.tools.readiness import free_port, free_ports, get_json

MODEL = "sim-model"


OK, BY_DESIGN, FAILED = "ok", "failed by design", "failed"

# A client's wait for any one read. A stream that met a hung backend waits for its first-byte budget
# (between gateway.first_byte_stream_min_ms, 30 s, and the ceiling, 60 s) before the next candidate.
CLIENT_TIMEOUT_S = 60.0
JOIN_MARGIN_S = 15.0  # past a client's timeout, for its thread to score what it got


# The stack checks API keys: the load's key, a key under a token limit, and one that floods the queue.
LOAD_KEY, LIMITED_KEY, FLOOD_KEY = "sk-fault-load-000001", "sk-fault-limited-0002", "sk-fault-flood-00003"


LIMITED_TOKENS = 1500  # the limited key's tokens a minute


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
    # after its first-byte budget (see CLIENT_TIMEOUT_S), and must then be served.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
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
        # Every request the load started is scored, and the idle check after it starts only once
        # they have all ended: a stream still held by a hung backend is in flight, rightly.
        self._stop.set()
        deadline = time.monotonic() + CLIENT_TIMEOUT_S + JOIN_MARGIN_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        waiting = sum(t.is_alive() for t in self._threads)
        now = time.monotonic()
        with self._lock:
            self.results += [Result(now, now, FAILED, "client still waiting")] * waiting


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
        post(self.sim(i) + "/sim/faults", faults)

    def heal(self) -> None:
        for i in range(self.backends):
            post(self.sim(i) + "/sim/faults", None, "DELETE")

    def signal(self, name: str, sig: int) -> None:
        proc = self.sup.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    def inflight(self) -> int:
        backends = get_json(self.replica.http + "/v1/backends")["backends"]
        return int(sum(b["inflight"] + b["inflight_tokens"] for b in backends))

    def admin(self, method: str, path: str, body: Any = None) -> None:
        post(self.replica.http + path, body, method, {"Authorization": "Bearer t"})


def post(url: str, body: Any, method: str = "POST", headers: dict[str, str] | None = None) -> None:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()
