"""Measures a profile's cost model on the virtual clock against the published figures it targets."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from vllm_sim import tokenizer
from vllm_sim.engine import Engine, run_to_completion
from vllm_sim.profiles import Profile, Target
from vllm_sim.request import EngineConfig, Request, StepResult

TOLERANCE = 0.20


@dataclass(frozen=True, slots=True)
class Check:
    target: Target
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.target.value

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE


def _prompt(key: int, n: int) -> list[int]:
    return [tokenizer.token_id(w) for w in tokenizer.filler_words(key, n)]


def idle_ttft_ms(profile: Profile, prompt_tokens: int = 256) -> float:
    engine = Engine(EngineConfig.from_profile(profile))
    req = Request("ttft", _prompt(1, prompt_tokens), 1, 0.0, ignore_eos=True)
    run_to_completion(engine, [req])
    assert req.ttft is not None
    return req.ttft * 1000.0


def decode_step_ms(profile: Profile, batch: int) -> float:
    engine = Engine(EngineConfig.from_profile(profile))
    reqs = [Request(f"d{i}", _prompt(100 + i, 32), 128, 0.0, ignore_eos=True) for i in range(batch)]
    steps: list[float] = []

    def record(result: StepResult) -> None:
        if result.prefill_tokens == 0 and result.decode_seqs == batch:
            steps.append(result.duration)

    run_to_completion(engine, reqs, record)
    return statistics.median(steps) * 1000.0


def prefill_throughput(profile: Profile, prompt_tokens: int = 8192) -> float:
    engine = Engine(EngineConfig.from_profile(profile))
    req = Request("prefill", _prompt(2, prompt_tokens), 1, 0.0, ignore_eos=True)
    run_to_completion(engine, [req])
    assert req.ttft is not None
    return prompt_tokens / (req.ttft - profile.frontend_s)


def calibrate(profile: Profile) -> list[Check]:
    measured = [
        idle_ttft_ms(profile),
        decode_step_ms(profile, 1),
        decode_step_ms(profile, 8),
        decode_step_ms(profile, 64),
        prefill_throughput(profile),
    ]
    return [Check(t, m) for t, m in zip(profile.targets, measured, strict=True)]


def report(profile: Profile, checks: list[Check]) -> str:
    lines = [
        f"profile {profile.name} (tolerance ±{TOLERANCE:.0%})",
        f"{'figure':32} {'measured':>10} {'target':>10} {'ratio':>6}  source",
    ]
    for c in checks:
        mark = "" if c.ok else "  OUT OF TOLERANCE"
        lines.append(
            f"{c.target.name:32} {c.measured:>10.1f} {c.target.value:>10.1f} {c.ratio:>6.2f}  "
            f"{c.target.unit}; {c.target.source}{mark}"
        )
    return "\n".join(lines)
