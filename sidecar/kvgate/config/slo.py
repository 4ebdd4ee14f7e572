"""Service-level objectives: the TTFT (and ITL) a model's or an API key's requests are promised, and
which requests the gateway may refuse rather than serve late (``kvgate.slo`` applies them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.config.fields import custom, load, millis, text, whole
from kvgate.config.parse import ConfigError


@dataclass(frozen=True, slots=True)
class Objective:
    """One objective: the requests it covers (a model, an API key's name, or both) and its bounds."""

    ttft_s: float | None = millis(None, 1, 3_600_000, "the first token within this (required)")
    itl_s: float | None = millis(
        None, 1, 60_000, "the mean gap between later tokens within this (counted when reported)"
    )
    model: str = text("*", "the model it covers (*: every model)")
    key: str | None = text(None, "the API key name it covers (none: every client)")

    def check(self, where: str) -> None:
        if self.ttft_s is None:
            raise ConfigError(f"{where}: ttft_ms is required (the time to first token promised)")

    def covers(self, model: str | None, key: str | None) -> bool:
        return (self.model == "*" or self.model == model) and (self.key is None or self.key == key)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> Objective:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected {{ttft_ms: MS, itl_ms: MS, model: M, key: NAME}}")
        return load(cls, data, where)


def _objectives(d: Mapping[str, Any], where: str, key: str) -> tuple[Objective, ...]:
    raw = d.get(key) or []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}.{key}: expected a list of {{ttft_ms: MS, model: M, key: NAME}}")
    return tuple(Objective.from_mapping(o, f"{where}.{key}[{i}]") for i, o in enumerate(raw))


@dataclass(frozen=True, slots=True)
class SloConfig:
    """Admission by objective: a request whose best predicted TTFT already breaks its objective waits
    in the gateway queue while it can still make it; past that a sheddable one is refused (429 with
    Retry-After) and any other is sent anyway."""

    objectives: tuple[Objective, ...] = custom(
        (),
        _objectives,
        "a list of {ttft_ms, itl_ms, model, key}; the first that covers a request (its model and "
        "its API key's name) is its objective",
        item=Objective,
    )
    # kvgate's classes run in vLLM's sense (lower goes first), so the sheddable ones are the late
    # classes: llm-d's "criticality below 0" mirrored.
    sheddable_priority: int = whole(
        1,
        -(2**31),
        2**31 - 1,
        "requests of this class or a later one (a higher value) may be refused rather than served "
        "late; 0: every request of the default class",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.objectives)

    def objective(self, model: str | None, key: str | None) -> Objective | None:
        return next((o for o in self.objectives if o.covers(model, key)), None)
