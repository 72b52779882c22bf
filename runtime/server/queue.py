"""A fair queue of generations, run off the event loop.

One worker thread owns the engine. Requests wait in FIFO order for one of `max_running` slots. Each
turn the worker runs ONE decode step for every running generation together (continuous batching:
`Engine.decode_batch`, one executor batch, so on the GPU one graph replay serves them all), then
prefills the requests that just got a slot; every running generation gets one token per turn, so all
clients make progress and none starves. Events cross to the event loop with `call_soon_threadsafe`.
A cancelled job (its client left) is retired on the worker's next turn, which frees its KV cache.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from imp_runtime.engine import Constraint, Engine, Generation, RequestError, TokenEvent
from imp_runtime.sampler import SamplingParams
from imp_runtime.server.errors import APIError
from imp_runtime.server.metrics import Metrics

log = logging.getLogger("imp.server")


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None
    loop: asyncio.AbstractEventLoop
    t_arrival: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    done: bool = False                       # the consumer has seen the last event (or the error)
    generated: int = 0                       # tokens produced so far (their KV is held)
    generation: Generation | None = None
    t_last: float = 0.0

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """Token events as the worker produces them; raises the APIError a failed generation gave."""
        while True:
            item = await self.events.get()
            if isinstance(item, Exception):
                self.done = True
                raise item
            if item.finish_reason:
                self.done = True
            yield item
            if item.finish_reason:
                return


class FairQueue:
    def __init__(self, engine: Engine, metrics: Metrics, max_running: int = 16, page_size: int = 16):
        self.engine = engine
        self.metrics = metrics
        self.max_running = max_running
        self.page_size = page_size
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._work, name="imp-generation", daemon=True)
        self.thread.start()
        metrics.kv_pages.set_function(self.kv_pages_in_use)

    # --- called from the event loop ---

    def submit(self, prompt_ids: list[int], params: SamplingParams, constraint: Constraint | None,
               t_arrival: float | None = None) -> Job:
        job = Job(list(prompt_ids), params, constraint, asyncio.get_running_loop(),
                  t_arrival if t_arrival is not None else time.perf_counter())
        with self.cond:
            self.waiting.append(job)
            self._gauges()
            self.cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job; if it is running, the worker frees its KV next turn."""
        with self.cond:
            if job.cancelled or job.done:
                return
            job.cancelled = True
            self.metrics.cancelled.inc()
            if job in self.waiting:
                self.waiting.remove(job)
                self._gauges()
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=5)

    def kv_pages_in_use(self) -> int:
        with self.cond:
            return sum(-(-(len(j.prompt_ids) + j.generated) // self.page_size) for j in self.running if j.generation)

    # --- the worker thread ---

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.running.set(len(self.running))

    def _work(self) -> None:
        while True:
            with self.cond:
                while not (self.waiting or self.running or self.stopped):
                    self.cond.wait()
                if self.stopped:
                    for job in self.running:
                        self._close(job)
                    return
                while self.waiting and len(self.running) < self.max_running:
                    self.running.append(self.waiting.popleft())
                self._gauges()
                turn = list(self.running)
            self._turn(turn)

    def _turn(self, turn: list[Job]) -> None:
        for job in turn:
            if job.cancelled:
                self._retire(job)
        live = [j for j in turn if not j.cancelled]
        stepping = [j for j in live if j.generation is not None]
        joining = [j for j in live if j.generation is None]      # decided now: retiring clears .generation
        if stepping:
            try:
                self.engine.decode_batch([j.generation for j in stepping])
            except Exception as e:  # noqa: BLE001 - a bug, not the clients' fault: tell them, keep serving
                log.exception("decode step failed")
                for job in stepping:
                    self._fail(job, APIError(500, f"generation failed: {type(e).__name__}: {e}"))
                stepping = []
        for job in stepping:
            self._emit(job)
        for job in joining:
            try:
                job.generation = self.engine.start(job.prompt_ids, job.params, job.constraint)
            except RequestError as e:
                self._fail(job, APIError(400, str(e)))
                continue
            except Exception as e:  # noqa: BLE001
                log.exception("prefill failed")
                self._fail(job, APIError(500, f"generation failed: {type(e).__name__}: {e}"))
                continue
            self._emit(job)

    def _emit(self, job: Job) -> None:
        try:
            ev = job.generation.next_event()
        except Exception as e:  # noqa: BLE001 - e.g. a constraint that cannot continue
            log.exception("sampling failed")
            self._fail(job, APIError(500, f"generation failed: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        if job.generated == 0:
            self.metrics.ttft.observe(now - job.t_arrival)
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        else:
            self.metrics.itl.observe(now - job.t_last)
        job.t_last = now
        job.generated += 1
        self.metrics.generation_tokens.inc()
        self._deliver(job, ev)
        if ev.finish_reason:
            self._retire(job)

    def _fail(self, job: Job, error: APIError) -> None:
        self._deliver(job, error)
        self._retire(job)

    def _deliver(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:       # the event loop is gone (server shutting down)
            job.cancelled = True

    def _close(self, job: Job) -> None:
        if job.generation is not None:
            job.generation.close()     # frees the sequence's KV cache
            job.generation = None

    def _retire(self, job: Job) -> None:
        self._close(job)
        with self.cond:
            if job in self.running:
                self.running.remove(job)
            self._gauges()
