"""The server's side of the scheduler: jobs in from the event loop, token events back to it.

One worker thread owns the engine's scheduler (runtime/scheduler.py) and steps it while there is work;
every step decodes one token for every running request as one executor batch and prefills chunks of
newcomers' prompts, so all clients progress together. Each step's events cross to the event loop with
`call_soon_threadsafe`. A cancelled job (its client left) frees its KV pages at once, or at the end of
the step running at that moment.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from imp_runtime.engine import Constraint, Engine, RequestError, TokenEvent
from imp_runtime.sampler import SamplingParams
from imp_runtime.scheduler import Request, StepOutput
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
    generated: int = 0                       # tokens produced so far
    request: Request | None = None           # the scheduler's; None when refused at submission
    t_last: float = 0.0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (usage's cached_tokens)."""
        return self.request.cached_tokens if self.request else 0

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
    def __init__(self, engine: Engine, metrics: Metrics, max_running: int | None = None, page_size: int = 16,
                 step_tokens: int | None = None):
        # page_size is the executor's now (engine.executor.page_size); the argument is kept for callers
        self.engine = engine
        self.metrics = metrics
        self.scheduler = engine.scheduler
        cfg = self.scheduler.config
        cfg.max_running = cfg.running_limit(engine.executor, max_running)
        # every running request decodes each step, whatever the budget; the rest of it goes to prefill
        cfg.step_tokens = max(step_tokens or cfg.step_tokens, cfg.max_running + 1)
        self.jobs: dict[int, Job] = {}            # id(request) -> job, owned by the worker
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._work, name="imp-generation", daemon=True)
        self.thread.start()
        metrics.kv_pages.set_function(self.kv_pages_in_use)

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.queued()

    # --- called from the event loop ---

    def submit(self, prompt_ids: list[int], params: SamplingParams, constraint: Constraint | None,
               t_arrival: float | None = None) -> Job:
        job = Job(list(prompt_ids), params, constraint, asyncio.get_running_loop(),
                  t_arrival if t_arrival is not None else time.perf_counter())
        with self.cond:        # registered before the worker can see the request, so no event is lost
            try:
                job.request = self.engine.submit(job.prompt_ids, params, constraint)
            except RequestError as e:
                job.events.put_nowait(APIError(400, str(e)))
                return job
            self.jobs[id(job.request)] = job
            self._gauges()
            self.cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job and free its KV pages."""
        with self.cond:
            if job.cancelled or job.done or job.request is None or job.request.done:
                return
            job.cancelled = True
            self.metrics.cancelled.inc()
        self.scheduler.cancel(job.request)
        with self.cond:
            self.jobs.pop(id(job.request), None)
            self._gauges()
            self.cond.notify()

    def close(self, wait_s: float = 0.25) -> None:
        """Stop the worker: it cancels what is left (freeing its pages) once its current step ends. That
        step may be a prefill chunk that runs for seconds on a CPU, and every client has had its answer
        by now (Service.end_all), so a shutdown waits wait_s for it, not for the chunk: the worker is a
        daemon thread, and the process may exit while it computes a result nobody will read."""
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=wait_s)
        if self.thread.is_alive():
            log.info("shutdown: not waiting for the generation step in progress")

    def kv_pages_in_use(self) -> int:
        return self.engine.blocks.in_use()

    # --- the worker thread ---

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.scheduler.queued()))
        self.metrics.running.set(len(self.scheduler.running))

    def _work(self) -> None:
        while True:
            with self.cond:
                while not (self.scheduler.has_work() or self.stopped):
                    self.cond.wait()
                if self.stopped:
                    for job in list(self.jobs.values()):
                        self.scheduler.cancel(job.request)
                    return
            try:
                outputs = self.scheduler.step()
            except Exception as e:  # noqa: BLE001 - a bug, not the clients' fault: tell them, keep serving
                log.exception("scheduler step failed")
                outputs = self._fail_all(e)
            with self.cond:
                self._flush(self._account(outputs))
                self._gauges()

    def _fail_all(self, error: Exception) -> list[StepOutput]:
        outs = []
        for job in list(self.jobs.values()):
            self.scheduler.cancel(job.request)
            outs.append(StepOutput(job.request, error=error))
        return outs

    def _account(self, outputs: list[StepOutput]) -> list[tuple[Job, object]]:
        """A step's outputs: the (job, item) each live client gets, and the step's metrics in one go (the
        tokens of a step arrive together: one clock reading, one histogram update)."""
        now = time.perf_counter()
        items, first, gaps = [], [], []
        for out in outputs:
            job = self.jobs.get(id(out.request))
            if job is None or job.cancelled:
                continue
            if out.error is not None:
                e = out.error
                if not isinstance(e, RequestError):
                    log.error("generation failed", exc_info=e)
                self.jobs.pop(id(out.request), None)
                items.append((job, APIError(400, str(e)) if isinstance(e, RequestError)
                              else APIError(500, f"generation failed: {type(e).__name__}: {e}")))
                continue
            if job.generated == 0:
                first.append(now - job.t_arrival)
                self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            else:
                gaps.append(now - job.t_last)
            job.t_last = now
            job.generated += 1
            if out.event.finish_reason:
                self.jobs.pop(id(out.request), None)
            items.append((job, out.event))
        if first or gaps:
            self.metrics.ttft.observe(first)
            self.metrics.itl.observe(gaps)
            self.metrics.generation_tokens.inc(len(first) + len(gaps))
        return items

    def _flush(self, batch: list) -> None:
        """Hand a step's events to their event loops: one call_soon_threadsafe per loop, not per token (each
        call writes the loop's wake-up pipe; 64 a step cost the step time the GPU then waits for)."""
        by_loop: dict = {}
        for job, item in batch:
            by_loop.setdefault(job.loop, []).append((job, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # the event loop is gone (server shutting down)
                for job, _ in items:
                    job.cancelled = True
                    self.scheduler.cancel(job.request)


def _put_all(items: list) -> None:
    for job, item in items:
        job.events.put_nowait(item)
