"""Who may use the gateway and how much: API keys (stored hashed) and rate limits."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.config.fields import custom, load, millis, whole
from kvgate.config.parse import ConfigError, check_keys, integer

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """How an API key is stored: its SHA-256, in hex (``kvgate hash-key`` prints it)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Rate:
    """A limit per minute; 0 means none."""

    requests_per_minute: int = whole(0, 0, 10**9, "requests per minute; 0: no limit")
    tokens_per_minute: int = whole(0, 0, 10**12, "prompt + completion tokens per minute; 0: no limit")

    @classmethod
    def from_mapping(cls, d: Any, where: str) -> Rate:
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}: expected {{requests_per_minute: N, tokens_per_minute: N}}")
        return load(cls, d, where)

    @property
    def limited(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    sha256: str = field(repr=False)
    rate: Rate | None = None  # None: the limits section's per_key rate
    priority: int | None = None  # the gateway queue's class for this key (vLLM's sense: lower first)


OPEN_ROUTES = frozenset({"models", "metrics"})


def _open_routes(d: Mapping[str, Any], where: str, key: str) -> tuple[str, ...]:
    open_routes = d.get(key) or []
    if not isinstance(open_routes, list) or not set(open_routes) <= OPEN_ROUTES:
        raise ConfigError(f"{where}.{key}: expected a list among {sorted(OPEN_ROUTES)}, got {open_routes!r}")
    return tuple(sorted(set(open_routes)))


def _keys(d: Mapping[str, Any], where: str, key: str) -> tuple[ApiKey, ...]:
    entries = list(d.get(key) or [])
    if d.get("keys_file") is not None:
        try:
            loaded = yaml.safe_load(Path(str(d["keys_file"])).read_text()) or []
        except OSError as exc:
            raise ConfigError(f"{where}.keys_file: cannot read it: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}.keys_file: not valid YAML: {exc}") from None
        if not isinstance(loaded, list):
            raise ConfigError(f"{where}.keys_file: expected a list of {{name, sha256}}")
        entries += loaded
    keys = []
    for i, e in enumerate(entries):
        at = f"{where}.{key}[{i}]"
        if not isinstance(e, Mapping):
            raise ConfigError(f"{at}: expected {{name: team-a, sha256: <kvgate hash-key output>}}")
        check_keys(e, at, {"name", "sha256", "rate", "priority"})
        digest = str(e.get("sha256", "")).lower()
        if not SHA256_HEX.fullmatch(digest):
            raise ConfigError(f"{at}.sha256: expected 64 hex digits (kvgate hash-key prints them)")
        name = e.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ConfigError(f"{at}.name: expected 1-64 letters, digits, '.', '_' or '-'")
        rate = Rate.from_mapping(e["rate"], f"{at}.rate") if "rate" in e else None
        priority = integer(e, at, "priority", 0, -(2**31), 2**31 - 1) if "priority" in e else None
        keys.append(ApiKey(name, digest, rate, priority))
    if len({k.name for k in keys}) != len(keys) or len({k.sha256 for k in keys}) != len(keys):
        raise ConfigError(f"{where}.{key}: names and keys must be distinct")
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """With keys configured, every request to the API needs ``Authorization: Bearer <key>`` with
    one of them; Nginx checks it even while the sidecar is away (it fails closed)."""

    keys: tuple[ApiKey, ...] = custom(
        (),
        _keys,
        "a list of {name, sha256 (kvgate hash-key prints it), rate, priority}, or a YAML file of them "
        "(keys_file)",
        also=("keys_file",),
    )
    open_routes: tuple[str, ...] = custom(
        (),
        _open_routes,
        "routes Nginx answers itself that need no key even with keys on: models (/v1/models), "
        "metrics (/kvgate/metrics, for a Prometheus without credentials); /health and "
        "/kvgate/health are always open (probes)",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.keys)


def _rate(d: Mapping[str, Any], where: str, key: str) -> Rate:
    return Rate.from_mapping(d.get(key), f"{where}.{key}")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Rate limits by requests and tokens, per API key and per client address, shared by every
    gateway replica through Redis. Decisions never wait on Redis for them: each sidecar counts
    locally and exchanges its counts every ``sync_ms``, so replicas see each other's use that late."""

    per_key: Rate = custom(
        Rate(), _rate, "the limit of each API key (a key's own rate overrides it)", shown="no limit"
    )
    per_client: Rate = custom(Rate(), _rate, "the limit of each client address", shown="no limit")
    sync_s: float = millis(1000, 50, 60_000, "how often each sidecar exchanges its counts through Redis")
    default_max_tokens: int = whole(
        4096,
        1,
        10_000_000,
        "a request without max_tokens under a token limit gets one (written into its body): this "
        "many, or what is left of the tightest limit after its prompt, and that much is counted at "
        "admission (as OpenAI counts max_tokens), so no stream outruns its key's budget",
    )

    @property
    def enabled(self) -> bool:
        return self.per_key.limited or self.per_client.limited
