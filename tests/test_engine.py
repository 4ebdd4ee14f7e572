import asyncio
import itertools

from vllm_sim import tokenizer
from vllm_sim.engine import Engine, run_to_completion
from vllm_sim.profiles import LLAMA3_8B_H100 as H100
from vllm_sim.realtime import EngineLoop
from vllm_sim.request import EngineConfig, Request, SchedulingPolicy


def prompt(key: int, n: int) -> list[int]:
    return tokenizer.encode(" ".join(tokenizer.filler_words(key, n)))


def engine(**kw: object) -> Engine:
    return Engine(EngineConfig.from_profile(H100, **kw))


def test_second_identical_prompt_hits_whole_blocks_and_leaves_one_token() -> None:
    e = engine()
    p = prompt(1, 4000)
    first = Request("a", p, 8, 0.0, ignore_eos=True)
    second = Request("b", p, 8, 10.0, ignore_eos=True)
    run_to_completion(e, [first, second])
    assert first.cached_tokens == 0
    assert second.cached_tokens == 3984  # 249 full blocks: (4000 - 1) // 16 * 16
    assert e.counters.prefix_hits == 3984
    assert e.counters.prefix_queries == 8000
    saved = H100.alpha_s * 3984
    assert first.ttft is not None and second.ttft is not None
    assert abs((first.ttft - second.ttft) - saved) < 0.002


def test_ignore_eos_produces_exactly_max_tokens() -> None:
    e = engine()
    reqs = [Request(str(i), prompt(i, 50), 37, 0.0, ignore_eos=True) for i in range(5)]
    run_to_completion(e, reqs)
    assert all(r.num_output == 37 and r.finish_reason == "length" for r in reqs)


def test_without_ignore_eos_length_is_drawn_deterministically() -> None:
    lens = []
    for _ in range(2):
        e = engine(seed=3)
        r = Request("x", prompt(9, 64), 1000, 0.0)
        run_to_completion(e, [r])
        lens.append((r.num_output, r.finish_reason))
    assert lens[0] == lens[1]
    assert lens[0][1] == "stop" and 1 <= lens[0][0] < 1000


def test_same_seed_and_requests_give_identical_ttfts() -> None:
    def run() -> list[float]:
        e = engine(seed=11, num_gpu_blocks=400)
        reqs = [Request(str(i), prompt(i % 7, 300 + 40 * i), 64, 0.01 * i) for i in range(40)]
        run_to_completion(e, reqs)
        return [r.ttft or -1.0 for r in reqs]

    assert run() == run()


def test_chunked_prefill_splits_long_prompts_by_token_budget() -> None:
    e = engine(max_num_batched_tokens=1024)
    r = Request("long", prompt(2, 4096), 1, 0.0, ignore_eos=True)
    steps = []
    run_to_completion(e, [r], steps.append)
    assert [s.prefill_tokens for s in steps] == [1024, 1024, 1024, 1024]


def test_a_short_prompt_behind_a_long_prefill_is_answered_with_its_last_chunk() -> None:
    """As real vLLM does (``tests/real/test_signals.py``): a prefill in progress is scheduled before
    one that waits, so a short prompt arriving during a long one gets its first token in the step
    of the long one's last chunk, many times its TTFT alone."""
    alone = Request("alone", prompt(3, 100), 1, 0.0, ignore_eos=True)
    run_to_completion(engine(), [alone])
    long = Request("long", prompt(4, 40_000), 1, 0.0, ignore_eos=True)
    short = Request("short", prompt(5, 100), 1, 0.1, ignore_eos=True)
    run_to_completion(engine(), [long, short])
    assert long.ttft is not None and short.ttft is not None and alone.ttft is not None
    assert long.ttft > 1.0
    assert abs((short.arrival + short.ttft) - (long.arrival + long.ttft)) < 0.001
    assert short.ttft > 10 * alone.ttft


def test_decodes_are_scheduled_before_new_prefills() -> None:
    e = engine(max_num_batched_tokens=512)
    a = Request("a", prompt(1, 100), 50, 0.0, ignore_eos=True)
    b = Request("b", prompt(2, 2000), 5, 0.05, ignore_eos=True)
    steps = []
    run_to_completion(e, [a, b], steps.append)
    mixed = [s for s in steps if s.prefill_tokens and s.decode_seqs]
    # Each step gives the decode its token first; the prefill gets what is left of the budget.
    assert mixed and mixed[0].prefill_tokens == 511
    assert all(s.prefill_tokens <= 511 and s.decode_seqs == 1 for s in mixed)


def test_preemption_under_block_pressure_recomputes_and_is_counted() -> None:
    """With too few blocks, the most recently admitted request is preempted and later finishes."""
    e = engine(num_gpu_blocks=40)  # 39 usable blocks = 624 tokens
    reqs = [Request(str(i), prompt(20 + i, 200), 120, 0.0, ignore_eos=True) for i in range(3)]
    run_to_completion(e, reqs)
    assert e.counters.preemptions > 0
    assert all(r.finish_reason == "length" and r.num_output == 120 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) == e.counters.preemptions


def test_priority_policy_serves_lower_priority_value_first_and_fcfs_ignores_it() -> None:
    """Under --scheduling-policy priority the lower value is served first among the waiting; vLLM's
    default FCFS takes the field and serves in arrival order."""
    for policy, first in ((SchedulingPolicy.PRIORITY, "high"), (SchedulingPolicy.FCFS, "low")):
        e = engine(max_num_seqs=1, policy=policy)
        blocker = Request("blocker", prompt(1, 20), 20, 0.0, ignore_eos=True)
        low = Request("low", prompt(2, 20), 2, 0.001, ignore_eos=True, priority=5)
        high = Request("high", prompt(3, 20), 2, 0.002, ignore_eos=True, priority=-1)
        run_to_completion(e, [blocker, low, high])
        assert high.first_token_time is not None and low.first_token_time is not None
        assert min((high, low), key=lambda r: r.first_token_time or 0).request_id == first, policy


def test_priority_policy_preempts_the_lowest_priority_when_blocks_run_out() -> None:
    """vLLM V1 under --scheduling-policy priority: out of KV blocks, the running request with the
    largest (priority, arrival) is preempted, not the most recently admitted one."""
    e = engine(num_gpu_blocks=40, policy=SchedulingPolicy.PRIORITY)  # 624 tokens of KV
    low = Request("low", prompt(30, 200), 120, 0.0, ignore_eos=True, priority=5)
    mid = Request("mid", prompt(31, 200), 120, 0.0, ignore_eos=True, priority=0)
    high = Request("high", prompt(32, 200), 120, 0.0, ignore_eos=True, priority=-1)
    run_to_completion(e, [low, mid, high])  # admitted in that order; high arrives last
    assert e.counters.preemptions > 0
    assert high.num_preemptions == 0 and low.num_preemptions > 0
    assert all(r.finish_reason == "length" for r in (low, mid, high))


def test_max_num_seqs_limits_the_running_batch() -> None:
    e = engine(max_num_seqs=4)
    reqs = [Request(str(i), prompt(i, 30), 10, 0.0, ignore_eos=True) for i in range(10)]
    peak = []
    run_to_completion(
        e, reqs, lambda s: peak.append(e.num_running + len([x for x in s.events if x.finish_reason]))
    )
    assert max(peak) <= 4


def test_cache_salt_isolates_prefixes() -> None:
    e = engine()
    p = prompt(5, 400)
    a = Request("a", p, 2, 0.0, ignore_eos=True, cache_salt="tenant-a")
    b = Request("b", p, 2, 1.0, ignore_eos=True, cache_salt="tenant-b")
    c = Request("c", p, 2, 2.0, ignore_eos=True, cache_salt="tenant-a")
    run_to_completion(e, [a, b, c])
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 0, 384)


def test_decoded_blocks_are_cached_for_the_next_turn() -> None:
    """A follow-up prompt that contains the previous answer hits the blocks filled while decoding."""
    e = engine()
    p = prompt(8, 64)
    first = Request("t1", p, 48, 0.0, ignore_eos=True)
    run_to_completion(e, [first])
    follow = p + [tokenizer.token_id(w) for w in first.output_words] + prompt(9, 20)
    second = Request("t2", follow, 4, 5.0, ignore_eos=True)
    run_to_completion(e, [second])
    assert second.cached_tokens == (64 + 48 - 1) // 16 * 16


def test_calibration_is_within_tolerance_for_every_profile() -> None:
    from vllm_sim.calibrate import calibrate
    from vllm_sim.profiles import PROFILES

    for profile in PROFILES.values():
        checks = calibrate(profile)
        assert all(c.ok for c in checks), [(c.target.name, c.measured) for c in checks]


def test_prefill_backlog_counts_what_is_left_before_each_first_token() -> None:
    e = engine(max_num_batched_tokens=1024, max_num_seqs=1)
    a = Request("a", prompt(3, 4096), 4, 0.0, ignore_eos=True)
    b = Request("b", prompt(4, 2000), 4, 0.0, ignore_eos=True)
    e.add_request(a)
    e.add_request(b)
    assert e.prefill_backlog() == (0, a.prompt_len + b.prompt_len)  # nothing admitted yet
    e.step(0.0)  # a is admitted and its first 1,024-token chunk prefilled; b waits (one seat)
    assert e.prefill_backlog() == (a.prompt_len - 1024, b.prompt_len)
    while a.first_token_time is None:
        e.step(1.0)
    assert e.prefill_backlog() == (0, b.prompt_len)  # a decodes now: none of its prompt is left


def test_token_events_carry_the_time_their_step_produced_them() -> None:
    """The real-time loop plans the next step before a handler reads the tokens of the last one, so
    a handler that took the request's ``last_token_time`` stamped the first token a step late (the
    TTFT histogram read one decode step high under load). Each event carries its own time."""

    async def scenario() -> None:
        loop = EngineLoop(Engine(EngineConfig.from_profile(H100, seed=0)))
        runner = asyncio.create_task(loop.run())
        try:
            req = Request("r", tokenizer.encode("x " * 400), 4, loop.sim_now(), ignore_eos=True)
            queue = loop.submit(req)
            first = await queue.get()
            assert first.at == req.first_token_time
            assert req.last_token_time is not None and req.last_token_time > first.at  # moved on
            rest = [await queue.get() for _ in range(3)]
            times = [e.at for e in (first, *rest)]
            assert all(a < b for a, b in itertools.pairwise(times))
            assert rest[-1].at == req.last_token_time == req.finish_time
        finally:
            runner.cancel()

    asyncio.run(scenario())
