"""One vLLM instance's engine core as a pure state machine on a caller-supplied clock.

``Engine.step(now)`` does what vLLM V1's scheduler and model runner do in one iteration: it schedules
running requests first (one token per decode, the next chunk of a partial prefill), preempting the most
recent request (FCFS) or the lowest-priority one when KV blocks run out; then, only if nothing was
preempted, it admits waiting requests while token budget, ``max_num_seqs`` and free blocks allow,
crediting prefix-cache hits at admission. It returns the step's duration from the profile's cost model
and the tokens produced at the step's end. The engine never sleeps or reads a clock, so the same code
runs under asyncio in real time (``vllm_sim.server``) and on a virtual clock (``vllm_sim.virtual``),
where the same seed and requests give identical results.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence

import mmh3

from vllm_sim import tokenizer
from vllm_sim.kv_cache import BlockPool, block_hashes
from vllm_sim.request import (
    Counters,
    EngineConfig,
    Request,
    SchedulingPolicy,
    Status,
    StepResult,
    TokenEvent,
    WaitingQueue,
)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.profile.block_size
        self.pool = BlockPool(config.num_gpu_blocks)
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.counters = Counters()
        self._seq = itertools.count()
        self.by_id: dict[str, Request] = {}

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.prompt_len == 0:
            raise ValueError("prompt must contain at least one token")
        req.seq = next(self._seq)
        req.tokens = list(req.prompt_ids)
        req.hashes = block_hashes(req.tokens, block_size=self.block_size, salt=req.cache_salt)
        req.output_len = self._output_len(req)
        req.output_words = tokenizer.output_words(self._request_seed(req), req.output_len)
        self.by_id[req.request_id] = req
        self.waiting.push(req)

    def _request_seed(self, req: Request) -> int:
        head = ",".join(map(str, req.prompt_ids[:32]))
        tail = ",".join(map(str, req.prompt_ids[-32:]))
        return mmh3.hash(f"{self.config.seed}|{req.prompt_len}|{head}|{tail}", signed=False)

    def _output_len(self, req: Request) -> int:
        if req.ignore_eos:
            return req.max_tokens
        # EOS position drawn from a log-normal around 128 tokens, as chat replies vary widely.
        rng = random.Random(self._request_seed(req) ^ 0x5EED)
        drawn = 1 + int(rng.lognormvariate(math.log(128), 0.8))
        return max(1, min(req.max_tokens, drawn))

    def abort(self, request_id: str, now: float) -> Request | None:
        req = self.by_id.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, now, "abort")
        return req

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def prefill_backlog(self) -> tuple[int, int]:
        """Prompt tokens still to prefill before their request's first token: (of the running
        requests, of the waiting ones). Waiting requests count whole (their cache hit is known only
        at admission). What a router's prefill-queue estimate tries to track; simulator-only."""
        running = waiting = 0
        for req in self.by_id.values():
            if req.first_token_time is not None:
                continue
            if req.status is Status.WAITING:
                waiting += req.prompt_len
            elif req.status is Status.RUNNING:
                running += max(0, req.prompt_len - req.num_computed)
        return running, waiting

    # -- scheduling -----------------------------------------------------------------------------
    def _victim(self) -> Request:
        if self.config.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival, r.seq))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.push_front(req)
        self.counters.preemptions += 1

    def step(self, now: float) -> StepResult | None:
        """Run one engine iteration starting at ``now``; None when there is nothing to do."""
        if not self.has_work():
            return None
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_for(req.num_computed + n) - len(req.blocks)
            while need > self.pool.num_free:
                victim = self._victim()
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            if need > 0:
                req.blocks.extend(self.pool.allocate(need))
            self._register_full_blocks(req, req.num_computed + n)
            scheduled[req] = n
            budget -= n
            i = self.running.index(req) + 1

        if not preempted:
            self._admit(scheduled, budget, now)
        if not scheduled:
            # Nothing fits (e.g. one prompt larger than the whole cache): drop the head request
            # rather than spin, as vLLM rejects prompts that can never be scheduled.
            head = self.waiting.pop()
            self._finish(head, now, "error")
            return StepResult(now, 0.0, 0, 0, [TokenEvent(head, None, "error", now)])
        return self._execute(scheduled, now)

    def _admit(self, scheduled: dict[Request, int], budget: int, now: float) -> None:
        cfg = self.config
        while len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            bs = self.block_size
            max_hit = (req.num_tokens - 1) // bs
            hit = self.pool.lookup(req.hashes, max_hit)
            computed = len(hit) * bs
            local_hit = computed
            if req.remote_tokens and not req.num_preemptions:
                # Whole blocks arrived from the prefiller; the last token is always computed here.
                remote = min(req.remote_tokens, req.num_tokens - 1) // bs * bs
                computed = max(computed, remote)
            n = min(req.num_tokens - computed, budget)
            need = self._blocks_for(computed + n) - len(hit)
            if need > self.pool.num_free_after_touch(hit):
                break
            self.waiting.pop()
            self.pool.touch(hit)
            req.blocks = hit + self.pool.allocate(need)
            req.num_computed = computed
            req.num_registered = len(hit)
            self.counters.prefix_queries += req.num_tokens
            self.counters.prefix_hits += local_hit
            if req.cached_tokens is None:
                req.cached_tokens = computed
            req.status = Status.RUNNING
            self.running.append(req)
            self._register_full_blocks(req, computed + n)
            scheduled[req] = n
            budget -= n

    def _execute(self, scheduled: dict[Request, int], now: float) -> StepResult:
        prefill = decode = context = 0
        attention = 0.0  # prefill tokens x the context each attends to (the quadratic part)
        for req, n in scheduled.items():
            if req.num_computed >= req.prompt_len and n == 1 and req.num_output > 0:
                decode += 1
            else:
                prefill += n
                attention += n * (req.num_computed + n / 2)
            context += req.num_computed + n
        duration = self.config.profile.step_time(prefill, decode, context, attention)
        end = now + duration
        events: list[TokenEvent] = []
        for req, n in scheduled.items():
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk: no token sampled yet
            word = req.output_words[req.num_output]
            req.num_output += 1
            req.tokens.append(tokenizer.token_id(word))
            if req.first_token_time is None:
                req.first_token_time = end
                self.counters.prompt_tokens += req.prompt_len
            req.last_token_time = end
            self.counters.generation_tokens += 1
            reason = None
            if req.num_output >= req.output_len:
                reason = "length" if req.num_output >= req.max_tokens else "stop"
                self.running.remove(req)
                self._finish(req, end, reason)
            events.append(TokenEvent(req, word, reason, end))
        return StepResult(now, duration, prefill, decode, events)

    def _blocks_for(self, tokens: int) -> int:
        return (tokens + self.block_size - 1) // self.block_size

    def _register_full_blocks(self, req: Request, upto: int) -> None:
        """Record in the prefix cache the full blocks of the first ``upto`` tokens, when a step is
        scheduled to compute them (vLLM V1 caches blocks at allocation): a request scheduled later
        in the same step (a copy of the prompt, each of a request's n completions) already hits."""
        bs = self.block_size
        full = upto // bs
        if full <= req.num_registered:
            return
        if len(req.hashes) < full:
            parent = req.hashes[-1] if req.hashes else None
            req.hashes.extend(
                block_hashes(req.tokens[: full * bs], len(req.hashes), parent, bs, req.cache_salt)
            )
        first = req.num_registered
        for b in range(first, full):
            self.pool.cache_block(req.blocks[b], req.hashes[b])
        if self.pool.events is not None:  # a publisher listens (vllm-sim --kv-events-port)
            parent = req.hashes[first - 1] if first else None
            self.pool.stored(req.hashes[first:full], parent, req.tokens[first * bs : full * bs], bs)
        req.num_registered = full

    def _finish(self, req: Request, now: float, reason: str) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.status = Status.FINISHED
        req.finish_time = now
        req.finish_reason = reason
        if reason != "abort":
            # vLLM counts a request in request_success_total when the engine finishes it; one its
            # client left is aborted from the front end and never counted (measured on vLLM 0.32 by
            # tests/real/test_twin.py), so the "abort" series stays at 0.
            self.counters.finished[reason] += 1
        self.by_id.pop(req.request_id, None)


def run_to_completion(
    engine: Engine,
    arrivals: Sequence[Request],
    on_step: Callable[[StepResult], None] | None = None,
) -> list[Request]:
    """Replay ``arrivals`` (sorted by ``arrival``) on a virtual clock until every request finishes."""
    pending = deque(sorted(arrivals, key=lambda r: r.arrival))
    now = 0.0
    delay = engine.config.profile.frontend_s
    while pending or engine.has_work():
        while pending and pending[0].arrival + delay <= now:
            engine.add_request(pending.popleft())
        result = engine.step(now)
        if result is None:
            now = max(now, pending[0].arrival + delay)
            continue
        if on_step is not None:
            on_step(result)
        now = result.end
    return list(arrivals)
