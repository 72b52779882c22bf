"""The scheduler: which requests advance in each step, and by how many tokens.

A step is one decode batch, then prefill chunks, within a token budget (a decode row costs one token,
a prefill chunk its length):
1. every running request whose KV is complete decodes one token, all in ONE executor batch;
2. running requests still prefilling (a long prompt goes in chunks, interleaved with everyone's
   decoding) take the next chunk, oldest first;
3. waiting requests are admitted in arrival order (FIFO: when the head does not fit, the rest wait
   behind it), each starting after the longest prefix of its prompt found in the prefix cache.
With `mixed` on (an executor whose prefill launches can carry decode rows, the GPU), the step's prefill chunks
(up to the executor's max_segments sequences) go into the decode step's call: one pass over the weights for the
decode rows and every chunk, instead of a decode step plus a prefill call per chunk.
Pages come from the block manager as positions need them. When a running request needs a page and none
is left, the most recently admitted request is preempted by recompute: its pages go back (the full ones
stay in the prefix cache, so recomputing them is usually free), it returns to the head of the queue,
and when readmitted it prefills its prompt and the tokens it already produced and goes on as if never
stopped. A request that could not fit even alone is refused when submitted.

With `pipeline` on (an executor whose decode runs asynchronously, the GPU), a step launches its decode
before it does the host work on the previous step's tokens, so that work (detokenizing, stop strings,
events, and the caller's hand-off after `step` returns) runs while the device computes:
  step k: collect decode N -> record its tokens (the cheap half: end-of-sequence and token-budget
          finishes, whose requests give their pages back) -> schedule and launch decode N+1 -> describe
          decode N's tokens (text, stop strings, events) -> prefill chunks -> return decode N's events.
A request that a stop string ends while decode N+1 is in flight has one extra position decoded: its pages
go back at once (the in-flight step writes only into its last, partial page, which no prefix-cache entry
names, and any later use of that page is queued behind the step), and the extra token is dropped when the
step is collected. A step in which a running request samples on the host (logprobs, penalties,
constraints: its next token needs its logits processed first) runs serially. Either way each request
gets the same tokens and events. IMP_PIPELINE=0 in the environment turns pipelining off (to compare).

With `ahead` on as well (an executor that feeds a row the token the previous step sampled for its sequence
without the host reading it: StepRow.token None, `feeds_sampled`), the device never waits for the host between
steps: decode N+1 is scheduled and launched while decode N still runs, before N is collected, its rows feeding
N's tokens on the device; then N is collected, recorded and described. Positions and token budgets count the
tokens in flight (Request.ahead, Request.sampling); a request that N's token ends (a stop token, a stop string)
has one more row in N+1, dropped when N+1 is collected, as above. A step that could need a preemption (fewer
free pages than running requests) or has a host-sampled request collects first, as without `ahead`.
IMP_AHEAD=0 turns it off.

One thread steps the scheduler; `submit` and `cancel` may be called from any thread.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from imp_runtime.executor import PrefillChunk, StepRow
from imp_runtime.kv_blocks import BlockManager, BlockTable

if TYPE_CHECKING:
    from imp_runtime.engine import Generation, TokenEvent


class RequestTooLarge(ValueError):
    """The request cannot fit in the KV pool even alone."""


@dataclass
class SchedulerConfig:
    max_running: int             # requests holding an executor slot at once (at most the executor's max_batch)
    step_tokens: int             # budget of one step: one token per decode row plus prefill chunk tokens
    prefill_chunk: int           # most tokens one prefill call takes
    pipeline: bool = False       # launch each decode before the host work on the previous one's tokens
    mixed: bool = False          # the step's prefill chunks ride in its decode launch (one mixed step)
    ahead: bool = False          # (pipelined) launch each decode before collecting the previous one

    @staticmethod
    def running_limit(executor, max_running: int | None) -> int:
        """Requests decoding at once: as asked (None: all the executor's batch can take), at most its max_batch."""
        return min(max_running or executor.max_batch, executor.max_batch)

    @classmethod
    def for_executor(cls, executor, max_running: int | None = None) -> "SchedulerConfig":
        running = cls.running_limit(executor, max_running)
        pipeline = getattr(executor, "async_decode", False) and os.environ.get("IMP_PIPELINE") != "0"
        return cls(running, max(executor.prefill_chunk, running), executor.prefill_chunk, pipeline=pipeline,
                   mixed=getattr(executor, "mixed_steps", False) and os.environ.get("IMP_MIXED") != "0",
                   ahead=pipeline and getattr(executor, "feeds_sampled", False) and os.environ.get("IMP_AHEAD") != "0")


@dataclass(eq=False)
class Request:
    gen: "Generation"            # the host side: sampling, stop strings, detokenizing
    table: BlockTable = field(default_factory=BlockTable)
    sid: int | None = None       # the executor's slot while running
    penalty_sid: int | None = None   # the sid whose device penalty state was written (executor.init_penalties)
    pages_sent: int = 0          # how many of table.pages the executor has been told about
    computed: int = 0            # positions whose KV is written
    ahead: int = 0               # positions the steps in flight write (decode rows, prefill chunks)
    sampling: int = 0            # tokens the steps in flight sample for it
    cached_tokens: int = 0       # prompt tokens whose KV came from the prefix cache (first admission)
    admitted: bool = False
    preemptions: int = 0
    cancelled: bool = False
    done: bool = False           # finished, failed or cancelled; its pages are back


@dataclass
class StepOutput:
    request: Request
    event: "TokenEvent | None" = None
    error: Exception | None = None     # the request ended with this error (its pages are back)


@dataclass
class _InFlight:
    """A decode step launched by the previous pipelined step and not collected yet."""
    handle: object               # the executor's, for decode_collect
    rows: list[Request]
    chunks: list[tuple[Request, int]] = field(default_factory=list)   # prefill chunks riding in the step


@dataclass
class StepTimes:
    """Where the stepping thread's time goes (seconds, summed over steps): the executor's decode and prefill
    calls (launches and the wait for the GPU) and everything else of a step (deciding, sampling on the host,
    detokenizing, stop strings), of which `hidden_s` ran while a pipelined decode was on the device. With
    IMP_STEP_STATS=N set, a log line every N steps. (In an ahead step all host work runs while the device computes.)"""
    steps: int = 0
    mixed_steps: int = 0         # decode steps that carried a prefill chunk
    ahead_steps: int = 0         # steps launched before the previous one was collected
    first_on_device: int = 0     # prompt-ending chunks whose first token such a step sampled
    decode_rows: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    hidden_s: float = 0.0

    def line(self) -> str:
        n = max(self.steps, 1)
        host = self.total_s - self.decode_s - self.prefill_s
        return (f"{self.steps} steps ({self.mixed_steps} mixed, {self.ahead_steps} ahead), {self.decode_rows / n:.1f} decode rows "
                f"a step: per step {1e3 * self.total_s / n:.2f} ms "
                f"= decode {1e3 * self.decode_s / n:.2f} + prefill {1e3 * self.prefill_s / n:.2f} + host {1e3 * host / n:.2f} "
                f"(of which {1e3 * self.hidden_s / n:.2f} while the device decodes)")


def _chunk_tokens(result) -> list[int | None]:
    """A step result's chunks' sampled first tokens (None each where the executor sampled none)."""
    return result.chunk_tokens or [None] * len(result.chunk_logits)


_log = logging.getLogger("imp.scheduler")
_STATS_EVERY = int(os.environ.get("IMP_STEP_STATS", "0") or 0)
_TRACE_PATH = os.environ.get("IMP_STEP_TRACE") or None


class StepTrace:
    """IMP_STEP_TRACE=FILE: a line a step (start and end on the monotonic clock in seconds, decode rows and prefill
    tokens launched, requests running and waiting), to see where a served load leaves the device idle
    (scripts/step_trace.py reads it)."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)   # noqa: SIM115 - line-buffered, open for the process's life
        self.rows = self.tokens = 0

    def write(self, t0: float, t1: float, running: int, waiting: int) -> None:
        self.file.write(f"{t0:.6f} {t1:.6f} {self.rows} {self.tokens} {running} {waiting}\n")
        self.rows = self.tokens = 0


def _open_trace(path: str | None) -> StepTrace | None:
    if not path:
        return None
    try:
        return StepTrace(path)
    except OSError as e:            # a diagnostic must not stop the server: say so and run without it
        _log.warning("IMP_STEP_TRACE=%s cannot be written (%s): no step trace", path, e.strerror or e)
        return None


class Scheduler:
    def __init__(self, executor, blocks: BlockManager, config: SchedulerConfig):
        self.executor, self.blocks, self.config = executor, blocks, config
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._inbox: collections.deque[Request] = collections.deque()   # submitted, not yet seen by a step
        self._lock = threading.Lock()      # held by a step; cancel frees pages at once when it is free
        self._in_flight: _InFlight | None = None    # pipelined: the decode launched by the last step
        self.times = StepTimes()
        self.trace = _open_trace(_TRACE_PATH)
        # counters for metrics
        self.prefix_query_tokens = 0       # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0         # of which found
        self.preemptions = 0

    @property
    def sample_chunks(self) -> bool:
        """A mixed step samples each prompt-ending chunk's first token on the device: its logits stay there."""
        return self.config.mixed and getattr(self.executor, "samples_chunks", False)

    # --- any thread ---

    def submit(self, gen: "Generation") -> Request:
        need = self.blocks.pages_for(len(gen.prompt_ids) + gen.budget)
        if need > self.blocks.usable:
            most = self.blocks.usable * self.blocks.page_size - len(gen.prompt_ids)
            hint = f"ask for at most {most} new tokens" if most > 0 else "shorten the prompt"
            raise RequestTooLarge(
                f"the request needs {need} KV pages ({len(gen.prompt_ids)} prompt tokens + up to {gen.budget} new) "
                f"but the KV cache holds {self.blocks.usable}: {hint}")
        req = Request(gen)
        self._inbox.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Drop a request: its pages go back now, or at the end of the step running now."""
        req.cancelled = True
        if self._lock.acquire(blocking=False):
            try:
                self._reap_cancelled()
            finally:
                self._lock.release()

    def queued(self) -> list[Request]:
        """Requests waiting for admission, oldest first."""
        return list(self.waiting) + list(self._inbox)

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.running)

    # --- the stepping thread ---

    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        out = self._step()
        t = self.times
        t.steps += 1
        t1 = time.perf_counter()
        t.total_s += t1 - t0
        if self.trace:
            self.trace.write(t0, t1, len(self.running), len(self.waiting) + len(self._inbox))
        if _STATS_EVERY and t.steps % _STATS_EVERY == 0:
            _log.warning("step times: %s", t.line())
        return out

    def _step(self) -> list[StepOutput]:
        with self._lock:
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
            self._reap_cancelled()
            if self._can_run_ahead():
                return self._step_ahead()
            out, landed = self._land()
            # a host-sampled request's next token needs its logits processed first: such a step runs serially
            pipelined = self.config.pipeline and not any(r.gen.host_sampled for r in self.running)
            if not pipelined:       # stop strings end requests before the step is decided, as in a serial run
                out += self._describe(landed)
            preempted = self.preemptions
            rows = self._schedule_decode()
            chunks = self._schedule_prefill(self.config.step_tokens - len(rows), admit=self.preemptions == preempted)
            if self.preemptions != preempted:      # victims may have been scheduled before they were chosen
                rows = [r for r in rows if r.sid is not None]
                chunks = [(r, n) for r, n in chunks if r.sid is not None]
            rides: list[tuple[Request, int]] = []     # chunks run in the decode step's launches (a mixed step)
            # (a lone chunk rides too where the step samples its first token: one launch, no logits to the host)
            if self.config.mixed and chunks and (rows or len(chunks) > 1 or self.sample_chunks):
                room, most = self.config.prefill_chunk - len(rows), getattr(self.executor, "max_segments", 1)
                while chunks and len(rides) < most and chunks[0][1] <= room:
                    room -= chunks[0][1]
                    rides.append(chunks.pop(0))
            if pipelined:
                out += self._launch(rows, rides)
                t0 = time.perf_counter()
                out += self._describe(landed)      # while the device decodes the next step
                if self._in_flight:
                    self.times.hidden_s += time.perf_counter() - t0
            else:
                out += self._run_decode(rows, rides)
            out += self._run_prefill(chunks)
            self._reap_cancelled()
            return [o for o in out if not o.request.cancelled]

    def _can_run_ahead(self) -> bool:
        """Launch the next step before collecting the one in flight: no request samples on the host, and pages
        enough that no step can need a preemption (a victim's rows in flight would land after it was reset)."""
        return (self.config.ahead and self.config.mixed and self._in_flight is not None
                and not any(r.gen.host_sampled for r in self.running)
                and self.blocks.available() > len(self.running))

    def _step_ahead(self) -> list[StepOutput]:
        """Schedule and launch step N+1 while step N runs (its rows feed N's tokens on the device), then collect N:
        record and describe its tokens."""
        t0, waited = time.perf_counter(), self.times.decode_s
        older, self._in_flight = self._in_flight, None
        rows = self._schedule_decode()
        room = min(self.config.step_tokens, self.config.prefill_chunk) - len(rows)
        chunks = self._schedule_prefill(room, admit=True) if self.config.mixed else []
        rides = chunks[:getattr(self.executor, "max_segments", 1)]     # the rest wait for the next step
        out = self._launch(rows, rides)
        self.times.ahead_steps += self._in_flight is not None
        done, landed = self._land(older)
        out += done + self._describe(landed)
        self._reap_cancelled()
        # the step's host work all ran while the device computed (step N, then N + 1 queued behind it)
        self.times.hidden_s += time.perf_counter() - t0 - (self.times.decode_s - waited)
        return [o for o in out if not o.request.cancelled]

    # --- deciding ---

    def _schedule_decode(self) -> list[Request]:
        rows: list[Request] = []
        page_size = self.blocks.page_size
        for req in list(self.running):
            g = req.gen
            tokens = len(g.out) + req.sampling              # sampled, or being sampled by a step in flight
            if req.sid is None or tokens == 0 or tokens >= g.budget:   # preempted above, prefilling, or its last
                continue                                               # token is in flight
            pos = req.computed + req.ahead                  # where the row's token goes
            if pos != len(g.prompt_ids) + tokens - 1:       # its KV is not complete (prefilling, recomputing)
                continue
            # most steps the next position's page is there already (one step in page_size needs a new one)
            if pos < len(req.table.pages) * page_size or self._make_room(req, pos + 1, may_preempt_self=True):
                rows.append(req)
        return rows

    def _schedule_prefill(self, budget: int, admit: bool) -> list[tuple[Request, int]]:
        chunks: list[tuple[Request, int]] = []
        preempted_before = self.preemptions
        for req in list(self.running):
            if budget <= 0:
                break
            if req.sid is None or req.sampling:             # (a prompt's end with its first token in flight)
                continue
            at = req.computed + req.ahead                   # the next position to write
            left = req.gen.kv_length - at
            if left <= 0:
                continue
            n = min(left, self.config.prefill_chunk, budget)
            room = (len(req.table.pages) + self.blocks.available()) * self.blocks.page_size - at
            if room <= 0 and req is self.running[0]:
                # the oldest request always advances, so the pool can never stall on partial prefills
                self._make_room(req, at + n, may_preempt_self=False)
                room = (len(req.table.pages) + self.blocks.available()) * self.blocks.page_size - at
            n = min(n, room)
            if n > 0:
                self.blocks.grow(req.table, at + n)
                chunks.append((req, n))
                budget -= n
        # no admission in a step that preempted: pages are short, and a victim must not come straight back
        admit = admit and self.preemptions == preempted_before
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            tokens = req.gen.kv_tokens()
            hit = self.blocks.acquire_prefix(req.table, tokens, len(tokens) - 1)
            n = min(len(tokens) - hit, self.config.prefill_chunk, budget)
            # keep a page spare for each running request, so admitting one does not force a preemption
            spare = len(self.running)
            if self.blocks.pages_for(hit + n) - len(req.table.pages) + spare > self.blocks.available():
                self.blocks.release(req.table)
                break
            self.blocks.grow(req.table, hit + n)
            self.waiting.popleft()
            if not req.admitted:
                req.admitted, req.cached_tokens = True, hit
                self.prefix_query_tokens += len(tokens)
                self.prefix_hit_tokens += hit
            req.computed, req.sid, req.pages_sent = hit, self.executor.new_sequence(), 0
            self.running.append(req)
            chunks.append((req, n))
            budget -= n
        return chunks

    def _make_room(self, req: Request, n_tokens: int, may_preempt_self: bool) -> bool:
        """Grow req's pages to n_tokens, preempting the newest running requests while pages are short."""
        while not self.blocks.grow(req.table, n_tokens):
            victim = self.running[-1]
            if victim is req and not may_preempt_self:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.blocks.release(req.table)
        self.executor.free(req.sid)
        req.sid, req.computed, req.pages_sent, req.ahead, req.sampling = None, 0, 0, 0, 0
        req.preemptions += 1
        self.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    # --- running ---

    def _send_pages(self, req: Request) -> None:
        if req.pages_sent != len(req.table.pages):
            self.executor.set_pages(req.sid, list(req.table.pages))
            req.pages_sent = len(req.table.pages)

    def _chunks(self, rides: list[tuple[Request, int]]) -> list[PrefillChunk]:
        """The prefill chunks of a mixed step (their pages sent)."""
        chunks = []
        for req, n in rides:
            self._send_pages(req)
            g = req.gen
            tokens = g.kv_tokens()
            at = req.computed + req.ahead
            first = at + n == len(tokens) and not g.out        # the chunk ends the prompt: the first token
            sample = first and self.sample_chunks and not g.host_sampled
            if sample and g.penalised and req.penalty_sid != req.sid:   # the device penalty state, before its use
                self.executor.init_penalties(req.sid, g.prompt_ids, dict(g.sampler.out_counts))
                req.penalty_sid = req.sid
            chunks.append(PrefillChunk(req.sid, tokens[at:at + n], at,
                                       want_logits=first and not sample, sample=sample, params=g.params))
            self.times.first_on_device += sample
        self.times.mixed_steps += bool(chunks)
        return chunks

    def _decoded(self, req: Request) -> None:
        """A decode step wrote req's next position (and sampled its next token): a page it fills goes into the
        prefix cache."""
        req.computed += 1
        req.ahead -= 1
        req.sampling -= 1
        if req.computed % self.blocks.page_size == 0:
            self.blocks.commit(req.table, req.gen.tokens(), req.computed)

    def _chunk_done(self, ride: tuple[Request, int], logits, token: int | None = None,
                    launched: bool = True) -> list[StepOutput]:
        """A prefill chunk's KV is written (riding in a step: `launched`, or alone): the prefix cache learns its
        pages; a chunk that ends the prompt gives the first token (sampled by the step, or from its logits here)."""
        req, n = ride
        if req.done:
            return []
        tokens = req.gen.kv_tokens()
        req.computed += n
        if launched:
            req.ahead -= n
            req.sampling -= token is not None
        self.blocks.commit(req.table, tokens, req.computed)
        if req.computed == len(tokens) and not req.gen.out:      # the prompt is in: the first token
            if token is not None:
                return [self._advance(req, lambda g: g.on_token(token))]
            return [self._advance(req, lambda g: g.on_logits(logits))]
        return []       # (a request recomputed after preemption already has its next token: gen.pending)

    def _step_rows(self, rows: list[Request]) -> list[StepRow]:
        step = []
        for req in rows:
            self._send_pages(req)
            g = req.gen
            if g.penalised and not g.host_sampled and req.penalty_sid != req.sid:    # penalties on the device
                self.executor.init_penalties(req.sid, g.prompt_ids, dict(g.sampler.out_counts))
                req.penalty_sid = req.sid
            # the token to feed: the last one recorded, or (None) the one the step in flight samples, on the device
            step.append(StepRow(req.sid, None if req.sampling else g.pending, req.computed + req.ahead,
                                None if g.host_sampled else g.params, want_logits=g.host_sampled))
        return step

    def _run_decode(self, rows: list[Request], rides: list[tuple[Request, int]] = ()) -> list[StepOutput]:
        """A decode step (with riding prefill chunks: a mixed step) from launch to events (the serial path):
        launched as the pipelined path does, collected at once."""
        failed = self._launch(rows, rides)
        flight, self._in_flight = self._in_flight, None
        if flight is None:          # nothing to run, or the launch failed (its requests have failed)
            return failed
        t0 = time.perf_counter()
        try:
            result = self.executor.decode_collect(flight.handle)
        except Exception as e:  # noqa: BLE001 - every row of a failed step fails; the server keeps serving
            return [self._fail(req, e) for req in rows + [r for r, _ in rides]]
        finally:
            self.times.decode_s += time.perf_counter() - t0
        out = []
        for i, req in enumerate(rows):
            self._decoded(req)
            out.append(self._advance(req, lambda g, i=i: g.on_logits(result.logits[i]) if g.host_sampled
                                     else g.on_token(result.tokens[i])))
        for ride, logits, tok in zip(rides, result.chunk_logits, _chunk_tokens(result)):
            out += self._chunk_done(ride, logits, tok)
        return out

    def _launch(self, rows: list[Request], rides: list[tuple[Request, int]] = ()) -> list[StepOutput]:
        """The pipelined path, first half: launch the decode step (with riding prefill chunks: a mixed step)
        and leave it in flight."""
        if not rows and not rides:
            return []
        step = self._step_rows(rows)
        t0 = time.perf_counter()
        try:
            chunks = self._chunks(rides)
            handle = self.executor.decode_submit(step, chunks or None)
            self._in_flight = _InFlight(handle, rows, list(rides))
            for req in rows:
                req.ahead += 1
                req.sampling += 1
            for (req, n), c in zip(rides, chunks):
                req.ahead += n
                req.sampling += c.sample
        except Exception as e:  # noqa: BLE001 - every row of a failed step fails; the server keeps serving
            return [self._fail(req, e) for req in rows + [r for r, _ in rides]]
        finally:
            self.times.decode_s += time.perf_counter() - t0
            self.times.decode_rows += len(rows)
            if self.trace:
                self.trace.rows += len(rows)
                self.trace.tokens += sum(n for _, n in rides)
        return []

    def _land(self, flight: _InFlight | None = None) -> tuple[list[StepOutput], list[tuple[Request, int]]]:
        """The pipelined path, second half: collect the step in flight and record each live row's token (the
        cheap half of taking it, which the next step's scheduling needs); requests it ends give their pages
        back now. Returns the failures and the (request, token) pairs still to describe. A row whose request
        ended meanwhile (cancelled, or a stop string in the previous token) is dropped with its token. `flight`: a
        step launched before the one in flight (ahead), else the one in flight."""
        if flight is None:
            flight, self._in_flight = self._in_flight, None
        if flight is None:
            return [], []
        live = [(i, req) for i, req in enumerate(flight.rows) if not req.done]
        rides = [r for r, _ in flight.chunks if not r.done]
        if not live and not rides:  # nobody wants these tokens; the executor needs no collect before its next launch
            return [], []
        t0 = time.perf_counter()
        try:
            result = self.executor.decode_collect(flight.handle)
        except Exception as e:  # noqa: BLE001
            return [self._fail(req, e) for req in [r for _, r in live] + rides], []
        finally:
            self.times.decode_s += time.perf_counter() - t0
        landed = []
        for i, req in live:
            tok = result.tokens[i]
            self._decoded(req)
            if req.gen.record(tok):
                self._finish(req)
            landed.append((req, tok))
        done = [o for ride, logits, tok in zip(flight.chunks, result.chunk_logits, _chunk_tokens(result))
                for o in self._chunk_done(ride, logits, tok)]
        return done, landed

    def _describe(self, landed: list[tuple[Request, int]]) -> list[StepOutput]:
        """The expensive half of taking each landed token: its text, stop strings, its event."""
        return [self._advance(req, lambda g, tok=tok: g.describe(tok, None)) for req, tok in landed]

    def _run_prefill(self, chunks: list[tuple[Request, int]]) -> list[StepOutput]:
        out = []
        for req, n in chunks:
            if req.cancelled:
                continue
            tokens = req.gen.kv_tokens()
            self._send_pages(req)
            t0 = time.perf_counter()
            try:
                logits = self.executor.prefill(req.sid, tokens[req.computed:req.computed + n], req.computed)
            except Exception as e:  # noqa: BLE001
                out.append(self._fail(req, e))
                continue
            finally:
                self.times.prefill_s += time.perf_counter() - t0
                if self.trace:
                    self.trace.tokens += n
            out += self._chunk_done((req, n), logits, launched=False)
        return out

    def _advance(self, req: Request, sample) -> StepOutput:
        try:
            ev = sample(req.gen)
        except Exception as e:  # noqa: BLE001 - e.g. a constraint that cannot continue
            return self._fail(req, e)
        ev.cached_tokens = req.cached_tokens
        if ev.finish_reason:
            self._finish(req)
        return StepOutput(req, ev)

    def _fail(self, req: Request, error: Exception) -> StepOutput:
        self._finish(req)
        return StepOutput(req, error=error)

    def _finish(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        self.blocks.release(req.table)
        if req.sid is not None:
            self.executor.free(req.sid)
            req.sid = None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _reap_cancelled(self) -> None:
        for req in [r for r in (*self.running, *self.waiting) if r.cancelled]:
            self._finish(req)
