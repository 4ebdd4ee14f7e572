"""Parsing helpers shared by the config sections: each checks one value and says how to fix it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    pass


def section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping of settings, got {type(value).__name__}")
    return value


def check_keys(data: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def shown(value: float) -> str:
    """A number as a person writes it: 3600000, not 3.6e+06; 0.5 stays 0.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def ms(data: Mapping[str, Any], where: str, key: str, default_ms: float, lo: float, hi: float) -> float:
    value = data.get(key, default_ms)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{key}: expected a number of milliseconds, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}.{key}: {value} ms is out of range; use {shown(lo)}..{shown(hi)} ms")
    return float(value) / 1000.0


def num(data: Mapping[str, Any], where: str, key: str, default: float, lo: float, hi: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}.{key}: {value} is out of range; use {shown(lo)}..{shown(hi)}")
    return float(value)


def integer(data: Mapping[str, Any], where: str, key: str, default: int, lo: int, hi: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}.{key}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}.{key}: {value} is out of range; use {lo}..{hi}")
    return value


def boolean(data: Mapping[str, Any], where: str, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected true or false, got {value!r}")
    return value
