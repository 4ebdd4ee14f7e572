"""Local Redis topologies for tests and ``kvgate up --redis sentinel|cluster``: a Sentinel-managed
primary with a replica, or a Redis Cluster of primaries each with a replica. Every process is a plain
``redis-server`` under the caller's ``Supervisor`` (Debian's redis-server runs Sentinel too, with
``--sentinel``); each returns the URL kvgate connects with.

Failure detection is set short (1 s), as a test wants it; production values are the operator's.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time

from kvgate.tools.launcher import Supervisor, executable
from kvgate.tools.readiness import wait_listening

SERVICE = "kvgate"
DOWN_AFTER_MS = 1000


def start_sentinel_set(sup: Supervisor, primary: int, replica: int, sentinels: list[int]) -> str:
    """A primary on ``primary``, its replica on ``replica``, and one Sentinel per port in
    ``sentinels`` watching them (quorum: a majority); returns ``redis+sentinel://.../kvgate``."""
    sup.start_redis(primary, "redis-primary", "--repl-diskless-sync-delay", "0")
    sup.start_redis(replica, "redis-replica", "--replicaof", "127.0.0.1", str(primary))
    _wait_for(replica, b"master_link_status:up", "info", "replication")
    quorum = len(sentinels) // 2 + 1
    for port in sentinels:
        conf = sup.run_dir / f"sentinel-{port}.conf"  # Sentinel rewrites its file: one each
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {sup.run_dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {DOWN_AFTER_MS * 3}\n"
        )
        sup.spawn(
            f"redis-sentinel-{port}",
            [executable("redis-server"), str(conf), "--sentinel"],
            ready=lambda p, port=port: wait_listening(p, port=port),  # type: ignore[misc]
        )
    return sentinel_url(sentinels)


def _ports(kind: str, first: int) -> list[int]:
    return list(range(first, first + (5 if kind == "sentinel" else 6)))


def url(kind: str, first: int) -> str:
    """The URL of the ``kind`` ("sentinel" or "cluster") topology ``start`` runs from port ``first``."""
    ports = _ports(kind, first)
    return sentinel_url(ports[2:]) if kind == "sentinel" else cluster_url(ports)


def start(sup: Supervisor, kind: str, first: int) -> str:
    """``kvgate up --redis sentinel|cluster``: the topology on consecutive ports from ``first``."""
    ports = _ports(kind, first)
    if kind == "sentinel":
        return start_sentinel_set(sup, ports[0], ports[1], ports[2:])
    return start_cluster(sup, ports)


def sentinel_url(sentinels: list[int]) -> str:
    return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in sentinels) + f"/{SERVICE}"


def cluster_url(ports: list[int]) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)


def start_cluster(sup: Supervisor, ports: list[int], timeout: float = 20.0) -> str:
    """A Redis Cluster over ``ports``: the first half primaries (at least 3), the rest one replica
    each; returns ``redis+cluster://...`` naming every node."""
    for port in ports:
        sup.start_redis(
            port,
            f"redis-cluster-{port}",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"nodes-{port}.conf",
            "--cluster-node-timeout",
            str(DOWN_AFTER_MS),
            "--repl-diskless-sync-delay",
            "0",
        )
    replicas = 1 if len(ports) >= 6 else 0
    subprocess.run(
        [
            executable("redis-cli"),
            "--cluster",
            "create",
            *(f"127.0.0.1:{p}" for p in ports),
            "--cluster-replicas",
            str(replicas),
            "--cluster-yes",
        ],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    for port in ports:  # every node agrees the cluster is up before anyone is told its URL
        _wait_for(port, b"cluster_state:ok", "cluster", "info", timeout=timeout)
    for port in ports[len(ports) - len(ports) * replicas // 2 :]:
        # A replica that has not synced yet cannot take over its primary: wait for every link.
        _wait_for(port, b"master_link_status:up", "info", "replication", timeout=timeout)
    return cluster_url(ports)


def cluster_ports(n: int) -> list[int]:
    """``n`` free ports whose cluster-bus ports (each + 10000) are free too: below the ephemeral
    range, where a kernel-chosen free port would put the bus past 65535."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 30_000)
        wanted = [p for i in range(n) for p in (base + i, base + i + 10_000)]
        if all(_free(p) for p in wanted):
            return [base + i for i in range(n)]
    raise OSError(f"no {n} free ports for a redis cluster")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_for(port: int, text: bytes, *command: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in _cli(port, *command):
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis on {port}: no {text.decode()!r} within {timeout} s")
        time.sleep(0.1)


def _cli(port: int, *args: str) -> bytes:
    done = subprocess.run(
        [executable("redis-cli"), "-p", str(port), *args], capture_output=True, timeout=5, check=False
    )
    return done.stdout
