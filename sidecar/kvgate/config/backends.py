"""Where the backends are, and which addresses a backend may have."""

from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvgate.config.fields import custom, load, millis, number
from kvgate.config.parse import ConfigError, integer

# Backend ids appear in response headers, metric labels, Redis and the prefix index: visible ASCII
# only, no spaces or control characters.
BACKEND_ID = re.compile(r"[A-Za-z0-9._:@/+\-\[\]]{1,128}")
METRICS_MODES = ("auto", "vllm", "sglang", "none")


def _labels(data: Mapping[str, Any], where: str, key: str) -> dict[str, str]:
    labels = data.get(key) or {}
    if not isinstance(labels, Mapping):
        raise ConfigError(f"{where}.{key}: expected a mapping of label: value")
    return {str(k): str(v) for k, v in labels.items()}


def _metrics(data: Mapping[str, Any], where: str, key: str) -> str:
    metrics = data.get(key, "auto")
    if metrics not in METRICS_MODES:
        raise ConfigError(f"{where}.{key}: {metrics!r}; choose one of {', '.join(METRICS_MODES)}")
    return str(metrics)


def _url(data: Mapping[str, Any], where: str, key: str) -> str:
    url = data.get(key)
    if not isinstance(url, str):
        raise ConfigError(f"{where}.{key}: required, e.g. url: http://10.0.0.5:8000")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"{where}.{key}: {url!r} must look like http://HOST:PORT (plain http to vLLM)")
    return url.rstrip("/")


def _backend_id(data: Mapping[str, Any], where: str, key: str) -> str:
    parts = urlsplit(_url(data, where, "url"))
    bid = str(data.get(key) or f"{parts.hostname}:{parts.port or 80}")
    if not BACKEND_ID.fullmatch(bid):
        raise ConfigError(
            f"{where}.{key}: {bid!r} must be 1-128 letters, digits or ._:@/+-[] (it names the backend in "
            "headers and metrics)"
        )
    return bid


def _zmq_endpoint(data: Mapping[str, Any], where: str, key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    hint = f"{where}.{key}: {value!r} must look like tcp://HOST:PORT (a vLLM KV-event publisher)"
    if not isinstance(value, str) or len(value) > 300:
        raise ConfigError(hint)
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(hint) from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path or parts.query:
        raise ConfigError(hint)
    return value


def _optional_port(data: Mapping[str, Any], where: str, key: str) -> int | None:
    return None if data.get(key) is None else _port(data, where, key)


KV_EVENTS_HELP = (
    "tcp://HOST:PORT of its KV-event publisher (vLLM --kv-events-config endpoint): the exact "
    "prefix index follows what it holds"
)
KV_REPLAY_HELP = "tcp://HOST:PORT of its KV-event replay socket (replay_endpoint): fills gaps"
LABELS_HELP = "labels: {pool: short}, {role: prefill}, ... (pools and disaggregation read them)"
METRICS_HELP = (
    "which metrics the backend exposes: vllm or sglang names (auto: either), or none (any "
    "OpenAI-compatible server: health from /health, load from kvgate's own in-flight counts)"
)


@dataclass(frozen=True, slots=True)
class BackendSpec:
    id: str = custom(
        dataclasses.MISSING, _backend_id, "its name in headers, metrics and Redis", shown="HOST:PORT"
    )
    url: str = custom(dataclasses.MISSING, _url, "http://HOST:PORT of a vLLM server", shown="(required)")
    weight: float = number(1.0, 0.01, 1000.0, "its share of the ring")
    labels: Mapping[str, str] = custom({}, _labels, LABELS_HELP)
    metrics: str = custom("auto", _metrics, METRICS_HELP)
    kv_events: str | None = custom(None, _zmq_endpoint, KV_EVENTS_HELP, shown="(none)")
    kv_events_replay: str | None = custom(None, _zmq_endpoint, KV_REPLAY_HELP, shown="(none)")

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
        return load(cls, data, where)


@dataclass(frozen=True, slots=True)
class AllowRule:
    """One ``membership.allow`` entry: a host (exact, or a ``*`` glob of names), or an IP network,
    and the ports it admits (``port_lo``..``port_hi``)."""

    host: str  # a lowercase name or glob, or "" for a network
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    port_lo: int
    port_hi: int

    def admits(self, host: str, port: int) -> bool:
        if not self.port_lo <= port <= self.port_hi:
            return False
        if self.network is None:
            return fnmatch.fnmatchcase(host, self.host)
        try:
            return ipaddress.ip_address(host) in self.network
        except ValueError:
            return False

    @classmethod
    def parse(cls, entry: str, where: str) -> AllowRule:
        """``HOST:PORT``, ``HOST:LO-HI`` or ``HOST:*``, HOST a name, a glob, an IP or a CIDR block
        (IPv6 in brackets: ``[fd00::/8]:8000``)."""
        hint = (
            f"{where}: {entry!r} must name a host and its ports, e.g. 10.0.0.5:8000, "
            "10.0.0.0/8:8000-8010, *.svc.cluster.local:8000 or [fd00::/8]:8000 (:* for any port)"
        )
        if entry.startswith("["):
            host, sep, rest = entry[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise ConfigError(hint)
            ports = rest[1:]
        else:
            host, sep, ports = entry.rpartition(":")
            if not sep or not host:
                raise ConfigError(hint)
        if ports == "*":
            lo, hi = 1, 65535
        else:
            m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", ports)
            if m is None:
                raise ConfigError(hint)
            lo = int(m.group(1))
            hi = int(m.group(2) or lo)
            if not 1 <= lo <= hi <= 65535:
                raise ConfigError(f"{where}: {entry!r} has no valid port range (1-65535, low-high)")
        if "/" in host:
            try:
                return cls("", ipaddress.ip_network(host, strict=False), lo, hi)
            except ValueError:
                raise ConfigError(f"{where}: {host!r} is not a CIDR block like 10.0.0.0/8") from None
        return cls(host.lower(), None, lo, hi)


def _allow(d: Mapping[str, Any], where: str, key: str) -> tuple[AllowRule, ...]:
    allow = d.get(key) or []
    if not isinstance(allow, list) or not all(isinstance(a, str) and a for a in allow):
        raise ConfigError(
            f"{where}.{key}: expected a list of HOST:PORT entries like 10.0.0.0/8:8000 or "
            "*.svc.cluster.local:8000"
        )
    return tuple(AllowRule.parse(a, f"{where}.{key}[{i}]") for i, a in enumerate(allow))


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Which addresses a backend may have. Membership is shared through Redis, and anyone who can
    write to that Redis could otherwise send prompts anywhere: entries whose host and port match
    none of ``allow`` are ignored. Each entry names a host and its ports (see ``AllowRule``): a
    host alone would let a listener on any other port of that host capture traffic. Empty: exactly
    the addresses of the config's own backends and of the ones its discovery finds."""

    allow: tuple[AllowRule, ...] = custom(
        (),
        _allow,
        "HOST:PORT entries (10.0.0.5:8000, 10.0.0.0/8:8000-8010, *.svc.cluster.local:8000, "
        "[fd00::/8]:8000, :* for any port); empty: the config's own backends and discovery",
    )


# A DNS name: letters, digits, hyphens and dots (a headless Service's name in Kubernetes).
DNS_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def _dns(data: Mapping[str, Any], where: str, key: str) -> str:
    name = data.get(key)
    if not isinstance(name, str) or not DNS_NAME.fullmatch(name):
        raise ConfigError(f"{where}.{key}: {name!r} is not a DNS name (e.g. vllm.default.svc.cluster.local)")
    return name


def _port(data: Mapping[str, Any], where: str, key: str) -> int:
    if key not in data:
        raise ConfigError(f"{where}.{key}: required (the port every resolved address serves on)")
    return integer(data, where, key, 8000, 1, 65535)


def _scheme(data: Mapping[str, Any], where: str, key: str) -> str:
    scheme = data.get(key, "http")
    if scheme not in ("http", "https"):
        raise ConfigError(f"{where}.{key}: {scheme!r}; choose http or https")
    return str(scheme)


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    """Backends found by resolving a DNS name: each address it resolves to is one backend at
    ``scheme://address:port`` (a Kubernetes headless Service resolves to the addresses of its ready
    pods). Every sidecar resolves the same name, so replicas agree without coordinating; addresses
    that appear are added, those that disappear are removed, each within ``interval_ms``."""

    dns: str = custom(dataclasses.MISSING, _dns, "the name to resolve", shown="(required)")
    port: int = custom(dataclasses.MISSING, _port, "every resolved address serves on it", shown="(required)")
    scheme: str = custom("http", _scheme, "http or https")
    interval_s: float = millis(10_000, 500, 3_600_000, "how often the name is resolved again")
    timeout_s: float = millis(2_000, 50, 30_000, "of one resolution")
    weight: float = number(1.0, 0.01, 1000.0, "each found backend's share of the ring")
    labels: Mapping[str, str] = custom({}, _labels, LABELS_HELP)
    metrics: str = custom("auto", _metrics, METRICS_HELP)
    kv_events_port: int | None = custom(
        None, _optional_port, "each found backend's KV-event publisher port (kv_events)", shown="(none)"
    )
    kv_events_replay_port: int | None = custom(
        None, _optional_port, "each found backend's KV-event replay port", shown="(none)"
    )

    def spec(self, address: str) -> BackendSpec:
        host = f"[{address}]" if ":" in address else address
        events, replay = self.kv_events_port, self.kv_events_replay_port
        return BackendSpec(
            id=f"{self.dns.rstrip('.')}@{host}:{self.port}",
            url=f"{self.scheme}://{host}:{self.port}",
            weight=self.weight,
            labels=self.labels,
            metrics=self.metrics,
            kv_events=None if events is None else f"tcp://{host}:{events}",
            kv_events_replay=None if replay is None else f"tcp://{host}:{replay}",
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> DiscoverySpec:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected {{dns: NAME, port: PORT}}")
        return load(cls, data, where)
