"""Virtual-time replay: kvgate's own decision service and N simulated vLLM engines in one process.

No HTTP and no sleeping: an event loop on a virtual clock feeds arrivals through the same
``DecisionService``, ``Registry``, prefix index and policies the sidecar runs (Redis replaced by an
in-process session map), one such core per gateway replica (``kvgate_bench.virtual_gateway``), and
each routed request into a ``vllm_sim`` engine. Engine load is "scraped" into each replica's registry
every ``scrape_interval`` simulated seconds, and finished requests are reported back to the replica
that routed them, as Nginx's log phase would. The same seed and requests give identical results.

Over 300 lines: ``replay`` is one timeline (arrivals, scrapes, engine steps, reports) whose
closures share its clock and state; split, each part would need all of it.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvgate.public import (
    Config,
    Features,
    Outcome,
    PolicyName,
    Queued,
    QueueFull,
    QueueTimeout,
    Reason,
    Registry,
    Routed,
    SessionAction,
    SloShed,
    extract,
)

from kvgate_bench.report import DEFAULT_SLO, Sample, Slo, Summary, summarize
from kvgate_bench.virtual_gateway import Gateways, Spread
from kvgate_bench.workloads import BenchRequest
from vllm_sim.engine import Engine
from vllm_sim.kv_cache import KvEvent
from vllm_sim.kv_publisher import encode_batch
from vllm_sim.profiles import Profile
from vllm_sim.request import EngineConfig, Request, SchedulingPolicy, TokenEvent

# Between two scrapes of the engines' load, in simulated seconds: the replay's, and the live sidecar's
# in the live benchmarks (``targets.start_target`` scales it by the time-scale), so both see load as often.
SCRAPE_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class Result:
    rid: int
    backend: str
    arrival: float
    ttft: float
    e2e: float
    itl: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reason: str
    predicted_tokens: int = 0  # cached prompt tokens the sidecar's index predicted on its backend
    replica: int = 0  # the gateway replica that routed it
    predicted_ttft: float | None = None  # the sidecar's expected seconds to its first token


class Sent(NamedTuple):
    """A request handed to an engine: whose it is, and where its outcome reports go."""

    rid: int
    decision: str
    backend: str
    reason: str
    replica: int


@dataclass
class Run:
    target: str
    backends: int
    speedup: float
    results: list[Result] = field(default_factory=list)
    bound_violations: int = 0  # non-session decisions that picked a node above its c x fair share
    rejected: int = 0  # refused: the gateway queue full or waited too long, an objective shed: 429s
    queue_waits: list[float] = field(default_factory=list)  # seconds each queued request waited
    wall_s: float = 0.0


def features_for(requests: Sequence[BenchRequest]) -> list[Features]:
    """Features as Nginx would compute them from each request's body (computed once per workload)."""
    return [extract(r.body(), r.headers) for r in requests]


def replay(
    requests: Sequence[BenchRequest],
    feats: Sequence[Features],
    policy: PolicyName,
    backends: int,
    profile: Profile,
    speedup: float = 1.0,
    scrape_interval: float = SCRAPE_INTERVAL_S,
    report_delay: float = 0.0,
    seed: int = 0,
    load_factor: float = 1.25,
    progress: Callable[[int, int], None] | None = None,
    routing: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    labels: Sequence[dict[str, str]] | None = None,
    observe: Callable[[float, Registry, Sequence[Engine], Sequence[int]], None] | None = None,
    frontend_per_token_s: float = 0.0,
    scrape_phase: float = 0.0,
    index: str = "approximate",
    replicas: int = 1,
    spread: Spread = Spread.RANDOM,
    share_load: bool = True,
) -> Run:
    """``extra``: more config sections (queue, pools, tokens); ``labels``: each backend's labels;
    ``frontend_per_token_s``: frontend time per prompt token on top of the profile's fixed frontend
    time (tokenization: a long prompt reaches the engine later than a short one sent with it);
    ``observe``: called at every scrape with the time, the sidecar's registry, the engines and the
    prompt tokens each engine's step in progress prefills (to set the load view against the truth);
    ``scrape_phase``: when the first scrape happens (live, the scrape clock runs independently of the
    arrivals, so any phase within ``scrape_interval`` is as likely); ``index``: "exact" gives the
    sidecar each prompt's token ids and every engine's KV events as each step ends (as a publisher
    would send them), "approximate" neither; ``replicas``: gateway replicas routing the same engines,
    the client's requests spread over them by ``spread`` (``kvgate_bench.virtual_gateway``), sharing
    their in-flight load unless ``share_load`` is False."""
    started = time.perf_counter()
    cfg = Config.from_mapping(
        {
            "redis": {"url": None},
            "routing": {"policy": policy.value, "load_factor": load_factor, **(routing or {})},
            "backends": [
                {"id": f"sim-{i}", "url": f"http://sim-{i}:8000", "labels": (labels or [{}] * backends)[i]}
                for i in range(backends)
            ],
            **(extra or {}),
        }
    )
    exact = index == "exact"
    clock = [0.0]  # virtual time, for the gateway queues' waits
    models = frozenset({requests[0].model}) if requests else frozenset()
    gw = Gateways(
        cfg, replicas, spread, seed, scrape_phase, scrape_interval, lambda: clock[0], models, share_load
    )

    def tell(k: int, outcome: Outcome) -> None:
        """An outcome reaches replica ``k``: at once, or ``report_delay`` later (Nginx batches its
        reports and flushes them every 100 ms)."""
        if report_delay <= 0:
            gw.report(k, outcome)
        else:
            heapq.heappush(events, (clock[0] + report_delay, 0, next(seq), "report", (k, outcome)))

    # Backends schedule by the priority the gateway forwards when it forwards one (vLLM started with
    # --scheduling-policy priority); else first come, first served.
    forward = cfg.queue.forward_priority
    policy_of_engines = SchedulingPolicy.PRIORITY if forward else SchedulingPolicy.FCFS
    engines = [
        Engine(EngineConfig.from_profile(profile, seed=seed + i, policy=policy_of_engines))
        for i in range(backends)
    ]
    transfer_tokens_per_s = 200_000.0  # vllm-sim's default KV transfer speed (disaggregation)
    legs: dict[str, tuple[BenchRequest, Routed, float]] = {}  # prefill leg id -> its request
    ids = gw.ids
    kv_seq = [0] * backends
    kv_pending: list[list[KvEvent]] = [[] for _ in range(backends)]
    if exact:
        for e in engines:
            e.pool.take_events()  # from now on the pools record their events
    busy = [False] * backends
    pending: list[list[TokenEvent]] = [[] for _ in range(backends)]
    in_step = [0] * backends  # prompt tokens of each engine's step in progress
    meta: dict[str, Sent] = {}  # engine request id -> what was sent
    awaiting_first: set[str] = set()  # requests whose first token Nginx has not reported yet
    predicted: dict[int, tuple[int, float | None]] = {}  # request -> (held tokens, expected TTFT)
    run = Run(policy.value, backends, speedup)
    seq = itertools.count()
    events: list[tuple[float, int, int, str, Any]] = []
    for r in requests:
        heapq.heappush(events, (r.arrival / speedup, 1, next(seq), "arrive", r))
    for k, phase in enumerate(gw.phases):
        heapq.heappush(events, (phase, 0, next(seq), "scrape", k))
        if gw.share_s:
            heapq.heappush(events, (gw.share_phases[k], 0, next(seq), "share", k))
    frontend = profile.frontend_s
    remaining = len(requests)
    done = 0

    def decode_leg(ev: TokenEvent, t: float) -> None:
        """A prefill leg ended: its backend is done with the prefill, the decoder reads the KV."""
        r, routed, arrived = legs.pop(ev.request.request_id)
        k = meta.pop(ev.request.request_id).replica
        tell(k, Outcome.first(routed.decision_id, routed.prefill[0].id))
        backend = routed.candidates[0].id
        req = Request(
            f"r{r.rid}",
            r.prompt_ids(),
            r.output_tokens,
            arrived,
            ignore_eos=True,
            remote_tokens=r.prompt_tokens,
        )
        meta[req.request_id] = Sent(r.rid, routed.decision_id, backend, routed.label, k)
        delay = frontend + r.prompt_tokens / transfer_tokens_per_s
        heapq.heappush(events, (t + delay, 2, next(seq), "enqueue", (ids.index(backend), req)))

    def finish(ev: TokenEvent) -> None:
        nonlocal done
        req = ev.request
        sent = meta.pop(req.request_id)
        first = req.first_token_time if req.first_token_time is not None else req.finish_time or req.arrival
        end = req.finish_time if req.finish_time is not None else first
        itl = (end - first) / (req.num_output - 1) if req.num_output > 1 else None
        held, expected = predicted.pop(sent.rid, (0, None))
        run.results.append(
            Result(
                sent.rid,
                sent.backend,
                req.arrival,
                first - req.arrival,
                end - req.arrival,
                itl,
                req.prompt_len,
                req.cached_tokens or 0,
                req.num_output,
                sent.reason,
                held,
                sent.replica,
                expected,
            )
        )
        ttft, e2e, wrote, cached = first - req.arrival, end - req.arrival, req.num_output, req.cached_tokens
        outcome = Outcome.end(  # with the usage Nginx reads (the fair order corrects charges by it)
            sent.decision, sent.backend, 200, True, ttft, e2e, completion_tokens=wrote, cached_tokens=cached
        )
        tell(sent.replica, outcome)
        done += 1
        if progress is not None and (done % 200 == 0 or done == len(requests)):
            progress(done, len(requests))

    waiting: dict[tuple[int, str], tuple[BenchRequest, float]] = {}  # (replica, decision) -> request

    def send(r: BenchRequest, routed: Routed, arrived: float, t: float, k: int) -> None:
        priority = routed.priority if forward else 0
        if routed.prefill:  # disaggregated: a one-token prefill leg first (decode_leg follows it)
            backend = routed.prefill[0].id
            req = Request(f"p{r.rid}", r.prompt_ids(), 1, arrived, ignore_eos=True, priority=priority)
            legs[req.request_id] = (r, routed, arrived)
        else:
            backend = routed.candidates[0].id
            # The engine request keeps the client's arrival: a wait in the gateway queue counts in TTFT.
            req = Request(
                f"r{r.rid}", r.prompt_ids(), r.output_tokens, arrived, ignore_eos=True, priority=priority
            )
            awaiting_first.add(req.request_id)
        predicted[r.rid] = (routed.reuse[1], routed.predicted_ttft_s)
        meta[req.request_id] = Sent(r.rid, routed.decision_id, backend, routed.label, k)
        delay = frontend + r.prompt_tokens * frontend_per_token_s
        heapq.heappush(events, (t + delay, 2, next(seq), "enqueue", (ids.index(backend), req)))

    def release(t: float) -> None:
        """What Nginx would see when a gateway queue dispatches: each waiting request's answer."""
        nonlocal done
        if not waiting:
            return
        for k, did, result in list(gw.dispatch()):
            r, arrived = waiting.pop((k, did))
            run.queue_waits.append(t - arrived)
            if isinstance(result, QueueTimeout | SloShed) or not result.decision.candidates:
                run.rejected += 1  # a 429 (or a 503) to the client
                done += 1
                continue
            send(r, result, arrived, t, k)

    while events:
        t, _, _, kind, payload = heapq.heappop(events)
        clock[0] = t
        if kind == "arrive":
            r = payload
            f = feats[r.rid]
            if exact:
                f = dataclasses.replace(f, token_ids=tuple(r.prompt_ids()))
            k = gw.pick()
            snap = gw.replicas[k].registry.snapshot(f.model)
            lim = snap.limits
            # Before this decision counts itself (a prefix or ttft decision: against the holder bound).
            admits, holds = (
                snap.bound_admits(),
                snap.bound_admits(max(lim.load_factor, lim.holder_load_factor)),
            )
            under = {n for n in snap.nodes if admits(n)}
            under_holder = {n for n in snap.nodes if holds(n)}
            remaining -= 1
            try:
                answer = gw.decide(k, f)
            except (QueueFull, SloShed):
                run.rejected += 1
                done += 1
                continue
            if isinstance(answer, Queued):
                waiting[(k, answer.decision_id)] = (r, t)
                if answer.waiting.ready > t:  # gathering (queue.gather_ms): the queue looks again then
                    heapq.heappush(events, (answer.waiting.ready, 0, next(seq), "gathered", None))
                continue
            primary = answer.candidates[0].id
            allowed = under_holder if answer.decision.reason in (Reason.PREFIX, Reason.TTFT) else under
            if answer.decision.session is not SessionAction.KEEP and under and primary not in allowed:
                run.bound_violations += 1
            send(r, answer, t, t, k)
        elif kind == "enqueue":
            i, queued = payload
            engines[i].add_request(queued)
            if not busy[i]:
                busy[i] = True
                heapq.heappush(events, (t, 3, next(seq), "step", i))
        elif kind == "step":
            i = payload
            if kv_pending[i]:  # the events of the step that ends now reach the sidecars
                # Through the wire format: the publisher's encoding, the subscriber's decoder.
                gw.publish(ids[i], kv_seq[i], encode_batch(kv_pending[i]))
                kv_seq[i] += 1
                kv_pending[i] = []
            for ev in pending[i]:
                name = ev.request.request_id
                if name in awaiting_first:
                    # What Nginx's body filter reports when the stream's first byte passes.
                    awaiting_first.discard(name)
                    sent = meta[name]
                    tell(sent.replica, Outcome.first(sent.decision, sent.backend))
                if ev.finish_reason is not None and name in legs:
                    decode_leg(ev, t)
                elif ev.finish_reason is not None:
                    finish(ev)
            if pending[i]:
                release(t)
            pending[i] = []
            result = engines[i].step(t)
            if result is None:
                busy[i] = False
                in_step[i] = 0
                continue
            pending[i] = result.events
            in_step[i] = result.prefill_tokens
            if exact:
                kv_pending[i] = engines[i].pool.take_events()
            heapq.heappush(events, (result.end, 3, next(seq), "step", i))
        elif kind == "report":
            gw.report(*payload)
            release(t)
        elif kind == "gathered":
            release(t)
        elif kind == "share":
            gw.share(payload, t)
            if remaining or any(busy) or waiting:
                heapq.heappush(events, (t + gw.share_s, 0, next(seq), "share", payload))
        elif kind == "scrape":
            k = payload
            gw.scrape(k, engines, time.monotonic())
            if observe is not None and k == 0:
                observe(t, gw.replicas[0].registry, engines, in_step)
            release(t)
            if remaining or any(busy) or waiting:
                heapq.heappush(events, (t + scrape_interval, 0, next(seq), "scrape", k))
    run.wall_s = time.perf_counter() - started
    return run


def summarize_run(
    name: str, run: Run, ideal: float, zero_queue: float, speedup: float, slo: Slo = DEFAULT_SLO
) -> Summary:
    """A replay's figures in the form every report uses (the requests the gateway refused count as
    shed)."""
    samples = [
        Sample(r.ttft, r.itl, r.e2e, r.output_tokens, True, r.backend, r.prompt_tokens, r.cached_tokens)
        for r in run.results
    ]
    prefill: dict[str, float] = {}
    for r in run.results:
        prefill[r.backend] = prefill.get(r.backend, 0.0) + r.prompt_tokens - r.cached_tokens
    total = sum(r.prompt_tokens for r in run.results)
    hit = sum(r.cached_tokens for r in run.results) / total if total else 0.0
    makespan = max((r.arrival + r.e2e for r in run.results), default=0.0)
    return summarize(
        name,
        samples,
        makespan,
        hit,
        prefill,
        slo,
        run.rejected,
        ideal_hit_rate=ideal,
        zero_queue_ttft=zero_queue,
        speedup=speedup,
        note=f"{run.bound_violations} bound violations, {run.wall_s:.0f}s wall",
    )
