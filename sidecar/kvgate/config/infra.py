"""The sidecar's own parts: its listeners, Redis, the scrapes of backends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from kvgate.config.fields import custom, millis, number, optional_text, text, whole
from kvgate.config.parse import ConfigError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SOCKET = ".run/kvgate-sidecar.sock"


def _loopback(d: Mapping[str, Any], where: str, key: str) -> str:
    host = str(d.get(key, "127.0.0.1"))
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise ConfigError(f"{where}.{key}: {host!r} is not loopback; the sidecar API is local only")
    return host


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """Where the sidecar listens: the decision socket for Nginx, its local HTTP API, and an
    optional metrics listener for other hosts."""

    socket: str = text(DEFAULT_SOCKET, "the decision protocol's Unix socket, for Nginx")
    socket_group: str | None = custom(
        None,
        optional_text,
        "the group that may use the socket (mode 0660): Nginx's workers' group, when they run as "
        "another user than the sidecar; none: the sidecar's own group",
    )
    http_host: str = custom(
        "127.0.0.1", _loopback, "the admin, metrics and /v1/backends API's address (loopback only)"
    )
    http_port: int = whole(9100, 0, 65535, "the admin, metrics and /v1/backends API's port")
    admin_token: str | None = custom(None, optional_text, "the bearer token of the admin API")
    metrics_host: str = text("0.0.0.0", "the metrics listener's address")
    metrics_port: int | None = whole(
        None,
        1,
        65535,
        "a second listener with GET /metrics and /healthz only (no admin, no decisions), for a "
        "Prometheus or a probe in another container or host; none: off",
    )
    drain_s: float = millis(
        120_000,
        0,
        3_600_000,
        "on SIGTERM, keep serving decisions until the Nginx in front has gone (no connection for "
        "1 s), at most this long (as long as Nginx's own drain: a pod's termination grace period)",
    )


SENTINEL = "redis+sentinel://"
CLUSTER = "redis+cluster://"


@dataclass(frozen=True, slots=True)
class Nodes:
    """What a ``redis+sentinel://`` or ``redis+cluster://`` URL names."""

    hosts: tuple[tuple[str, int], ...]
    service: str | None  # the Sentinel service (its primary's name); None for a cluster
    db: int
    username: str | None
    password: str | None


def parse_nodes(url: str) -> Nodes:
    """The hosts, service and credentials of a Sentinel or Cluster URL; ValueError when malformed."""
    sentinel = url.startswith(SENTINEL)
    parts = urlsplit("redis://" + url.split("://", 1)[1])
    hosts: list[tuple[str, int]] = []
    for item in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if sentinel and not 1 <= len(path) <= 2:
        raise ValueError("a Sentinel URL ends with /SERVICE (or /SERVICE/DB)")
    if not sentinel and path:
        raise ValueError("a Cluster URL has no path (a cluster has one database)")
    db = path[1] if sentinel and len(path) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"database {db!r} is not a number")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return Nodes(tuple(hosts), path[0] if sentinel else None, int(db), user, password)


def _redis_url(d: Mapping[str, Any], where: str, key: str) -> str | None:
    url = d.get(key, DEFAULT_REDIS_URL)
    if url is None:
        return None
    schemes = ("redis://", "rediss://", "unix://", SENTINEL, CLUSTER)
    if not isinstance(url, str) or not url.startswith(schemes):
        raise ConfigError(f"{where}.{key}: {url!r} must start with {', '.join(schemes)} (or be null)")
    if url.startswith((SENTINEL, CLUSTER)):
        try:
            parse_nodes(url)
        except ValueError as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
    return url


def _password(d: Mapping[str, Any], where: str, key: str) -> str | None:
    password = d.get(key)
    if d.get("password_file") is not None:
        if password is not None:
            raise ConfigError(f"{where}: give password or password_file, not both")
        try:
            password = Path(str(d["password_file"])).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.password_file: cannot read it: {exc.strerror}") from None
    return None if password is None else str(password)


def _ca_file(d: Mapping[str, Any], where: str, key: str) -> str | None:
    ca = d.get(key)
    if ca is not None and not Path(str(ca)).is_file():
        raise ConfigError(f"{where}.{key}: {ca!r} is not a file")
    return None if ca is None else str(ca)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Redis holds session bindings and membership: it must be private to the gateway replicas
    (a client of it can redirect traffic). AUTH/ACL users and TLS (``rediss://``) are supported."""

    url: str | None = custom(
        DEFAULT_REDIS_URL,
        _redis_url,
        "redis://, rediss:// or unix:// (one server), redis+sentinel://H:P,H:P/SERVICE (a primary "
        "its Sentinels name), redis+cluster://H:P,H:P (a Redis Cluster); null: no Redis (one replica)",
    )
    timeout_s: float = millis(20, 1, 5000, "per command: past it Redis counts as down for retry_after_ms")
    decision_wait_s: float = millis(
        10,
        1,
        5000,
        "how long a decision waits for its session's Redis round trip; past it the decision is "
        "answered and the claim completes in the background (Redis queued behind busy cores, not down)",
    )
    connect_timeout_s: float = millis(50, 1, 5000, "to connect to Redis")
    load_share_s: float = millis(
        25,
        0,
        5000,
        "how often each gateway replica shares its in-flight load per backend with the others "
        "(one pipeline); 0: off, each replica sees only its own between scrapes",
    )
    retry_after_s: float = millis(
        1000, 10, 600_000, "after a failure, route without Redis this long before trying again"
    )
    session_ttl_s: float = number(3600, 1, 30 * 86400, "seconds a session binding lives unused")
    prefix: str = text("kvgate", "of every Redis key kvgate writes")
    local_sessions: int = whole(
        100_000, 100, 10_000_000, "bound of the in-process session map used while Redis is down"
    )
    username: str | None = custom(None, optional_text, "an ACL user (or in the URL)")
    password: str | None = custom(
        None,
        _password,
        "or a file holding it (password_file), or KVGATE_REDIS_PASSWORD",
        also=("password_file",),
        secret=True,
    )
    tls_ca_file: str | None = custom(
        None, _ca_file, "the CA for a rediss:// server's certificate (default: the system's)"
    )


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """The backends' /metrics and /health, read every interval: their load and their health."""

    interval_s: float = millis(500, 50, 60_000, "between two scrapes of a backend")
    timeout_s: float = millis(250, 10, 30_000, "of one scrape (at most the interval)")
    stale_after_s: float = millis(2000, 100, 600_000, "older stats make a backend's load unknown")
    unhealthy_after: int = whole(3, 1, 100, "consecutive failed health checks that take a backend out")
    healthy_after: int = whole(2, 1, 100, "consecutive good health checks that bring it back")
    membership_refresh_s: float = millis(1000, 50, 600_000, "how often the shared membership is read")

    def check(self, where: str) -> None:
        if self.timeout_s > self.interval_s:
            raise ConfigError(f"{where}.timeout_ms must not exceed {where}.interval_ms")
