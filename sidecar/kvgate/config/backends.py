"""Where the backends are, and which addresses a backend may have."""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvgate.config.parse import ConfigError, check_keys, integer, ms, num

# Backend ids appear in response headers, metric labels, Redis and the prefix index: visible ASCII
# only, no spaces or control characters.
BACKEND_ID = re.compile(r"[A-Za-z0-9._:@/+\-\[\]]{1,128}")
METRICS_MODES = ("auto", "vllm", "sglang", "none")


def _labels_and_metrics(data: Mapping[str, Any], where: str) -> tuple[dict[str, str], str]:
    """A backend's labels and metrics mode, as a listed backend and a discovery entry both give them."""
    labels = data.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise ConfigError(f"{where}.labels: expected a mapping of label: value")
    metrics = data.get("metrics", "auto")
    if metrics not in METRICS_MODES:
        raise ConfigError(f"{where}.metrics: {metrics!r}; choose one of {', '.join(METRICS_MODES)}")
    return {str(k): str(v) for k, v in labels.items()}, str(metrics)


@dataclass(frozen=True, slots=True)
class BackendSpec:
    id: str
    url: str
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    # Which metrics the backend exposes: vllm or sglang names (auto: either), or none (any
    # OpenAI-compatible server: health from /health, load from kvgate's own in-flight counts).
    metrics: str = "auto"

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
        check_keys(data, where, {"id", "url", "weight", "labels", "metrics"})
        url = data.get("url")
        if not isinstance(url, str):
            raise ConfigError(f"{where}.url: required, e.g. url: http://10.0.0.5:8000")
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"{where}.url: {url!r} must look like http://HOST:PORT (plain http to vLLM)")
        bid = str(data.get("id") or f"{parts.hostname}:{parts.port or 80}")
        if not BACKEND_ID.fullmatch(bid):
            raise ConfigError(
                f"{where}.id: {bid!r} must be 1-128 letters, digits or ._:@/+-[] (it names the backend in "
                "headers and metrics)"
            )
        labels, metrics = _labels_and_metrics(data, where)
        return cls(
            id=bid,
            url=url.rstrip("/"),
            weight=num(data, where, "weight", 1.0, 0.01, 1000.0),
            labels=labels,
            metrics=metrics,
        )


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


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Which addresses a backend may have. Membership is shared through Redis, and anyone who can
    write to that Redis could otherwise send prompts anywhere: entries whose host and port match
    none of ``allow`` are ignored. Each entry names a host and its ports (see ``AllowRule``): a
    host alone would let a listener on any other port of that host capture traffic. Empty: exactly
    the addresses of the config's own backends and of the ones its discovery finds."""

    allow: tuple[AllowRule, ...] = ()

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> MembershipConfig:
        w = "membership"
        check_keys(d, w, {"allow"})
        allow = d.get("allow") or []
        if not isinstance(allow, list) or not all(isinstance(a, str) and a for a in allow):
            raise ConfigError(
                f"{w}.allow: expected a list of HOST:PORT entries like 10.0.0.0/8:8000 or "
                "*.svc.cluster.local:8000"
            )
        return cls(tuple(AllowRule.parse(a, f"{w}.allow[{i}]") for i, a in enumerate(allow)))


# A DNS name: letters, digits, hyphens and dots (a headless Service's name in Kubernetes).
DNS_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    """Backends found by resolving a DNS name: each address it resolves to is one backend at
    ``scheme://address:port`` (a Kubernetes headless Service resolves to the addresses of its ready
    pods). Every sidecar resolves the same name, so replicas agree without coordinating; addresses
    that appear are added, those that disappear are removed, each within ``interval``."""

    dns: str
    port: int
    scheme: str = "http"
    interval_s: float = 10.0
    timeout_s: float = 2.0
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    metrics: str = "auto"

    def spec(self, address: str) -> BackendSpec:
        host = f"[{address}]" if ":" in address else address
        return BackendSpec(
            id=f"{self.dns.rstrip('.')}@{host}:{self.port}",
            url=f"{self.scheme}://{host}:{self.port}",
            weight=self.weight,
            labels=self.labels,
            metrics=self.metrics,
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> DiscoverySpec:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected {{dns: NAME, port: PORT}}")
        check_keys(
            data, where, {"dns", "port", "scheme", "interval_ms", "timeout_ms", "weight", "labels", "metrics"}
        )
        name = data.get("dns")
        if not isinstance(name, str) or not DNS_NAME.fullmatch(name):
            raise ConfigError(
                f"{where}.dns: {name!r} is not a DNS name (e.g. vllm.default.svc.cluster.local)"
            )
        if "port" not in data:
            raise ConfigError(f"{where}.port: required (the port every resolved address serves on)")
        scheme = data.get("scheme", "http")
        if scheme not in ("http", "https"):
            raise ConfigError(f"{where}.scheme: {scheme!r}; choose http or https")
        labels, metrics = _labels_and_metrics(data, where)
        return cls(
            dns=name,
            port=integer(data, where, "port", 8000, 1, 65535),
            scheme=scheme,
            interval_s=ms(data, where, "interval_ms", 10_000, 500, 3_600_000),
            timeout_s=ms(data, where, "timeout_ms", 2_000, 50, 30_000),
            weight=num(data, where, "weight", 1.0, 0.01, 1000.0),
            labels=labels,
            metrics=metrics,
        )
