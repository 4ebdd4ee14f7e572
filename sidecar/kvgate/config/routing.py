"""Routing settings: the policy, the thresholds every policy reads, passive health."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvgate.config.parse import ConfigError, check_keys, integer, ms, num


class PolicyName(str, Enum):
    """The routing policies (``kvgate.policies``), by the name the config file uses."""

    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOAD = "least_load"
    CONSISTENT_HASH = "consistent_hash"
    PREFIX = "prefix"
    KVGATE = "kvgate"


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
        check_keys(
            d, w, {"enabled", "consecutive", "base_ejection_ms", "max_ejection_ms", "max_ejection_percent"}
        )
        enabled = d.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{w}.enabled: expected true or false, got {enabled!r}")
        out = cls(
            enabled=enabled,
            consecutive=integer(d, w, "consecutive", 5, 1, 1000),
            base_ejection_s=ms(d, w, "base_ejection_ms", 10_000, 100, 3_600_000),
            max_ejection_s=ms(d, w, "max_ejection_ms", 300_000, 100, 86_400_000),
            max_ejection_percent=num(d, w, "max_ejection_percent", 50, 0, 100),
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
        check_keys(
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
                load_factor=num(d, w, "load_factor", 1.25, 1.0, 10.0),
                saturation_waiting=integer(d, w, "saturation_waiting", 8, 1, 100_000),
                saturation_kv=num(d, w, "saturation_kv", 0.95, 0.1, 1.0),
                saturation_prefill_tokens=integer(d, w, "saturation_prefill_tokens", 32_768, 512, 10_000_000),
            ),
            vnodes=integer(d, w, "vnodes", 160, 1, 4096),
            max_candidates=integer(d, w, "max_candidates", 3, 1, 16),
            prefix_index_blocks=integer(d, w, "prefix_index_blocks", 1_000_000, 1000, 100_000_000),
        )
