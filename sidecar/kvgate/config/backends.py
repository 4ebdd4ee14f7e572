"""Where the backends are, and which addresses a backend may have."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvgate.config.parse import ConfigError, check_keys, num

# Backend ids appear in response headers, metric labels, Redis and the prefix index: visible ASCII
# only, no spaces or control characters.
BACKEND_ID = re.compile(r"[A-Za-z0-9._:@/+\-\[\]]{1,128}")
METRICS_MODES = ("auto", "vllm", "sglang", "none")


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
        labels = data.get("labels") or {}
        if not isinstance(labels, Mapping):
            raise ConfigError(f"{where}.labels: expected a mapping of label: value")
        metrics = data.get("metrics", "auto")
        if metrics not in METRICS_MODES:
            raise ConfigError(f"{where}.metrics: {metrics!r}; choose one of {', '.join(METRICS_MODES)}")
        return cls(
            id=bid,
            url=url.rstrip("/"),
            weight=num(data, where, "weight", 1.0, 0.01, 1000.0),
            labels={str(k): str(v) for k, v in labels.items()},
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
