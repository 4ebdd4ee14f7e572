"""kvgate's configuration: one YAML file plus ``KVGATE_*`` environment overrides, validated once.

Every section is a frozen dataclass; durations are converted to seconds here, so no other module
parses units. Errors name the bad key and say how to fix it.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SOCKET = ".run/kvgate-sidecar.sock"


class ConfigError(ValueError):
    pass


class PolicyName(str, Enum):
    """The routing policies (``kvgate.policies``), by the name the config file uses."""

    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOAD = "least_load"
    CONSISTENT_HASH = "consistent_hash"
    PREFIX = "prefix"
    KVGATE = "kvgate"


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping of settings, got {type(value).__name__}")
    return value


def _check_keys(data: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _ms(data: Mapping[str, Any], where: str, key: str, default_ms: float, lo: float, hi: float) -> float:
    value = data.get(key, default_ms)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{key}: expected a number of milliseconds, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}.{key}: {value} ms is out of range; use {lo:g}..{hi:g} ms")
    return float(value) / 1000.0


def _num(data: Mapping[str, Any], where: str, key: str, default: float, lo: float, hi: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}.{key}: {value} is out of range; use {lo:g}..{hi:g}")
    return float(value)


def _int(data: Mapping[str, Any], where: str, key: str, default: int, lo: int, hi: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}.{key}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}.{key}: {value} is out of range; use {lo}..{hi}")
    return value


@dataclass(frozen=True, slots=True)
class BackendSpec:
    id: str
    url: str
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        """host:port as Nginx's balancer needs it."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> BackendSpec:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping with at least 'url'")
        _check_keys(data, where, {"id", "url", "weight", "labels"})
        url = data.get("url")
        if not isinstance(url, str):
            raise ConfigError(f"{where}.url: required, e.g. url: http://10.0.0.5:8000")
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"{where}.url: {url!r} must look like http://HOST:PORT (plain http to vLLM)")
        bid = data.get("id") or f"{parts.hostname}:{parts.port or 80}"
        labels = data.get("labels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"{where}.labels: expected a mapping of label: value")
        return cls(
            id=str(bid),
            url=url.rstrip("/"),
            weight=_num(data, where, "weight", 1.0, 0.01, 1000.0),
            labels={str(k): str(v) for k, v in labels.items()},
        )


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Redis holds session bindings and membership: it must be private to the gateway replicas
    (a client of it can redirect traffic). AUTH/ACL users and TLS (``rediss://``) are supported."""

    url: str | None = DEFAULT_REDIS_URL
    timeout_s: float = 0.02  # per command: a routing decision never waits longer on Redis
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
        _check_keys(
            d,
            w,
            {
                "url",
                "timeout_ms",
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
            timeout_s=_ms(d, w, "timeout_ms", 20, 1, 5000),
            connect_timeout_s=_ms(d, w, "connect_timeout_ms", 50, 1, 5000),
            retry_after_s=_ms(d, w, "retry_after_ms", 1000, 10, 600_000),
            session_ttl_s=_num(d, w, "session_ttl_s", 3600, 1, 30 * 86400),
            prefix=str(d.get("prefix", "kvgate")),
            local_sessions=_int(d, w, "local_sessions", 100_000, 100, 10_000_000),
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
        _check_keys(
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
            interval_s=_ms(d, w, "interval_ms", 500, 50, 60_000),
            timeout_s=_ms(d, w, "timeout_ms", 250, 10, 30_000),
            stale_after_s=_ms(d, w, "stale_after_ms", 2000, 100, 600_000),
            unhealthy_after=_int(d, w, "unhealthy_after", 3, 1, 100),
            healthy_after=_int(d, w, "healthy_after", 2, 1, 100),
            membership_refresh_s=_ms(d, w, "membership_refresh_ms", 1000, 50, 600_000),
        )
        if out.timeout_s > out.interval_s:
            raise ConfigError(f"{w}.timeout_ms must not exceed {w}.interval_ms")
        return out


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """Passive health (``kvgate.outliers``): ejection after consecutive backend-caused failures."""

    enabled: bool = True
    consecutive: int = 5  # failures in a row that eject a backend (Envoy's consecutive_5xx)
    base_ejection_s: float = 10.0  # the first ejection's length; the n-th lasts n times as long
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0  # of the fleet out at once (at least one, never all)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> OutlierConfig:
        w = "outlier"
        _check_keys(
            d, w, {"enabled", "consecutive", "base_ejection_ms", "max_ejection_ms", "max_ejection_percent"}
        )
        enabled = d.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{w}.enabled: expected true or false, got {enabled!r}")
        out = cls(
            enabled=enabled,
            consecutive=_int(d, w, "consecutive", 5, 1, 1000),
            base_ejection_s=_ms(d, w, "base_ejection_ms", 10_000, 100, 3_600_000),
            max_ejection_s=_ms(d, w, "max_ejection_ms", 300_000, 100, 86_400_000),
            max_ejection_percent=_num(d, w, "max_ejection_percent", 50, 0, 100),
        )
        if out.max_ejection_s < out.base_ejection_s:
            raise ConfigError(f"{w}.max_ejection_ms must not be below {w}.base_ejection_ms")
        return out


@dataclass(frozen=True, slots=True)
class LoadLimits:
    """When a backend is full: the thresholds every policy reads, in one object."""

    load_factor: float = 1.25  # c of the bounded-load walk: no new key above c x the fair share
    saturation_waiting: int = 8  # queued requests at which a backend counts as saturated
    saturation_kv: float = 0.95  # KV-cache usage at which a backend counts as saturated
    saturation_prefill_tokens: int = 32_768  # prompt tokens routed and awaiting prefill (~1 s on an H100)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: PolicyName = PolicyName.KVGATE
    per_model: Mapping[str, PolicyName] = field(default_factory=dict)
    session_header: str = "X-Session-ID"
    limits: LoadLimits = LoadLimits()
    vnodes: int = 160  # ring points per unit of weight
    max_candidates: int = 3  # primary plus fallbacks returned to Nginx
    prefix_index_blocks: int = 1_000_000  # memory bound of the approximate prefix index

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> RoutingConfig:
        w = "routing"
        _check_keys(
            d,
            w,
            {
                "policy",
                "per_model",
                "session_header",
                "load_factor",
                "vnodes",
                "max_candidates",
                "saturation_waiting",
                "saturation_kv",
                "saturation_prefill_tokens",
                "prefix_index_blocks",
            },
        )

        def policy(value: Any, where: str) -> PolicyName:
            try:
                return PolicyName(value)
            except ValueError:
                names = ", ".join(p.value for p in PolicyName)
                raise ConfigError(f"{where}: unknown policy {value!r}; choose one of {names}") from None

        per_model = d.get("per_model") or {}
        if not isinstance(per_model, Mapping):
            raise ConfigError(f"{w}.per_model: expected a mapping of model name: policy")
        return cls(
            policy=policy(d.get("policy", "kvgate"), f"{w}.policy"),
            per_model={str(m): policy(p, f"{w}.per_model.{m}") for m, p in per_model.items()},
            session_header=str(d.get("session_header", "X-Session-ID")),
            limits=LoadLimits(
                load_factor=_num(d, w, "load_factor", 1.25, 1.0, 10.0),
                saturation_waiting=_int(d, w, "saturation_waiting", 8, 1, 100_000),
                saturation_kv=_num(d, w, "saturation_kv", 0.95, 0.1, 1.0),
                saturation_prefill_tokens=_int(d, w, "saturation_prefill_tokens", 32_768, 512, 10_000_000),
            ),
            vnodes=_int(d, w, "vnodes", 160, 1, 4096),
            max_candidates=_int(d, w, "max_candidates", 3, 1, 16),
            prefix_index_blocks=_int(d, w, "prefix_index_blocks", 1_000_000, 1000, 100_000_000),
        )


@dataclass(frozen=True, slots=True)
class ListenConfig:
    socket: str = DEFAULT_SOCKET  # decision protocol, for Nginx
    # The group that may use the socket (mode 0660): Nginx's workers' group, when they run as another
    # user than the sidecar. None: the sidecar's own group.
    socket_group: str | None = None
    http_host: str = "127.0.0.1"  # admin, metrics and /v1/backends
    http_port: int = 9100
    admin_token: str | None = None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> ListenConfig:
        w = "listen"
        _check_keys(d, w, {"socket", "socket_group", "http_host", "http_port", "admin_token"})
        host = str(d.get("http_host", "127.0.0.1"))
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"{w}.http_host: {host!r} is not loopback; the sidecar API is local only")
        token = d.get("admin_token")
        group = d.get("socket_group")
        return cls(
            socket=str(d.get("socket", DEFAULT_SOCKET)),
            socket_group=None if group is None else str(group),
            http_host=host,
            http_port=_int(d, w, "http_port", 9100, 0, 65535),
            admin_token=None if token is None else str(token),
        )


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Which addresses a backend may have. Membership is shared through Redis, and anyone who can
    write to that Redis could otherwise send prompts anywhere: entries whose host matches none of
    ``allow`` (exact hosts or IPs, CIDR blocks, ``*`` globs) are ignored. Empty: the hosts of the
    config's own backends."""

    allow: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> MembershipConfig:
        w = "membership"
        _check_keys(d, w, {"allow"})
        allow = d.get("allow") or []
        if not isinstance(allow, list) or not all(isinstance(a, str) and a for a in allow):
            raise ConfigError(
                f"{w}.allow: expected a list of hosts, CIDR blocks or globs like *.svc.cluster.local"
            )
        for pattern in allow:
            if "/" in pattern:
                try:
                    ipaddress.ip_network(pattern, strict=False)
                except ValueError:
                    raise ConfigError(f"{w}.allow: {pattern!r} is not a CIDR block like 10.0.0.0/8") from None
        return cls(tuple(allow))


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Nginx's side of kvgate, written into its config by ``kvgate render-nginx`` and ``kvgate up``."""

    route_headers: bool = True  # X-Kvgate-Backend and X-Kvgate-Route: which backend served, and why
    decision_timeout_ms: int = 50  # the whole budget of one call to the sidecar, then fail-open
    first_byte_timeout_ms: int = (
        60_000  # per try (streams: also every later silence; see lua/kvgate/conf.lua)
    )
    token_timeout_ms: int = 100  # JSON responses come whole: each requested token adds this much
    max_read_timeout_ms: int = 600_000
    client_max_body_size: str = "16m"
    # When Nginx starts as root, its workers run as this user (and the socket group's members): never
    # root. None: nobody.
    worker_user: str | None = None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> GatewayConfig:
        w = "gateway"
        _check_keys(
            d,
            w,
            {
                "route_headers",
                "decision_timeout_ms",
                "first_byte_timeout_ms",
                "token_timeout_ms",
                "max_read_timeout_ms",
                "client_max_body_size",
                "worker_user",
            },
        )
        headers = d.get("route_headers", True)
        if not isinstance(headers, bool):
            raise ConfigError(f"{w}.route_headers: expected true or false, got {headers!r}")
        size = str(d.get("client_max_body_size", "16m"))
        if not re.fullmatch(r"[0-9]+[kKmMgG]?", size):
            raise ConfigError(f"{w}.client_max_body_size: {size!r} is not an Nginx size like 16m or 512k")
        user = d.get("worker_user")
        return cls(
            route_headers=headers,
            decision_timeout_ms=_int(d, w, "decision_timeout_ms", 50, 1, 10_000),
            first_byte_timeout_ms=_int(d, w, "first_byte_timeout_ms", 60_000, 100, 3_600_000),
            token_timeout_ms=_int(d, w, "token_timeout_ms", 100, 0, 60_000),
            max_read_timeout_ms=_int(d, w, "max_read_timeout_ms", 600_000, 100, 86_400_000),
            client_max_body_size=size,
            worker_user=None if user is None else str(user),
        )


@dataclass(frozen=True, slots=True)
class Config:
    listen: ListenConfig = ListenConfig()
    gateway: GatewayConfig = GatewayConfig()
    redis: RedisConfig = RedisConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    outlier: OutlierConfig = OutlierConfig()
    routing: RoutingConfig = RoutingConfig()
    membership: MembershipConfig = MembershipConfig()
    backends: tuple[BackendSpec, ...] = ()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
        if not isinstance(data, Mapping):
            raise ConfigError("the config file must be a YAML mapping (listen:, redis:, backends:, ...)")
        data = _apply_env(data, env or {})
        _check_keys(
            data,
            "config",
            {"listen", "gateway", "redis", "scrape", "outlier", "routing", "membership", "backends"},
        )
        raw_backends = data.get("backends") or []
        if not isinstance(raw_backends, list):
            raise ConfigError("backends: expected a list of {url: http://HOST:PORT, weight: 1}")
        backends = tuple(BackendSpec.from_mapping(b, f"backends[{i}]") for i, b in enumerate(raw_backends))
        ids = [b.id for b in backends]
        if len(set(ids)) != len(ids):
            raise ConfigError("backends: two backends share an id; give each a distinct id")
        return cls(
            listen=ListenConfig.from_mapping(_section(data, "listen")),
            gateway=GatewayConfig.from_mapping(_section(data, "gateway")),
            redis=RedisConfig.from_mapping(_section(data, "redis")),
            scrape=ScrapeConfig.from_mapping(_section(data, "scrape")),
            outlier=OutlierConfig.from_mapping(_section(data, "outlier")),
            routing=RoutingConfig.from_mapping(_section(data, "routing")),
            membership=MembershipConfig.from_mapping(_section(data, "membership")),
            backends=backends,
        )

    @classmethod
    def from_file(cls, path: str | Path, env: Mapping[str, str] | None = None) -> Config:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        return cls.from_mapping(data, os.environ if env is None else env)


# Environment overrides: KVGATE_<SECTION>_<KEY>, values parsed as YAML scalars.
_ENV_KEYS = {
    "KVGATE_REDIS_URL": ("redis", "url"),
    "KVGATE_REDIS_USERNAME": ("redis", "username"),
    "KVGATE_REDIS_PASSWORD": ("redis", "password"),
    "KVGATE_LISTEN_SOCKET": ("listen", "socket"),
    "KVGATE_LISTEN_SOCKET_GROUP": ("listen", "socket_group"),
    "KVGATE_LISTEN_HTTP_PORT": ("listen", "http_port"),
    "KVGATE_ADMIN_TOKEN": ("listen", "admin_token"),
    "KVGATE_ROUTING_POLICY": ("routing", "policy"),
    "KVGATE_SCRAPE_INTERVAL_MS": ("scrape", "interval_ms"),
}


_VERBATIM = {"KVGATE_ADMIN_TOKEN", "KVGATE_REDIS_PASSWORD", "KVGATE_REDIS_USERNAME"}


def _apply_env(data: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for var, (section, key) in _ENV_KEYS.items():
        if var in env:
            sect = out.setdefault(section, {})
            if not isinstance(sect, dict):
                raise ConfigError(f"{section}: expected a mapping (needed for {var})")
            # Secrets are taken as written; other values are YAML scalars (numbers, null, ...).
            value = env[var] if var in _VERBATIM else yaml.safe_load(env[var])
            sect[key] = value
    return out
