"""The sidecar's own parts: its listeners, Redis, the scrapes of backends."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.config.parse import ConfigError, check_keys, integer, ms, num

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SOCKET = ".run/kvgate-sidecar.sock"


@dataclass(frozen=True, slots=True)
class ListenConfig:
    socket: str = DEFAULT_SOCKET  # decision protocol, for Nginx
    # The group that may use the socket (mode 0660): Nginx's workers' group, when they run as another
    # user than the sidecar. None: the sidecar's own group.
    socket_group: str | None = None
    http_host: str = "127.0.0.1"  # admin, metrics and /v1/backends
    http_port: int = 9100
    admin_token: str | None = None
    # A second listener with GET /metrics and /healthz only (no admin, no decisions), for a
    # Prometheus or a probe in another container or host. None: off.
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    # SIGTERM: keep serving decisions until the Nginx in front has gone (no connection for 1 s), at
    # most this long (as long as Nginx's own drain: a pod's termination grace period).
    drain_s: float = 120.0

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> ListenConfig:
        w = "listen"
        check_keys(
            d,
            w,
            {
                "socket",
                "socket_group",
                "http_host",
                "http_port",
                "admin_token",
                "metrics_host",
                "metrics_port",
                "drain_ms",
            },
        )
        host = str(d.get("http_host", "127.0.0.1"))
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"{w}.http_host: {host!r} is not loopback; the sidecar API is local only")
        token = d.get("admin_token")
        group = d.get("socket_group")
        return cls(
            socket=str(d.get("socket", DEFAULT_SOCKET)),
            socket_group=None if group is None else str(group),
            http_host=host,
            http_port=integer(d, w, "http_port", 9100, 0, 65535),
            admin_token=None if token is None else str(token),
            metrics_host=str(d.get("metrics_host", "0.0.0.0")),
            metrics_port=None
            if d.get("metrics_port") is None
            else integer(d, w, "metrics_port", 9101, 1, 65535),
            drain_s=ms(d, w, "drain_ms", 120_000, 0, 3_600_000),
        )


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Redis holds session bindings and membership: it must be private to the gateway replicas
    (a client of it can redirect traffic). AUTH/ACL users and TLS (``rediss://``) are supported."""

    url: str | None = DEFAULT_REDIS_URL
    timeout_s: float = 0.02  # per command: past it Redis counts as down for retry_after_s
    # How long a decision waits for its session's Redis round trip; past it the decision is answered
    # and the claim completes in the background (Redis queued behind busy cores, not down).
    decision_wait_s: float = 0.01
    connect_timeout_s: float = 0.05
    retry_after_s: float = 1.0  # after a failure, route without Redis this long before trying again
    session_ttl_s: float = 3600.0
    prefix: str = "kvgate"
    local_sessions: int = 100_000  # bound of the in-process session map used while Redis is down
    username: str | None = None  # an ACL user (or in the URL)
    password: str | None = field(default=None, repr=False)  # or password_file, KVGATE_REDIS_PASSWORD
    tls_ca_file: str | None = None  # CA for a rediss:// server's certificate (default: the system's)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> RedisConfig:
        w = "redis"
        check_keys(
            d,
            w,
            {
                "url",
                "timeout_ms",
                "decision_wait_ms",
                "connect_timeout_ms",
                "retry_after_ms",
                "session_ttl_s",
                "prefix",
                "local_sessions",
                "username",
                "password",
                "password_file",
                "tls_ca_file",
            },
        )
        url = d.get("url", DEFAULT_REDIS_URL)
        if url is not None and (
            not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://"))
        ):
            raise ConfigError(f"{w}.url: {url!r} must start with redis://, rediss:// or unix:// (or be null)")
        password = d.get("password")
        if d.get("password_file") is not None:
            if password is not None:
                raise ConfigError(f"{w}: give password or password_file, not both")
            try:
                password = Path(str(d["password_file"])).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"{w}.password_file: cannot read it: {exc.strerror}") from None
        ca = d.get("tls_ca_file")
        if ca is not None and not Path(str(ca)).is_file():
            raise ConfigError(f"{w}.tls_ca_file: {ca!r} is not a file")
        return cls(
            url=url,
            timeout_s=ms(d, w, "timeout_ms", 20, 1, 5000),
            decision_wait_s=ms(d, w, "decision_wait_ms", 10, 1, 5000),
            connect_timeout_s=ms(d, w, "connect_timeout_ms", 50, 1, 5000),
            retry_after_s=ms(d, w, "retry_after_ms", 1000, 10, 600_000),
            session_ttl_s=num(d, w, "session_ttl_s", 3600, 1, 30 * 86400),
            prefix=str(d.get("prefix", "kvgate")),
            local_sessions=integer(d, w, "local_sessions", 100_000, 100, 10_000_000),
            username=None if d.get("username") is None else str(d["username"]),
            password=None if password is None else str(password),
            tls_ca_file=None if ca is None else str(ca),
        )


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    interval_s: float = 0.5
    timeout_s: float = 0.25
    stale_after_s: float = 2.0  # older stats make a backend's load unknown
    unhealthy_after: int = 3  # consecutive failures
    healthy_after: int = 2  # consecutive successes
    membership_refresh_s: float = 1.0

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> ScrapeConfig:
        w = "scrape"
        check_keys(
            d,
            w,
            {
                "interval_ms",
                "timeout_ms",
                "stale_after_ms",
                "unhealthy_after",
                "healthy_after",
                "membership_refresh_ms",
            },
        )
        out = cls(
            interval_s=ms(d, w, "interval_ms", 500, 50, 60_000),
            timeout_s=ms(d, w, "timeout_ms", 250, 10, 30_000),
            stale_after_s=ms(d, w, "stale_after_ms", 2000, 100, 600_000),
            unhealthy_after=integer(d, w, "unhealthy_after", 3, 1, 100),
            healthy_after=integer(d, w, "healthy_after", 2, 1, 100),
            membership_refresh_s=ms(d, w, "membership_refresh_ms", 1000, 50, 600_000),
        )
        if out.timeout_s > out.interval_s:
            raise ConfigError(f"{w}.timeout_ms must not exceed {w}.interval_ms")
        return out
