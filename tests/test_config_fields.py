"""The one declaration of each setting: keys, defaults, ranges and the reference page derive from it."""

from __future__ import annotations

import dataclasses

import pytest
from kvgate.config import (
    Config,
    ConfigError,
    GatewayConfig,
    QueueConfig,
    RoutingConfig,
    ScrapeConfig,
    reference,
)
from kvgate.config.fields import keys, load, specs

from tests.helpers import ROOT


def test_a_section_accepts_exactly_its_declared_keys_with_durations_in_ms() -> None:
    assert keys(ScrapeConfig) == {
        "interval_ms",
        "timeout_ms",
        "stale_after_ms",
        "unhealthy_after",
        "healthy_after",
        "membership_refresh_ms",
    }
    with pytest.raises(ConfigError, match=r"scrape: unknown key\(s\) interval_s; allowed: healthy_after"):
        load(ScrapeConfig, {"interval_s": 1}, "scrape")


def test_an_empty_section_is_the_dataclass_defaults() -> None:
    """The declared default is the default: loading nothing gives what constructing nothing gives."""
    for f in dataclasses.fields(Config):
        if f.default_factory is not dataclasses.MISSING:
            cls = type(f.default_factory())
            assert load(cls, {}, f.name) == cls(), f.name


def test_durations_are_written_in_ms_and_kept_in_seconds() -> None:
    assert load(QueueConfig, {"max_wait_ms": 2500}, "queue").max_wait_s == 2.5
    with pytest.raises(ConfigError, match=r"queue.max_wait_ms: 5 ms is out of range; use 10..3600000 ms"):
        load(QueueConfig, {"max_wait_ms": 5}, "queue")
    with pytest.raises(ConfigError, match=r"queue.heartbeat_ms: expected a number of milliseconds"):
        load(QueueConfig, {"heartbeat_ms": "fast"}, "queue")


def test_a_nested_part_reads_its_keys_from_the_same_section() -> None:
    routing = load(RoutingConfig, {"load_factor": 2, "policy": "prefix"}, "routing")
    assert routing.limits.load_factor == 2.0 and routing.policy.value == "prefix"
    with pytest.raises(
        ConfigError, match=r"routing.policy: unknown policy 'nope'; choose one of round_robin"
    ):
        load(RoutingConfig, {"policy": "nope"}, "routing")


def test_cross_field_rules_run_after_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"scrape.timeout_ms must not exceed scrape.interval_ms"):
        load(ScrapeConfig, {"interval_ms": 100, "timeout_ms": 200}, "scrape")
    # A floor left unset follows a lower ceiling; one given above it is refused.
    assert load(GatewayConfig, {"first_byte_timeout_ms": 1000}, "gateway").first_byte_min_ms == 1000
    with pytest.raises(ConfigError, match=r"first_byte_min_ms \(2000\) must not exceed"):
        load(GatewayConfig, {"first_byte_timeout_ms": 1000, "first_byte_min_ms": 2000}, "gateway")


def test_every_setting_has_help() -> None:
    for f in dataclasses.fields(Config):
        cls = type(f.default_factory()) if f.default_factory is not dataclasses.MISSING else None
        for name, spec in specs(cls) if cls else ():
            assert len(spec.help) > 8, (f.name, name)


def test_the_reference_page_is_the_declarations() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text() == reference(Config), (
        "docs/configuration.md is stale: kvgate config-reference > docs/configuration.md"
    )
