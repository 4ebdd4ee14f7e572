"""The compute layer's settings: queue bounds and order, pool rules and spill, disaggregation."""

import pytest
from kvgate.config import ConfigError, DispatchOrder
from kvgate.config.compute import DisaggConfig, PoolsConfig, QueueConfig
from kvgate.config.fields import load


def test_the_queue_is_off_until_enabled_and_its_ageing_is_optional() -> None:
    q = load(QueueConfig, {}, "queue")
    assert not q.enabled and q.order is DispatchOrder.FCFS and q.ageing_fair_share is None
    q = load(QueueConfig, {"enabled": True, "order": "shortest", "ageing_fair_share": 3}, "queue")
    assert q.enabled and q.order is DispatchOrder.SHORTEST and q.ageing_fair_share == 3.0
    with pytest.raises(ConfigError, match=r"queue.order: unknown order 'lifo'; choose one of fcfs, shortest"):
        load(QueueConfig, {"order": "lifo"}, "queue")


def test_the_first_pool_rule_that_matches_picks_the_pool() -> None:
    pools = load(
        PoolsConfig,
        {
            "rules": [
                {"pool": "short", "max_prompt_tokens": 2000},
                {"pool": "big", "model": "m2"},
                {"pool": "long"},
            ],
            "spill": {"long": ["short"]},
        },
        "pools",
    )
    assert pools.enabled and pools.spill == {"long": ("short",)}
    assert [pools.pick(m, t).pool for m, t in (("m1", 10), ("m2", 5000), ("m1", 5000))] == [
        "short",
        "big",
        "long",
    ]
    with pytest.raises(ConfigError, match=r"pools.rules\[0\]: expected a mapping with pool: NAME"):
        load(PoolsConfig, {"rules": [{"model": "x"}]}, "pools")
    with pytest.raises(ConfigError, match=r"pools.spill.long: expected a list of pool names"):
        load(PoolsConfig, {"spill": {"long": "short"}}, "pools")


def test_disaggregation_applies_to_the_models_it_names() -> None:
    d = load(DisaggConfig, {"models": ["m1"]}, "disaggregation")
    assert d.applies("m1") and not d.applies("m2") and not d.applies(None)
    assert load(DisaggConfig, {"models": ["*"]}, "disaggregation").applies("any")
    with pytest.raises(ConfigError, match=r"disaggregation.models: expected a list of model names"):
        load(DisaggConfig, {"models": "m1"}, "disaggregation")


def test_a_pool_spills_by_backlog_at_2_unless_told_otherwise_and_never_to_a_busier_pool() -> None:
    assert load(PoolsConfig, {}, "pools").backlog_ratio == 2.0
    assert load(PoolsConfig, {"backlog_ratio": 0}, "pools").backlog_ratio == 0.0  # only when full
    with pytest.raises(ConfigError, match="would spill to a busier pool"):
        load(PoolsConfig, {"backlog_ratio": 0.5}, "pools")
