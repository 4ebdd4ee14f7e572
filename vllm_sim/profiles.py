"""Hardware profiles: the step-time model and per-GPU defaults.

A step of the engine (one forward pass over the continuous batch) lasts

    t0 + alpha * prefill_tokens + beta * decode_seqs + gamma * context_tokens / 1000
       + delta * prefill_attention / 1000

where ``prefill_attention`` sums, over the prefill chunks of the step, chunk tokens x the context
they attend to (the chunk's start plus half of it): attention's quadratic share of a prefill. It is
small beside the weights on a GPU at 8B scale (delta 0 in those profiles) and the largest cost of a
tiny model on a CPU, where a calibration measures it.

Every constant comes from the published figures collected in the vLLM contract (§4 and §7); the
``targets`` are the figures ``vllm-sim calibrate`` checks the model against, each with its source.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float  # milliseconds, or tokens per second for throughput targets
    unit: str
    source: str


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    t0_s: float  # fixed cost of one step (weights read once per step: memory-bound)
    alpha_s: float  # per prefill token (compute-bound)
    beta_s: float  # per decoding sequence
    gamma_s: float  # per 1,000 context tokens of each scheduled sequence (attention KV reads)
    frontend_s: float  # API, tokenization and detokenization before the first step
    num_gpu_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    targets: tuple[Target, ...]
    block_size: int = 16  # tokens per KV block (vLLM: 16 on GPUs, 128 on CPU)
    delta_s: float = 0.0  # per prefill token per 1,000 tokens of context it attends to

    def step_time(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_attention: float = 0.0
    ) -> float:
        return (
            self.t0_s
            + self.alpha_s * prefill_tokens
            + self.beta_s * decode_seqs
            + self.gamma_s * context_tokens / 1000.0
            + self.delta_s * prefill_attention / 1000.0
        )


# Llama-3.1-8B BF16 on one H100 SXM 80 GB.
# t0, beta: vLLM CI latency test, batch 8 -> 7.8 ms per decode step; the NIM ITL curve
#   ITL(b) = ITL1 * (1 + b/150) gives ITL1 = 7.4 ms, so t0 = 7.35 ms and beta = 7.4/150 = 0.049 ms.
# alpha: compute-bound prefill at 40-60 % MFU, 25-35k tokens/s -> 30k tokens/s = 0.0325 ms/token.
# gamma: 128 KB of KV per token at 3.35 TB/s -> ~0.04 ms per 1k tokens; the contract suggests 0.01 ms
#   with overlap, we take 0.01 ms.
# frontend: the contract's t_fixed of ~10-30 ms for API, tokenization and scheduling; 10 ms.
# num_gpu_blocks: (0.9 * 80 GB - 16 GB weights - activations) / (16 tokens * 128 KB) ~ 27,000, the
#   figure vLLM's cache_config_info sample shows; max_num_batched_tokens / max_num_seqs: vLLM's
#   defaults for a >=70 GiB GPU that is not an A100.
LLAMA3_8B_H100 = Profile(
    name="llama3-8b-h100",
    t0_s=7.35e-3,
    alpha_s=0.0325e-3,
    beta_s=0.049e-3,
    gamma_s=0.01e-3,
    frontend_s=10e-3,
    num_gpu_blocks=27_000,
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
    max_model_len=131_072,
    targets=(
        Target("idle TTFT, 256-token prompt", 25.0, "ms", "contract §7.2: t_fixed 10 ms + one ~16 ms step"),
        Target("decode step, batch 1", 7.4, "ms", "vLLM CI 7.8 ms @ b=8 on the NIM curve 1+b/150"),
        Target("decode step, batch 8", 7.8, "ms", "vLLM CI latency test, H100: 997 ms / 128 steps"),
        Target("decode step, batch 64", 10.6, "ms", "NIM ITL curve 7.4 * (1 + 64/150)"),
        Target("prefill throughput, 8k prompt", 30_000.0, "tok/s", "contract §7.2: 25-35k tok/s"),
    ),
)

# Llama-3.1-8B BF16 on one A100 SXM 80 GB: the contract's scaling of the H100 model, x1.55 decode
# (2.0 vs 3.35 TB/s) and x3 prefill (312 vs 989 TFLOPS); vLLM's A100 defaults 2048 / 256.
LLAMA3_8B_A100 = Profile(
    name="llama3-8b-a100",
    t0_s=11.4e-3,
    alpha_s=0.0975e-3,
    beta_s=0.076e-3,
    gamma_s=0.016e-3,
    frontend_s=10e-3,
    num_gpu_blocks=27_000,
    max_num_batched_tokens=2048,
    max_num_seqs=256,
    max_model_len=131_072,
    targets=(
        Target("idle TTFT, 256-token prompt", 46.0, "ms", "contract §7.2: t_fixed 10 ms + ~36 ms step"),
        Target("decode step, batch 1", 11.5, "ms", "contract §7.2: A100-80G ~10-12 ms in practice"),
        Target("decode step, batch 8", 12.1, "ms", "11.5 ms on the NIM curve 1+b/150"),
        Target("decode step, batch 64", 16.4, "ms", "contract §7.2: ITL at b=32 ~12-16 ms, NIM curve"),
        Target("prefill throughput, 8k prompt", 10_000.0, "tok/s", "contract §7.2: 8-12k tok/s"),
    ),
)

PROFILES: dict[str, Profile] = {p.name: p for p in (LLAMA3_8B_H100, LLAMA3_8B_A100)}


def get_profile(name: str) -> Profile:
    """A built-in profile by name, or one a calibration wrote (a path to its JSON file)."""
    if name.endswith(".json"):
        return load_profile(Path(name))
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(sorted(PROFILES))}") from None


def load_profile(path: Path) -> Profile:
    """A profile measured on a real server (``python -m vllm_real.calibrate``): its fields, its
    measurements kept beside them as the targets."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read profile {path}: {exc}") from None
    fields = {f.name for f in dataclasses.fields(Profile)} - {"targets"}
    try:
        return Profile(**{k: v for k, v in data.items() if k in fields}, targets=())
    except TypeError as exc:
        raise ValueError(f"profile {path} lacks a field: {exc}") from None
