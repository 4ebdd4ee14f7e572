"""kvgate's configuration: one YAML file plus ``KVGATE_*`` environment overrides, validated once.

Every section is a frozen dataclass; durations are converted to seconds here, so no other module
parses units. Errors name the bad key and say how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvgate.config.access import ApiKey, AuthConfig, LimitsConfig, Rate, hash_key
from kvgate.config.backends import BackendSpec, DiscoverySpec, MembershipConfig
from kvgate.config.compute import (
    DisaggConfig,
    DispatchOrder,
    PoolRule,
    PoolsConfig,
    QueueConfig,
    TokensConfig,
)
from kvgate.config.fields import custom, load, part, reference
from kvgate.config.gateway import GatewayConfig
from kvgate.config.infra import DEFAULT_REDIS_URL, DEFAULT_SOCKET, ListenConfig, RedisConfig, ScrapeConfig
from kvgate.config.kv_index import KvIndexConfig, TokenizerSource
from kvgate.config.parse import ConfigError
from kvgate.config.routing import LoadLimits, OutlierConfig, PolicyName, RoutingConfig
from kvgate.config.slo import Objective, SloConfig

__all__ = [
    "DEFAULT_REDIS_URL",
    "DEFAULT_SOCKET",
    "ApiKey",
    "AuthConfig",
    "BackendSpec",
    "Config",
    "ConfigError",
    "DisaggConfig",
    "DiscoverySpec",
    "DispatchOrder",
    "GatewayConfig",
    "KvIndexConfig",
    "LimitsConfig",
    "ListenConfig",
    "LoadLimits",
    "MembershipConfig",
    "Objective",
    "OutlierConfig",
    "PolicyName",
    "PoolRule",
    "PoolsConfig",
    "QueueConfig",
    "Rate",
    "RedisConfig",
    "RoutingConfig",
    "ScrapeConfig",
    "SloConfig",
    "TokenizerSource",
    "TokensConfig",
    "hash_key",
    "reference",
]


def _discovery(data: Mapping[str, Any], where: str, key: str) -> tuple[DiscoverySpec, ...]:
    raw = data.get(key) or []
    if not isinstance(raw, list):
        raise ConfigError(f"{key}: expected a list of {{dns: NAME, port: PORT}}")
    return tuple(DiscoverySpec.from_mapping(d, f"{key}[{i}]") for i, d in enumerate(raw))


def _backends(data: Mapping[str, Any], where: str, key: str) -> tuple[BackendSpec, ...]:
    raw = data.get(key) or []
    if not isinstance(raw, list):
        raise ConfigError(f"{key}: expected a list of {{url: http://HOST:PORT, weight: 1}}")
    backends = tuple(BackendSpec.from_mapping(b, f"{key}[{i}]") for i, b in enumerate(raw))
    ids = [b.id for b in backends]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{key}: two backends share an id; give each a distinct id")
    return backends


@dataclass(frozen=True, slots=True)
class Config:
    """The whole file: one field per section (each read by ``fields.load``), then the backends."""

    listen: ListenConfig = part(ListenConfig, "the sidecar's listeners")
    gateway: GatewayConfig = part(GatewayConfig, "Nginx's side")
    redis: RedisConfig = part(RedisConfig, "shared state")
    scrape: ScrapeConfig = part(ScrapeConfig, "load and health of the backends")
    outlier: OutlierConfig = part(OutlierConfig, "passive health")
    routing: RoutingConfig = part(RoutingConfig, "the policy")
    membership: MembershipConfig = part(MembershipConfig, "which addresses a backend may have")
    auth: AuthConfig = part(AuthConfig, "API keys")
    limits: LimitsConfig = part(LimitsConfig, "rate limits")
    queue: QueueConfig = part(QueueConfig, "the gateway queue")
    slo: SloConfig = part(SloConfig, "service-level objectives: admission by predicted TTFT")
    pools: PoolsConfig = part(PoolsConfig, "length-bucketed pools")
    disaggregation: DisaggConfig = part(DisaggConfig, "prefill/decode disaggregation")
    tokens: TokensConfig = part(TokensConfig, "prompt bytes to tokens")
    kv_index: KvIndexConfig = part(KvIndexConfig, "the exact prefix index (backends with kv_events)")
    # Backends found through DNS, beside the listed ones (read first: they may stand in for a list).
    discovery: tuple[DiscoverySpec, ...] = custom(
        (), _discovery, "Backends found by resolving DNS names", item=DiscoverySpec
    )
    backends: tuple[BackendSpec, ...] = custom((), _backends, "The vLLM servers", item=BackendSpec)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
        if not isinstance(data, Mapping):
            raise ConfigError("the config file must be a YAML mapping (listen:, redis:, backends:, ...)")
        return load(cls, _apply_env(data, env or {}), "config")

    def check(self, where: str) -> None:
        if not self.backends and not self.discovery:
            # Membership can grow at run time (admin API, Redis), but a gateway that starts with
            # nothing to route to is a mistake far more often than a plan.
            raise ConfigError(
                "backends: none listed; a gateway needs at least one {url: http://HOST:PORT} "
                "(or a discovery: entry)"
            )
        names = {k.name for k in self.auth.keys}
        for i, o in enumerate(self.slo.objectives):
            if o.key is not None and o.key not in names:
                # A misspelt name would leave the objective covering nobody, without a word.
                raise ConfigError(f"slo.objectives[{i}].key: {o.key!r} names no API key of auth.keys")

    @property
    def limited(self) -> bool:
        """Whether any rate limit applies (the limits section, or a key's own rate)."""
        return self.limits.enabled or any(k.rate is not None and k.rate.limited for k in self.auth.keys)

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
    unknown = sorted(k for k in env if k.startswith("KVGATE_") and k not in _ENV_KEYS)
    if unknown:
        # A misspelt override would otherwise be ignored without a word.
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}; known: {', '.join(_ENV_KEYS)}"
        )
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for var, (where, key) in _ENV_KEYS.items():
        if var in env:
            sect = out.setdefault(where, {})
            if not isinstance(sect, dict):
                raise ConfigError(f"{where}: expected a mapping (needed for {var})")
            # Secrets are taken as written; other values are YAML scalars (numbers, null, ...).
            value = env[var] if var in _VERBATIM else yaml.safe_load(env[var])
            sect[key] = value
    return out
