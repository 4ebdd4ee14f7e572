"""Where the backends are, and which addresses a backend may have."""

from __future__ import annotations

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
class MembershipConfig:
    """Which addresses a backend may have. Membership is shared through Redis, and anyone who can
    write to that Redis could otherwise send prompts anywhere: entries whose host matches none of
    ``allow`` (exact hosts or IPs, CIDR blocks, ``*`` globs) are ignored. Empty: the hosts of the
    config's own backends."""

    allow: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> MembershipConfig:
        w = "membership"
        check_keys(d, w, {"allow"})
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
