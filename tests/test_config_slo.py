"""The objectives section: which requests an objective covers, what is required, and a key name that
names nobody refused."""

from __future__ import annotations

import dataclasses

import pytest
from kvgate.config import ConfigError

from tests.cores import features
from tests.test_slo import gate_of


def test_objectives_cover_the_first_matching_model_and_key() -> None:
    gate = gate_of(
        objectives=[{"ttft_ms": 200, "model": "m", "key": None}, {"ttft_ms": 2000}], sheddable_priority=0
    )
    f = features(0)
    assert gate.objective(dataclasses.replace(f, model="m")) == gate.config.objectives[0]
    assert gate.objective(dataclasses.replace(f, model="other")) == gate.config.objectives[1]
    assert gate.sheddable(0) and not gate.sheddable(-1)
    assert gate_of().objective(f) is None  # no objectives: admission by SLO is off


def test_an_objective_naming_no_api_key_is_refused_with_the_name() -> None:
    with pytest.raises(ConfigError, match="'tema-a' names no API key"):
        gate_of(objectives=[{"ttft_ms": 500, "key": "tema-a"}])


def test_an_objective_needs_its_ttft_and_no_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"objectives\[0\]: ttft_ms is required"):
        gate_of(objectives=[{"model": "m"}])
    with pytest.raises(ConfigError, match="unknown key"):
        gate_of(objectives=[{"ttft_ms": 100, "ttft": 100}])
    with pytest.raises(ConfigError, match="expected a list"):
        gate_of(objectives={"ttft_ms": 100})
