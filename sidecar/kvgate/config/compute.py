"""The compute-scheduling layer's settings: the gateway queue (dispatch order, bounds, priority),
length-bucketed pools, and prefill/decode disaggregation. Each lever is off unless configured."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvgate.config.parse import ConfigError, boolean, check_keys, integer, ms, num


class DispatchOrder(str, Enum):
    FCFS = "fcfs"  # first come, first served
    SHORTEST = "shortest"  # shortest estimated prompt first; ageing bounds how long a long one waits


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The gateway queue (``kvgate.queue``): while the backends a request could go to are saturated
    it waits here, and is bound to a backend when one frees up."""

    enabled: bool = False
    max_size: int = 1000  # waiting requests per replica; past it a request gets 429
    max_key_share: float = 0.5  # of max_size, the most one API key may hold waiting (then its 429s)
    max_wait_s: float = 60.0  # a request that waited this long gets 429
    order: DispatchOrder = DispatchOrder.FCFS
    # shortest-first: a request that has waited this long goes ahead of every younger one, so no
    # long prompt waits more than this behind shorter ones that keep arriving. 75 s measured best
    # on the trace at 3x overload (mean 0.28x round robin with p99 below round robin's; 60 s: 0.34x;
    # 90 s: 0.24x with p99 above round robin's; 10 s turns into FCFS there). Acts only when
    # max_wait_s is longer: a request that reaches max_wait_s first gets its 429 instead.
    ageing_s: float = 75.0
    # Also age a request once it has waited this multiple of its fair share: the wait first come
    # first served would have given it (the queue ahead of it at arrival over the dispatch rate).
    # None: the fixed ageing_s alone.
    ageing_fair_share: float | None = None
    client_priority: bool = False  # honour priorities clients send (body ``priority``, X-Priority)
    # Write the request's priority into its body for vLLM (backends run --scheduling-policy
    # priority; others refuse a non-zero priority).
    forward_priority: bool = False
    heartbeat_s: float = 0.5  # a waiting request's connection hears from the sidecar this often

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> QueueConfig:
        w = "queue"
        check_keys(
            d,
            w,
            {
                "enabled",
                "max_size",
                "max_key_share",
                "max_wait_ms",
                "order",
                "ageing_ms",
                "ageing_fair_share",
                "client_priority",
                "forward_priority",
                "heartbeat_ms",
            },
        )
        order = d.get("order", "fcfs")
        try:
            dispatch = DispatchOrder(order)
        except ValueError:
            names = ", ".join(o.value for o in DispatchOrder)
            raise ConfigError(f"{w}.order: unknown order {order!r}; choose one of {names}") from None
        return cls(
            enabled=boolean(d, w, "enabled", False),
            max_size=integer(d, w, "max_size", 1000, 1, 1_000_000),
            max_key_share=num(d, w, "max_key_share", 0.5, 0.001, 1.0),
            max_wait_s=ms(d, w, "max_wait_ms", 60_000, 10, 3_600_000),
            order=dispatch,
            ageing_s=ms(d, w, "ageing_ms", 75_000, 1, 3_600_000),
            ageing_fair_share=None
            if d.get("ageing_fair_share") is None
            else num(d, w, "ageing_fair_share", 2.0, 1.0, 1000.0),
            client_priority=boolean(d, w, "client_priority", False),
            forward_priority=boolean(d, w, "forward_priority", False),
            heartbeat_s=ms(d, w, "heartbeat_ms", 500, 50, 10_000),
        )


@dataclass(frozen=True, slots=True)
class PoolRule:
    """Requests for ``model`` (``*``: any) whose prompt is estimated below ``max_prompt_tokens`` go to
    ``pool``; the first rule that matches wins."""

    pool: str
    model: str = "*"
    max_prompt_tokens: int | None = None

    def matches(self, model: str | None, tokens: int) -> bool:
        return (self.model == "*" or self.model == model) and (
            self.max_prompt_tokens is None or tokens < self.max_prompt_tokens
        )


@dataclass(frozen=True, slots=True)
class PoolsConfig:
    """Length-bucketed pools: backends carry a label (``labels: {pool: short}``); rules pick a pool
    per request; the policy runs inside it; an empty or saturated pool spills in ``spill`` order."""

    label: str = "pool"
    rules: tuple[PoolRule, ...] = ()
    spill: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.rules)

    def pick(self, model: str | None, tokens: int) -> PoolRule | None:
        return next((r for r in self.rules if r.matches(model, tokens)), None)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> PoolsConfig:
        w = "pools"
        check_keys(d, w, {"label", "rules", "spill"})
        raw = d.get("rules") or []
        if not isinstance(raw, list):
            raise ConfigError(f"{w}.rules: expected a list of {{pool: NAME, model: M, max_prompt_tokens: N}}")
        rules = []
        for i, r in enumerate(raw):
            where = f"{w}.rules[{i}]"
            if not isinstance(r, Mapping) or not isinstance(r.get("pool"), str):
                raise ConfigError(f"{where}: expected a mapping with pool: NAME")
            check_keys(r, where, {"pool", "model", "max_prompt_tokens"})
            limit = r.get("max_prompt_tokens")
            if limit is not None:
                limit = integer(r, where, "max_prompt_tokens", 0, 1, 10_000_000)
            rules.append(PoolRule(str(r["pool"]), str(r.get("model", "*")), limit))
        spill_raw = d.get("spill") or {}
        if not isinstance(spill_raw, Mapping):
            raise ConfigError(f"{w}.spill: expected a mapping of pool: [pools to try next]")
        spill: dict[str, tuple[str, ...]] = {}
        for pool, order in spill_raw.items():
            if not isinstance(order, list) or not all(isinstance(p, str) for p in order):
                raise ConfigError(f"{w}.spill.{pool}: expected a list of pool names")
            spill[str(pool)] = tuple(order)
        return cls(label=str(d.get("label", "pool")), rules=tuple(rules), spill=spill)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation per model: the prefill leg goes to a backend of ``prefill_pool``
    (by prefix affinity), the decode leg to one of ``decode_pool`` (by decode load), with the KV cache
    handed over by vLLM's KV connector (``kv_transfer_params``)."""

    models: tuple[str, ...] = ()  # "*" for every model
    prefill_pool: str = "prefill"
    decode_pool: str = "decode"
    label: str = "role"  # the backend label naming its pool here

    def applies(self, model: str | None) -> bool:
        return "*" in self.models or (model is not None and model in self.models)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> DisaggConfig:
        w = "disaggregation"
        check_keys(d, w, {"models", "prefill_pool", "decode_pool", "label"})
        models = d.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise ConfigError(f'{w}.models: expected a list of model names ("*" for all)')
        return cls(
            models=tuple(models),
            prefill_pool=str(d.get("prefill_pool", "prefill")),
            decode_pool=str(d.get("decode_pool", "decode")),
            label=str(d.get("label", "role")),
        )


@dataclass(frozen=True, slots=True)
class TokensConfig:
    """How prompt bytes become an estimated token count: learned per model from what the backends
    count (``vllm:prompt_tokens_total`` against the bytes routed to them), or fixed here."""

    bytes_per_token: Mapping[str, float] = field(default_factory=dict)  # model -> fixed ratio
    default_bytes_per_token: float = 4.0  # until a model's ratio is learned
    learn: bool = True

    def ratio(self, model: str | None) -> float | None:
        if model is not None and model in self.bytes_per_token:
            return self.bytes_per_token[model]
        return None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> TokensConfig:
        w = "tokens"
        check_keys(d, w, {"bytes_per_token", "default_bytes_per_token", "learn"})
        raw = d.get("bytes_per_token") or {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{w}.bytes_per_token: expected a mapping of model: bytes per token")
        fixed = {}
        for model, v in raw.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.5 <= v <= 64 or math.isnan(v):
                raise ConfigError(f"{w}.bytes_per_token.{model}: expected a number in 0.5..64")
            fixed[str(model)] = float(v)
        return cls(
            bytes_per_token=fixed,
            default_bytes_per_token=num(d, w, "default_bytes_per_token", 4.0, 0.5, 64),
            learn=boolean(d, w, "learn", True),
        )
