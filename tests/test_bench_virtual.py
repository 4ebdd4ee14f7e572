"""Routing quality in the test suite: a small deterministic virtual-time replay through kvgate's real
decision service and simulated engines. A regression in routing quality fails here."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from kvgate.config import PolicyName

from kvgate_bench import workloads
from kvgate_bench.bounds import fleet_ttft, pooled_cache_ideal, zero_queue_ttft
from kvgate_bench.virtual import features_for, replay
from vllm_sim.profiles import LLAMA3_8B_H100


@pytest.fixture(scope="module")
def chat() -> tuple[list[workloads.BenchRequest], list]:
    reqs = workloads.synthetic_chat(users=48, turns=5)
    return reqs, features_for(reqs)


def hit_rate(run) -> float:  # type: ignore[no-untyped-def]
    return sum(r.cached_tokens for r in run.results) / sum(r.prompt_tokens for r in run.results)


def test_kvgate_beats_round_robin_on_cache_hits_within_the_load_bound(chat) -> None:  # type: ignore[no-untyped-def]
    reqs, feats = chat
    rr = replay(reqs, feats, PolicyName.ROUND_ROBIN, 4, LLAMA3_8B_H100)
    kv = replay(reqs, feats, PolicyName.KVGATE, 4, LLAMA3_8B_H100)
    ideal = sum(pooled_cache_ideal(reqs, 4, LLAMA3_8B_H100)) / sum(r.prompt_tokens for r in reqs)
    assert len(kv.results) == len(reqs) == len(rr.results)
    assert hit_rate(kv) >= hit_rate(rr) + 0.08, (hit_rate(kv), hit_rate(rr))
    assert hit_rate(kv) >= 0.9 * ideal
    assert kv.bound_violations == 0
    per_backend = {r.backend for r in kv.results}
    assert len(per_backend) == 4


def test_replay_is_deterministic(chat) -> None:  # type: ignore[no-untyped-def]
    reqs, feats = chat
    a = replay(reqs[:120], feats, PolicyName.KVGATE, 4, LLAMA3_8B_H100)
    b = replay(reqs[:120], feats, PolicyName.KVGATE, 4, LLAMA3_8B_H100)
    assert [(r.rid, r.backend, r.ttft) for r in a.results] == [(r.rid, r.backend, r.ttft) for r in b.results]


def test_the_first_scrape_happens_at_the_phase_asked_then_every_interval(chat) -> None:  # type: ignore[no-untyped-def]
    """Live, the sidecar's scrape clock runs with its own phase against the arrivals; the twin replays
    several phases (``--scrape-phases``) to stand for any of them."""
    reqs, feats = chat
    seen: list[float] = []
    run = replay(
        reqs[:60],
        feats,
        PolicyName.KVGATE,
        4,
        LLAMA3_8B_H100,
        scrape_interval=0.5,
        scrape_phase=0.3,
        observe=lambda t, *_: seen.append(t),
    )
    assert len(run.results) == 60 and len(seen) > 3
    assert seen[0] == pytest.approx(0.3)
    assert all(b - a == pytest.approx(0.5) for a, b in itertools.pairwise(seen))


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_replay_with_the_gateway_queue_records_each_wait(chat, replicas: int) -> None:  # type: ignore[no-untyped-def]
    """A burst (every request at once, 8 times the rate) on backends that count as full early: some
    requests wait in the gateway queue, each wait is recorded, and their TTFT includes it. With
    several replicas each dispatches every request it queued."""
    reqs, feats = chat
    burst = [dataclasses.replace(r, arrival=0.0) for r in reqs[:40]]
    run = replay(
        burst,
        feats,
        PolicyName.KVGATE,
        2,
        LLAMA3_8B_H100,
        routing={"saturation_waiting": 1, "saturation_prefill_tokens": 2048},
        extra={"queue": {"enabled": True, "order": "shortest", "max_wait_ms": 600_000}},
        replicas=replicas,
    )
    assert len(run.results) == 40 and run.rejected == 0
    assert 0 < len(run.queue_waits) < 40 and all(w >= 0 for w in run.queue_waits)
    assert max(r.ttft for r in run.results) >= max(run.queue_waits)
    assert {r.replica for r in run.results} == set(range(replicas))


def test_trace_blocks_are_exact_and_shared(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = workloads.load_trace(path)
    assert len(a.prompt_ids()) == 700 and len(b.prompt_ids()) == 1100
    assert b.prompt_ids()[:512] == a.prompt_ids()[:512]
    assert len(a.body()["prompt"].split()) == 700 and a.body()["max_tokens"] == 5
    cached = pooled_cache_ideal([a, b], 1, LLAMA3_8B_H100)
    assert cached == [0, 1024]  # both leading block ids of b were seen before (counted whole)
    bound = zero_queue_ttft([a, b], cached, LLAMA3_8B_H100)
    assert bound[1] < bound[0] + LLAMA3_8B_H100.alpha_s * 400
    # A profile that prices attention (a calibrated CPU one): each uncached token attends to the
    # cached part and half the uncached; b's 76 new tokens attend to 1,024 + 38.
    cpu = dataclasses.replace(LLAMA3_8B_H100, delta_s=5e-5)
    priced = zero_queue_ttft([a, b], cached, cpu)
    assert priced[0] - bound[0] == pytest.approx(5e-5 * 700 * 350 / 1000)
    assert priced[1] - bound[1] == pytest.approx(5e-5 * 76 * (1024 + 38) / 1000)


def test_the_fleet_bound_serves_the_shortest_remaining_prefill_first_on_every_backend(tmp_path: Path) -> None:
    """A long prompt, a short one with it, and a short one a second later: on one backend the first
    short one goes first; the second comes after the long one is done, or, twice as fast, while
    it prefills, and takes its place. On two backends the long one has one to itself."""
    rows = [
        {"timestamp": 0, "input_length": 20_000, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 0, "input_length": 500, "output_length": 1, "hash_ids": [2]},
        {"timestamp": 1000, "input_length": 500, "output_length": 1, "hash_ids": [3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = workloads.load_trace(path)
    cached = pooled_cache_ideal(reqs, 1, LLAMA3_8B_H100)
    alone = zero_queue_ttft(reqs, cached, LLAMA3_8B_H100)
    long, short = alone[0] - LLAMA3_8B_H100.frontend_s, alone[1] - LLAMA3_8B_H100.frontend_s
    assert 0.5 < long + short < 0.95 and short < 0.05  # done before 1 s, not before 0.5 s
    one = fleet_ttft(reqs, cached, LLAMA3_8B_H100, 1, 1.0)
    assert one == pytest.approx([alone[0] + short, alone[1], alone[2]])
    fast = fleet_ttft(reqs, cached, LLAMA3_8B_H100, 1, 2.0)
    assert fast == pytest.approx([alone[0] + 2 * short, alone[1], alone[2]])
    assert fleet_ttft(reqs, cached, LLAMA3_8B_H100, 2, 2.0) == pytest.approx(alone)


def test_spread_arrivals_resolve_a_shared_timestamp_over_its_slot_in_file_order(tmp_path: Path) -> None:
    rows = [{"timestamp": t, "input_length": 10, "output_length": 1, "hash_ids": [i]} for i, t in
            enumerate([0, 0, 0, 0, 3000, 4000, 5000, 5000, 5000])]  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    burst = workloads.load_trace(path)
    spread = workloads.load_trace(path, spread=True)
    assert [r.arrival for r in burst] == [0, 0, 0, 0, 3, 4, 5, 5, 5]
    assert [r.blocks for r in spread] == [r.blocks for r in burst]  # the file's order, same requests
    times = [r.arrival for r in spread]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert all(0 <= t < 3 for t in times[:4]) and times[4:6] == [3, 4]  # own slots stay put
    assert all(5 <= t < 6 for t in times[6:])  # the last slot: over the median interval, 1 s
    assert workloads.load_trace(path, spread=True) == spread  # seeded: the same in every run


def test_pooled_ideal_matches_the_trace_readme_yardstick() -> None:
    """The README of the trace gives 7.4 % for 3,440 pooled 512-token blocks over the whole hour; our
    pooled capacity for 4 H100s is 3,375 such blocks."""
    reqs = workloads.load_trace(workloads.DEFAULT_TRACE)
    cached = pooled_cache_ideal(reqs, 4, LLAMA3_8B_H100)
    rate = sum(cached) / sum(r.prompt_tokens for r in reqs)
    assert 0.06 <= rate <= 0.085, rate


def test_bench_virtual_command_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    from kvgate_bench.cli import main

    code = main(
        [
            "virtual",
            "--workload",
            "chat-sessions",
            "--limit",
            "60",
            "--backends",
            "2",
            "--policies",
            "round_robin",
            "kvgate",
            "--speedups",
            "1",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = tmp_path / "chat-sessions-2-backends"
    data = json.loads((out / "report.json").read_text())
    assert [r["target"] for r in data["rows"]] == ["round_robin", "kvgate", "round_robin", "kvgate"]
    assert all(r["requests"] == 60 and r["errors"] == 0 for r in data["rows"])
    assert data["header"]["command"].startswith("kvgate-bench virtual")
    text = (out / "report.md").read_text()
    assert "| kvgate |" in text and "pooled ideal" in text
    for png in ("ttft_cdf.png", "ttft_vs_rate.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_a_frontend_cost_per_token_lets_a_bursts_short_prompt_reach_the_engine_first() -> None:
    """Live, a long prompt sent at the same instant as a short one reaches the engine later (its body
    and tokenization take longer); the replay models that only when asked, else keeps arrival order."""
    long_ = workloads.BenchRequest(0, 0.0, 4, 16 * 512, blocks=tuple(range(1000, 1016)))
    short = workloads.BenchRequest(1, 0.0, 4, 512, blocks=(2000,))
    reqs = [long_, short]
    feats = features_for(reqs)

    def ttfts(per_token: float) -> dict[int, float]:
        run = replay(reqs, feats, PolicyName.ROUND_ROBIN, 1, LLAMA3_8B_H100, frontend_per_token_s=per_token)
        return {r.rid: r.ttft for r in run.results}

    in_order = ttfts(0.0)
    assert in_order[1] > in_order[0]  # the short prompt waits behind the long one's prefill
    sorted_ = ttfts(1e-6)
    assert sorted_[1] < sorted_[0] and sorted_[1] < in_order[1] / 2


def test_past_saturation_objectives_shed_what_would_be_late_and_the_rest_meets_them(chat) -> None:  # type: ignore[no-untyped-def]
    """A burst far past two backends' capacity: with an objective of 150 ms and every request
    sheddable, the gateway refuses the ones the backlog would make late; the ones it serves meet the
    objective far more often than without it, and nearly as many do (here 50 of 51 against 53 of
    200: the least-prefill order already serves the burst's cached turns first, and shedding keeps
    that goodput while it answers the rest at once); every request is answered one way or the
    other."""
    reqs, feats = chat
    burst = [dataclasses.replace(r, arrival=i * 0.002) for i, r in enumerate(reqs[:200])]
    common: dict = {"routing": {"saturation_waiting": 1, "saturation_prefill_tokens": 2048}}
    queue = {"enabled": True, "order": "shortest", "max_wait_ms": 600_000}
    slo = {"objectives": [{"ttft_ms": 150}], "sheddable_priority": 0}

    def met(run) -> int:  # type: ignore[no-untyped-def]
        return sum(1 for r in run.results if r.ttft <= 0.15)

    plain = replay(burst, feats, PolicyName.KVGATE, 2, LLAMA3_8B_H100, **common, extra={"queue": queue})
    shed = replay(
        burst, feats, PolicyName.KVGATE, 2, LLAMA3_8B_H100, **common, extra={"queue": queue, "slo": slo}
    )
    assert plain.rejected == 0 and len(shed.results) + shed.rejected == 200
    assert shed.rejected > 0
    assert met(shed) / len(shed.results) >= 2 * met(plain) / len(plain.results), (met(shed), met(plain))
    assert met(shed) >= 0.9 * met(plain)  # goodput kept, not only a higher share
