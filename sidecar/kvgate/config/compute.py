"""The compute-scheduling layer's settings: the gateway queue (dispatch order, bounds, priority),
length-bucketed pools, and prefill/decode disaggregation. Each lever is off unless configured."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvgate.config.fields import choice, custom, flag, millis, number, text, whole
from kvgate.config.parse import ConfigError, check_keys, integer


class DispatchOrder(str, Enum):
    FCFS = "fcfs"  # first come, first served
    SHORTEST = "shortest"  # shortest estimated prompt first; ageing bounds how long a long one waits
    FAIR = "fair"  # the tenant with the least recent service first (kvgate.tenants)


def _header_name(d: Mapping[str, Any], where: str, key: str) -> str | None:
    name = d.get(key)
    if name is None:
        return None
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}", name):
        raise ConfigError(f"{where}.{key}: expected an HTTP header name (e.g. X-Tenant-ID)")
    return name


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The gateway queue (``kvgate.queue``): while the backends a request could go to are saturated
    it waits here, and is bound to a backend when one frees up."""

    enabled: bool = flag(False, "requests wait here while their backends are saturated")
    max_size: int = whole(1000, 1, 1_000_000, "waiting requests per replica; past it a request gets 429")
    max_key_share: float = number(
        0.5,
        0.001,
        1.0,
        "of max_size, the most one API key (or tenant_header's tenant) may hold waiting (then its 429s)",
    )
    max_wait_s: float = millis(60_000, 10, 3_600_000, "a request that waited this long gets 429")
    order: DispatchOrder = choice(
        DispatchOrder.FCFS,
        "fcfs: first come, first served; shortest: least prefill first (the prompt tokens not cached "
        "where it can go); fair: between "
        "tenants (tenant_header's value, else API keys, else client addresses), least recent service "
        "first, first come first served within one",
    )
    tenant_header: str | None = custom(
        None,
        _header_name,
        "the request header naming a request's tenant (1 to 64 letters, digits or . _ : -), over its "
        "API key: for an edge that authenticates clients and sets it; Nginx refuses a request whose "
        "value is malformed (never set it where clients choose it: a client could then pose as many "
        "tenants); none: tenants are API keys, else client addresses",
        shown="none",
    )
    # 75 s measured best on the trace at 3x overload (mean 0.28x round robin with p99 below round
    # robin's; 60 s: 0.34x; 90 s: 0.24x with p99 above round robin's; 10 s turns into FCFS there).
    ageing_s: float = millis(
        75_000,
        1,
        3_600_000,
        "shortest-first: a request that has waited this long goes ahead of every younger one, so no "
        "long prompt waits more than this behind shorter ones that keep arriving (acts only when "
        "max_wait_ms is longer)",
    )
    ageing_fair_share: float | None = number(
        None,
        1.0,
        1000.0,
        "also age a request once it has waited this multiple of its fair share (the wait first come "
        "first served would have given it); none: ageing_ms alone",
    )
    # Measured on the conversation trace's bursts (docs/benchmarks.md, "Room for a request, and a
    # burst's order"): 1 and 5 ms alike in virtual time; 5 still gathers a live burst.
    gather_s: float = millis(
        0,
        0,
        1000,
        "shortest-first: a prompt longer than routing.saturation_prefill_tokens waits this long "
        "before it is placed, so that shorter ones arriving with it (a burst) go first; 0: off",
    )
    fair_window_s: float = millis(
        60_000,
        1000,
        3_600_000,
        "fair: the half-life of a tenant's service (the tokens of its requests routed, "
        "fair_output_weight), so recent ones count most",
    )
    # Measured on the two-tenant benchmark (kvgate-bench fairness): without a reserve the quiet
    # tenant's p90 was 3.2x its value alone; reserve 1 with 2,048-8,192 tokens about 1.3x, with the
    # whole saturation budget 2.1x; reserve 2 took a quarter of the flood's service for no gain.
    fair_reserve: int = whole(
        1,
        0,
        1000,
        "fair: while a tenant takes more than an equal share (its recent service and what it has "
        "waiting), it is sent only where this many other backends stay free of prefill waiting to "
        "start, so that the others' next request finds one; 0: off",
    )
    fair_prefill_tokens: int = whole(
        4096,
        1,
        10_000_000,
        "fair: and only to a backend with fewer prompt tokens than this routed and waiting for "
        "prefill (the others' next request waits behind no more there)",
    )
    # Measured on the same benchmark, the quiet tenant's p90 against alone: 0.85 when it came in; at
    # 0.65, with the KV in flight counted, every window within 1.25x on two tiny-CPU profiles (eight
    # windows) and four H100 ones (four), the flood served up to 7 % less (docs/benchmarks.md).
    fair_kv: float = number(
        0.65,
        0.05,
        1.0,
        "fair: and only to a backend whose KV cache is less used than this, the reserve's backends "
        "too, so that the others' next request finds KV blocks free (a flood's decodes fill every "
        "cache), counting what the requests in flight there may newly take (the prompt they "
        "prefill, the output each is expected to write) when that is more than the last scrape "
        "saw; 1: off",
    )
    fair_output_tokens: int = whole(
        512,
        1,
        1_000_000,
        "fair: the output a request that sets no max_tokens is counted as writing, in what the "
        "requests in flight on a backend may take of its KV cache (fair_kv) and in its tenant's "
        "service (fair_output_weight)",
    )
    # Measured on the two-tenant benchmark with a flood of long answers (kvgate-bench fairness
    # --flood-output): two tiny-CPU profiles, the flood at half the quiet tenant's rate with answers
    # 8x as long: the quiet tenant's p90 4,700-5,500x its value alone with prompts alone, 1.15-1.18x
    # at 2, 4 and 8; four H100 profiles, the flood at 1x with answers 4x as long: 2.18x, then 1.58x
    # at 2, 1.41x at 4, 1.27x at 8. Each request's charge is corrected at its end to what it wrote
    # (charged for its max_tokens, a quiet tenant asking for 4,096 was held at 560-1,700x alone).
    fair_output_weight: float = number(
        4.0,
        0.0,
        100.0,
        "fair: an output token counts as this many prompt tokens in a tenant's service (a virtual "
        "token counter: a tenant asking for long answers takes the engines' time and cache in "
        "decodes); a request is charged what its usage says it wrote (Nginx then reads it), until "
        "its end the share of its max_tokens its tenant's requests wrote lately, else "
        "fair_output_tokens; 0: prompts only",
    )
    client_priority: bool = flag(False, "honour priorities clients send (body priority, X-Priority)")
    forward_priority: bool = flag(
        False,
        "write the request's priority into its body for vLLM, over one the client wrote (backends "
        "run --scheduling-policy priority; an FCFS server ignores it)",
    )
    heartbeat_s: float = millis(
        500, 50, 10_000, "a waiting request's connection hears from the sidecar this often"
    )

    @property
    def charges_output(self) -> bool:
        """The fair order charges a tenant for its requests' output, corrected at each request's end
        by the usage its backend reports (which Nginx then reads)."""
        return self.enabled and self.order is DispatchOrder.FAIR and self.fair_output_weight > 0


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


def _rules(d: Mapping[str, Any], where: str, key: str) -> tuple[PoolRule, ...]:
    raw = d.get(key) or []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}.{key}: expected a list of {{pool: NAME, model: M, max_prompt_tokens: N}}")
    rules = []
    for i, r in enumerate(raw):
        at = f"{where}.{key}[{i}]"
        if not isinstance(r, Mapping) or not isinstance(r.get("pool"), str):
            raise ConfigError(f"{at}: expected a mapping with pool: NAME")
        check_keys(r, at, {"pool", "model", "max_prompt_tokens"})
        limit = r.get("max_prompt_tokens")
        if limit is not None:
            limit = integer(r, at, "max_prompt_tokens", 0, 1, 10_000_000)
        rules.append(PoolRule(str(r["pool"]), str(r.get("model", "*")), limit))
    return tuple(rules)


def _spill(d: Mapping[str, Any], where: str, key: str) -> dict[str, tuple[str, ...]]:
    raw = d.get(key) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}.{key}: expected a mapping of pool: [pools to try next]")
    spill: dict[str, tuple[str, ...]] = {}
    for pool, order in raw.items():
        if not isinstance(order, list) or not all(isinstance(p, str) for p in order):
            raise ConfigError(f"{where}.{key}.{pool}: expected a list of pool names")
        spill[str(pool)] = tuple(order)
    return spill


@dataclass(frozen=True, slots=True)
class PoolsConfig:
    """Length-bucketed pools: backends carry a label (``labels: {pool: short}``); rules pick a pool
    per request; the policy runs inside it; an empty or saturated pool spills in ``spill`` order."""

    label: str = text("pool", "the backend label naming its pool")
    rules: tuple[PoolRule, ...] = custom(
        (), _rules, "a list of {pool, model, max_prompt_tokens}; the first that matches picks the pool"
    )
    spill: Mapping[str, tuple[str, ...]] = custom({}, _spill, "pool: [pools to try next]")
    # 2 without the gateway queue: p99 under round robin's at 1x to 2x on the trace, 1.09x at 3x
    # (virtual, one long-prompt backend of four). 1.25 held 3x too there, but on two real servers at
    # 3x it sent long prompts into the one short backend: mean 2.0x round robin's against 0.69x at 2.
    # With the queue it changes little.
    backlog_ratio: float = number(
        2.0,
        0.0,
        1000.0,
        "also spill while the pool has room, when the prefill a request would wait for there (the least "
        "backlog among its backends, tokens routed whose first token is not back, plus its own) is this "
        "many times what it would wait for in the spill pool, so that a busy pool's requests do not "
        "queue far past what the rest of the fleet would make them wait; 0: spill only when full",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.rules)

    def check(self, where: str) -> None:
        if 0 < self.backlog_ratio < 1:
            raise ConfigError(
                f"{where}.backlog_ratio: {self.backlog_ratio} would spill to a busier pool; use 1 or more "
                "(0: spill only when full)"
            )

    def pick(self, model: str | None, tokens: int) -> PoolRule | None:
        return next((r for r in self.rules if r.matches(model, tokens)), None)


def _models(d: Mapping[str, Any], where: str, key: str) -> tuple[str, ...]:
    models = d.get(key) or []
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ConfigError(f'{where}.{key}: expected a list of model names ("*" for all)')
    return tuple(models)


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation per model: the prefill leg goes to a backend of ``prefill_pool``
    (by prefix affinity), the decode leg to one of ``decode_pool`` (by decode load), with the KV cache
    handed over by vLLM's KV connector (``kv_transfer_params``)."""

    models: tuple[str, ...] = custom((), _models, 'the models split so ("*": every model)')
    prefill_pool: str = text("prefill", "the pool of the prefill legs")
    decode_pool: str = text("decode", "the pool of the decode legs")
    label: str = text("role", "the backend label naming its pool here")

    def applies(self, model: str | None) -> bool:
        return "*" in self.models or (model is not None and model in self.models)


def _ratios(d: Mapping[str, Any], where: str, key: str) -> dict[str, float]:
    raw = d.get(key) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}.{key}: expected a mapping of model: bytes per token")
    fixed = {}
    for model, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0.5 <= v <= 64 or math.isnan(v):
            raise ConfigError(f"{where}.{key}.{model}: expected a number in 0.5..64")
        fixed[str(model)] = float(v)
    return fixed


@dataclass(frozen=True, slots=True)
class TokensConfig:
    """How prompt bytes become an estimated token count: learned per model from what the backends
    count (``vllm:prompt_tokens_total`` against the bytes routed to them), or fixed here."""

    bytes_per_token: Mapping[str, float] = custom({}, _ratios, "model: a fixed ratio, over learning")
    default_bytes_per_token: float = number(4.0, 0.5, 64, "until a model's ratio is learned")
    learn: bool = flag(True, "learn each model's ratio from the backends' own token counts")

    def ratio(self, model: str | None) -> float | None:
        if model is not None and model in self.bytes_per_token:
            return self.bytes_per_token[model]
        return None
