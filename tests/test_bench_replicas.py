"""Several gateway replicas in the virtual replay: each its own routing core, sessions shared as
through Redis, in-flight load shared as the sidecars share it (``kvgate.shared_load``) or not."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

import pytest
from kvgate.config import PolicyName

from kvgate_bench import workloads
from kvgate_bench.virtual import Run, features_for, replay
from kvgate_bench.virtual_gateway import Spread
from vllm_sim.profiles import LLAMA3_8B_H100


def hit_rate(run: Run) -> float:
    return sum(r.cached_tokens for r in run.results) / sum(r.prompt_tokens for r in run.results)


@pytest.fixture(scope="module")
def sessions() -> tuple[list[workloads.BenchRequest], list]:
    reqs = workloads.synthetic_chat(users=48, turns=5, session_header=True)
    return reqs, features_for(reqs)


def test_replicas_share_session_bindings_so_a_conversation_stays_on_one_backend(sessions) -> None:  # type: ignore[no-untyped-def]
    reqs, feats = sessions
    one = replay(reqs, feats, PolicyName.KVGATE, 4, LLAMA3_8B_H100)
    four = replay(reqs, feats, PolicyName.KVGATE, 4, LLAMA3_8B_H100, replicas=4)
    assert len(four.results) == len(reqs)
    assert set(Counter(r.replica for r in four.results)) == {0, 1, 2, 3}  # the client spread them
    user_of = {r.rid: r.headers["X-Session-ID"] for r in reqs}
    backends: dict[str, set[str]] = defaultdict(set)
    for r in four.results:
        backends[user_of[r.rid]].add(r.backend)
    assert sum(len(b) == 1 for b in backends.values()) >= 0.9 * len(backends)
    assert hit_rate(four) >= hit_rate(one) - 0.02


def test_round_robin_spread_takes_the_replicas_in_turn(sessions) -> None:  # type: ignore[no-untyped-def]
    reqs, feats = sessions
    run = replay(
        reqs[:40], feats, PolicyName.KVGATE, 2, LLAMA3_8B_H100, replicas=4, spread=Spread.ROUND_ROBIN
    )
    by_rid = {r.rid: r.replica for r in run.results}
    assert [by_rid[i] for i in range(8)] == [1, 2, 3, 0, 1, 2, 3, 0]


def long_prompts(n: int, every_s: float) -> list[workloads.BenchRequest]:
    """Distinct 8,000-token prompts (no prefix to follow), ``every_s`` apart."""
    return [
        workloads.BenchRequest(i, i * every_s, 4, 8 * 1000, blocks=tuple(range(100 * i, 100 * i + 16)))
        for i in range(n)
    ]


def test_shared_load_spreads_prompts_the_replicas_send_between_two_scrapes() -> None:
    """Two replicas take turns sending long prompts 150 ms apart to two backends, faster than they are
    scraped (every 500 ms). As islands, each sees only its own prefill in flight and both pile onto
    what looks idle; sharing their load through Redis every 100 ms, each sees the other's."""
    reqs = long_prompts(24, 0.15)
    feats = features_for(reqs)

    def run(share: bool) -> Run:
        return replay(
            reqs, feats, PolicyName.KVGATE, 2, LLAMA3_8B_H100, replicas=2, spread=Spread.ROUND_ROBIN,
            share_load=share, scrape_phase=0.45,
        )  # fmt: skip

    islands, shared = run(False), run(True)
    assert len(islands.results) == len(shared.results) == len(reqs)
    mean = statistics.fmean
    assert mean(r.ttft for r in shared.results) < 0.9 * mean(r.ttft for r in islands.results)


def test_every_replica_reads_the_engines_kv_events() -> None:
    """With the exact index each replica subscribes to every publisher: what one replica's request
    put in a cache, another's prediction sees, as the engine then delivers it."""
    reqs = workloads.synthetic_chat(users=24, turns=4)
    feats = features_for(reqs)
    run = replay(reqs, feats, PolicyName.KVGATE, 4, LLAMA3_8B_H100, replicas=2, index="exact")
    later = [r for r in run.results if r.cached_tokens > 0]
    assert {r.replica for r in later} == {0, 1}
    gaps = sorted(abs(r.predicted_tokens - r.cached_tokens) / r.prompt_tokens for r in later)
    assert gaps[len(gaps) // 2] < 0.05
