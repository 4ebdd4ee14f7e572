"""Drives one ``Engine`` in real time under asyncio.

Each step is scheduled to end ``duration / time_scale`` wall seconds after the previous one; the loop
sleeps until then and hands the step's tokens to the waiting request handlers. Simulated time is wall
time since start multiplied by ``time_scale``. Timer jitter is absorbed (the next sleep is shorter);
when Python falls more than ``MAX_DEBT_S`` behind, the schedule is re-anchored and the lost time
counted. ``vllm_sim_step_lag_seconds`` shows the worst lateness in the last 2 s; the counters
``vllm_sim_step_overrun_seconds_total`` / ``vllm_sim_step_busy_seconds_total`` give the share of time
the simulation lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from vllm_sim.engine import Engine
from vllm_sim.request import Request, TokenEvent

logger = logging.getLogger(__name__)
LAG_WINDOW_S = 2.0
MAX_DEBT_S = 0.002  # lateness (wall) the schedule absorbs before it is re-anchored and counted
INTERNAL_ERROR = "internal"  # event reason for requests failed by an engine fault (HTTP 500)


class EngineLoop:
    def __init__(
        self, engine: Engine, time_scale: float = 1.0, after_step: Callable[[], None] | None = None
    ) -> None:
        """``after_step``: called as each step ends (the KV-event publisher sends its events)."""
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.engine = engine
        self.after_step = after_step
        self.time_scale = time_scale
        self._queues: dict[str, asyncio.Queue[TokenEvent]] = {}
        self._wake = asyncio.Event()
        self._origin = asyncio.get_running_loop().time()
        self._lags: deque[tuple[float, float]] = deque()
        self.steps = 0
        # Prompt tokens the step in progress prefills: the engine's state moves at a step's start,
        # its tokens reach clients at its end, so until then this work is still ahead of them.
        self.step_prefill_tokens = 0
        self.total_lag_s = 0.0
        self.total_step_s = 0.0

    def sim_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._origin) * self.time_scale

    def to_wall(self, sim_seconds: float) -> float:
        return sim_seconds / self.time_scale

    def submit(self, req: Request) -> asyncio.Queue[TokenEvent]:
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[req.request_id] = queue
        self.engine.add_request(req)
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request whose client went away; its blocks return to the cache."""
        self._queues.pop(request_id, None)
        self.engine.abort(request_id, self.sim_now())

    def _fail_all(self) -> None:
        now = (asyncio.get_running_loop().time() - self._origin) * self.time_scale
        for rid, queue in list(self._queues.items()):
            req = self.engine.abort(rid, now)
            if req is not None:
                queue.put_nowait(TokenEvent(req, None, INTERNAL_ERROR, now))
        self._queues.clear()

    def step_lag(self) -> float:
        loop_now = asyncio.get_running_loop().time()
        while self._lags and self._lags[0][0] < loop_now - LAG_WINDOW_S:
            self._lags.popleft()
        return max((lag for _, lag in self._lags), default=0.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        sched_end: float | None = None
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                sched_end = None
            now = loop.time()
            if sched_end is None:
                start_wall = now
            elif now - sched_end > MAX_DEBT_S:
                # Too far behind to catch up by sleeping less: drop the debt and count it.
                self.total_lag_s += now - sched_end
                start_wall = now
            else:
                # Keep the schedule: a timer that fired a little late is made up by the next sleep,
                # so timer jitter never accumulates into simulated time.
                start_wall = sched_end
            try:
                result = self.engine.step((start_wall - self._origin) * self.time_scale)
            except Exception:
                # A bug must not hang clients: fail everything in flight and carry on empty.
                logger.exception("engine step failed; failing %d request(s)", len(self._queues))
                self._fail_all()
                continue
            if result is None:
                continue
            end_wall = start_wall + result.duration / self.time_scale
            delay = end_wall - loop.time()
            self.step_prefill_tokens = result.prefill_tokens
            try:
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)  # let handlers run even when behind
            finally:
                self.step_prefill_tokens = 0
            done = loop.time()
            self._lags.append((done, max(0.0, done - end_wall)))
            self.steps += 1
            self.total_step_s += result.duration / self.time_scale
            sched_end = end_wall
            if self.after_step is not None:
                self.after_step()
            if not self.engine.has_work():
                self.total_lag_s += max(0.0, done - end_wall)
            for event in result.events:
                rid = event.request.request_id
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(event)
                    if event.finish_reason is not None:
                        del self._queues[rid]
