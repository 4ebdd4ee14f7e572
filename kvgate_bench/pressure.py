"""The cache-pressure workload: many tenants, each with a long context of its own that every one of
its requests starts with, whose contexts together fill most of the fleet's KV cache.

Servers must evict, so which server still holds a tenant's context changes over the run: the case
where an index built from routing decisions (kvgate's approximate one) keeps sending a tenant to a
server that dropped it, and one built from the servers' own KV events knows. Tenants are drawn with
Zipf weights (a few busy ones, a long tail), arrivals are Poisson.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

from vllm_sim import tokenizer

Arrival = tuple[float, list[dict[str, str]], int]  # (time, chat messages, answer tokens)


def cache_pressure(
    tenants: int = 160,
    context_tokens: int = 8_000,
    requests: int = 3_000,
    rate: float = 10.0,
    question_tokens: int = 100,
    answer_tokens: int = 100,
    zipf: float = 0.6,
    seed: int = 5,
    filler: Callable[[str, int], list[str]] = tokenizer.filler_words,
) -> list[Arrival]:
    """With the defaults the contexts need 1.28 M tokens of KV: 74 % of four llama3-8b-h100 servers'
    cache (27,000 blocks of 16 tokens each), before the running requests' own blocks."""
    rng = random.Random(seed)
    contexts = [" ".join(filler(f"pressure{seed}-tenant{k}", context_tokens)) for k in range(tenants)]
    weights = [1.0 / (k + 1) ** zipf for k in range(tenants)]
    out: list[Arrival] = []
    t = 0.0
    for rid in range(requests):
        t += rng.expovariate(rate)
        k = rng.choices(range(tenants), weights)[0]
        question = " ".join(filler(f"pressure{seed}-q{rid}", question_tokens))
        messages = [{"role": "system", "content": contexts[k]}, {"role": "user", "content": question}]
        out.append((t, messages, answer_tokens))
    return out


def add_pressure_args(p: argparse.ArgumentParser) -> None:
    """The workload's size, to fit a smaller fleet (a real one on CPU); defaults as above."""
    p.add_argument("--pressure-tenants", type=int, default=160, help="pressure workload: tenants")
    p.add_argument(
        "--pressure-context", type=int, default=8_000, help="pressure workload: tokens of each context"
    )
    p.add_argument("--pressure-rate", type=float, default=10.0, help="pressure workload: arrivals per second")


def from_args(args: argparse.Namespace, filler: Callable[[str, int], list[str]]) -> list[Arrival]:
    return cache_pressure(
        tenants=args.pressure_tenants,
        context_tokens=args.pressure_context,
        rate=args.pressure_rate,
        filler=filler,
    )
