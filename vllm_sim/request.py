"""What the engine core works on: its configuration, a request and its state, the events a step
produces, the engine's counters, and the waiting queue in either scheduling policy's order.
``vllm_sim.engine`` runs them."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from vllm_sim.profiles import Profile

FINISH_REASONS = ("stop", "length", "abort", "error")


class SchedulingPolicy(str, Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    profile: Profile
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    seed: int = 0

    @classmethod
    def from_profile(cls, profile: Profile, **overrides: object) -> EngineConfig:
        values: dict[str, object] = {
            "profile": profile,
            "num_gpu_blocks": profile.num_gpu_blocks,
            "max_num_seqs": profile.max_num_seqs,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "max_model_len": profile.max_model_len,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


class Status(Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclass(eq=False, slots=True)
class Request:
    """A request inside one engine. Times are in the engine's (simulated) seconds."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival: float
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    # Disaggregated decode: prompt tokens whose KV a prefill instance computed and this one received
    # (vLLM's "external computed tokens"); they are not prefilled here, unless a preemption lost them.
    remote_tokens: int = 0
    # Filled in by the engine.
    output_len: int = 0
    output_words: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt + generated ids
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks of ``tokens``
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0  # leading blocks already recorded in the prefix-cache index
    num_output: int = 0
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    status: Status = Status.WAITING
    seq: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request: Request
    word: str | None  # None when the request ends without a new token (abort)
    finish_reason: str | None
    # When it happened (a token: its step's end). The request's own ``last_token_time`` may have
    # moved on by the time a handler reads the event: the loop plans the next step first.
    at: float


@dataclass(frozen=True, slots=True)
class StepResult:
    start: float
    duration: float
    prefill_tokens: int
    decode_seqs: int
    events: list[TokenEvent]

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(slots=True)
class Counters:
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # tokens found there
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))


class WaitingQueue:
    """FCFS deque, or a list sorted on (priority, arrival, seq) under the priority policy."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.priority = policy is SchedulingPolicy.PRIORITY
        self._fifo: deque[Request] = deque()
        self._sorted: list[tuple[int, float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._sorted) if self.priority else len(self._fifo)

    def push(self, r: Request) -> None:
        if self.priority:
            bisect.insort(self._sorted, (r.priority, r.arrival, r.seq, r), key=lambda e: e[:3])
        else:
            self._fifo.append(r)

    def push_front(self, r: Request) -> None:
        # A preempted request goes back to the front (FCFS); under priority its key places it.
        if self.priority:
            self.push(r)
        else:
            self._fifo.appendleft(r)

    def peek(self) -> Request:
        return self._sorted[0][3] if self.priority else self._fifo[0]

    def pop(self) -> Request:
        return self._sorted.pop(0)[3] if self.priority else self._fifo.popleft()

    def remove(self, r: Request) -> None:
        if self.priority:
            self._sorted = [e for e in self._sorted if e[3] is not r]
        else:
            self._fifo.remove(r)
