"""Routing settings: the policy (per model too), load thresholds, passive health."""

import pytest
from kvgate.config import ConfigError, PolicyName
from kvgate.config.fields import load
from kvgate.config.routing import OutlierConfig, RoutingConfig


def test_a_policy_per_model_over_the_default_one() -> None:
    r = load(RoutingConfig, {"policy": "least_load", "per_model": {"big": "prefix"}}, "routing")
    assert r.policy is PolicyName.LEAST_LOAD and r.per_model == {"big": PolicyName.PREFIX}
    with pytest.raises(ConfigError, match=r"routing.per_model.big: unknown policy 'fast'; choose one of"):
        load(RoutingConfig, {"per_model": {"big": "fast"}}, "routing")


def test_load_thresholds_sit_in_the_routing_section() -> None:
    r = load(RoutingConfig, {"saturation_waiting": 2, "saturation_kv": 0.5}, "routing")
    assert (r.limits.saturation_waiting, r.limits.saturation_kv, r.limits.load_factor) == (2, 0.5, 1.25)
    with pytest.raises(ConfigError, match=r"routing: unknown key\(s\) limits"):
        load(RoutingConfig, {"limits": {"saturation_kv": 0.5}}, "routing")


def test_an_ejection_never_grows_shorter() -> None:
    o = load(OutlierConfig, {"base_ejection_ms": 1000, "max_ejection_ms": 1000}, "outlier")
    assert (o.base_ejection_s, o.max_ejection_s, o.enabled) == (1.0, 1.0, True)
    with pytest.raises(
        ConfigError, match=r"outlier.max_ejection_ms must not be below outlier.base_ejection_ms"
    ):
        load(OutlierConfig, {"base_ejection_ms": 2000, "max_ejection_ms": 1000}, "outlier")


def test_a_prefix_holders_bound_defaults_looser_than_everyone_elses() -> None:
    r = load(RoutingConfig, {"load_factor": 2, "holder_load_factor": 3}, "routing")
    assert (r.limits.load_factor, r.limits.holder_load_factor) == (2, 3)
    assert load(RoutingConfig, {}, "routing").limits.holder_load_factor == 4
    with pytest.raises(ConfigError, match=r"routing.holder_load_factor"):
        load(RoutingConfig, {"holder_load_factor": 0.5}, "routing")
