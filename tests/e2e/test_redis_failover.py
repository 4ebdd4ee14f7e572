"""Redis as a distributed engine, end to end: two gateway replicas (real Nginx and Lua, sidecars) on a
Sentinel-managed primary or on a Redis Cluster; the primary (or a cluster primary) is killed while
clients keep sending chat turns through both replicas with the official openai client. No request
fails; the bindings made while Redis was failing over are in Redis afterwards; and the replicas agree
again on every conversation's backend. (While Redis is away each replica binds new sessions from its
own view, the ring mostly making them agree; that is the designed fallback, not measured here.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_ports
from kvgate.tools.redis_topologies import cluster_ports, start_cluster, start_sentinel_set
from redis.cluster import RedisCluster

from tests.conftest import MODEL
from tests.e2e.test_gateway import client
from tests.helpers import Gateway, start_backends

pytestmark = pytest.mark.e2e
BACKENDS = 3


def gateways(stack: Supervisor, url: str) -> list[Gateway]:
    sim = start_backends(stack, BACKENDS)
    # Redis budgets long enough for a loaded test machine; failures still mark Redis down at once.
    rc = {"url": url, "retry_after_ms": 200, "timeout_ms": 200, "connect_timeout_ms": 200}
    return [Gateway(stack, f"gw{i}", None, sim, BACKENDS, extra={"redis": rc}) for i in range(2)]


def converse(gws: list[Gateway], kill: Callable[[], None], seconds: float = 8.0) -> dict[str, set[str]]:
    """Chat turns of many sessions through both replicas, ``kill`` called a second in; returns each
    session's backends. Any failed request fails the test."""
    backends: dict[str, set[str]] = {}
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def worker(w: int) -> None:
        turn = 0
        while time.monotonic() < stop:
            session = f"s{w}-{turn // 3}"  # three turns each, the replicas taking turns
            c = client(gws[turn % 2].url)
            try:
                raw = c.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"{session} turn {turn} " + "words " * 30}],
                    max_tokens=2,
                    extra_headers={"X-Session-ID": session},
                )
                raw.parse()
                backends.setdefault(session, set()).add(raw.headers["X-Kvgate-Backend"])
            except Exception as exc:  # every failure is reported, none may happen
                errors.append(f"{session}: {exc!r}")
            turn += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    kill()
    for t in threads:
        t.join(seconds + 30)
    assert not errors, errors[:5]
    return backends


def turn(gw: Gateway, session: str) -> str:
    raw = client(gw.url).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"{session} once more " + "words " * 30}],
        max_tokens=2,
        extra_headers={"X-Session-ID": session},
    )
    raw.parse()
    return raw.headers["X-Kvgate-Backend"]


def agreed(gws: list[Gateway], sessions: set[str], r: redis.Redis | RedisCluster) -> None:
    """One more turn of every session through each replica: both send it where Redis says."""
    for session in sorted(sessions):
        here = {turn(gw, session) for gw in gws}
        assert len(here) == 1, (session, here)
        assert _get(r, session) == here.pop().encode(), session


def bound_in(r: redis.Redis | RedisCluster, sessions: set[str], deadline_s: float = 10.0) -> set[str]:
    """The sessions whose binding Redis holds, waiting for write-backs up to ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        found = {s for s in sessions if _get(r, s) is not None}
        if found == sessions or time.monotonic() > end:
            return found
        time.sleep(0.2)


def _get(r: redis.Redis | RedisCluster, session: str) -> bytes | None:
    for key in (f"kvgate:s:h:{session}", f"kvgate:s:{{}}h:{session}"):  # one server, or a cluster
        value = r.get(key)
        if value is not None:
            return value  # type: ignore[no-any-return]
    return None


def test_a_sentinel_failover_under_load_fails_no_request(tmp_path: Path) -> None:
    stack = Supervisor(tmp_path / "run")
    try:
        primary, replica, *sentinels = (free_ports(5) + i for i in range(5))
        gws = gateways(stack, start_sentinel_set(stack, primary, replica, sentinels))
        seen = converse(gws, lambda: stack.kill("redis-primary"))
        promoted = redis.Redis(port=replica, socket_timeout=2)
        assert promoted.info("replication")["role"] == "master"  # the Sentinels failed over
        assert bound_in(promoted, set(seen)) == set(seen)
        agreed(gws, set(seen), promoted)
        promoted.close()
    finally:
        stack.stop_all()


def test_a_cluster_primary_lost_under_load_fails_no_request(tmp_path: Path) -> None:
    stack = Supervisor(tmp_path / "run")
    try:
        ports = cluster_ports(6)
        gws = gateways(stack, start_cluster(stack, ports))
        cluster = RedisCluster(host="127.0.0.1", port=ports[1], socket_timeout=2)
        victim = cluster.get_node_from_key("kvgate:s:{}h:s0-0")
        assert victim is not None
        seen = converse(gws, lambda: stack.kill(f"redis-cluster-{victim.port}"))
        cluster.close()
        alive = next(p for p in ports if p != victim.port)
        cluster = RedisCluster(host="127.0.0.1", port=alive, socket_timeout=2)
        assert bound_in(cluster, set(seen)) == set(seen)
        agreed(gws, set(seen), cluster)
        cluster.close()
    finally:
        stack.stop_all()
