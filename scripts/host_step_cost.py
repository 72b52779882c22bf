#!/usr/bin/env python
"""The host's cost of a serving step, and how much of it pipelining hides, without a GPU.

Serves N streams through the server's queue (runtime/server/queue.py: the worker thread steps the
scheduler, an asyncio loop consumes every stream's events as the HTTP handlers would) on a simulated GPU:
an executor with the bundle's program whose decode takes --gpu-ms of wall time on a "device" (submit
notes when the step will be done, collect sleeps until then: time.sleep releases the GIL as the driver's
wait does), while the host side is the real one: the scheduler, the cuda executor's step-value writes,
the bundle's tokenizer detokenizing random tokens, stop strings, events, the hand-off to the loop.
Prints steps/s and tokens/s serial, pipelined and ahead (the next step launched before the last is collected),
and the scheduler's own split of a step (StepTimes).

Usage: scripts/host_step_cost.py BUNDLE [--rows 64] [--gpu-ms 6] [--steps 400] [--stop S ...] [--profile]
BUNDLE: a bundle with a GPU target's program and the served tokenizer (build/syn-qwen3-8b-base).
--profile: cProfile of the worker thread in each mode (top functions by own time, then the runtime's by cumulative time).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imp_runtime import engine as engine_module  # noqa: E402
from imp_runtime.bundle import load_bundle  # noqa: E402
from imp_runtime.cuda_arena import NP_DTYPES  # noqa: E402
from imp_runtime.executor import StepResult, StepRow  # noqa: E402
from imp_runtime.executor_cuda import CudaExecutor, _Seq  # noqa: E402
from imp_runtime.sampler import SamplingParams  # noqa: E402
from imp_runtime.scheduler import StepTimes  # noqa: E402
from imp_runtime.server.metrics import Metrics  # noqa: E402
from imp_runtime.server.queue import FairQueue  # noqa: E402
from imp_runtime.tokenizer import Tokenizer  # noqa: E402


class SimulatedGpu:
    """The cuda executor's host side (its step-value writes, run on the bundle's program's step buffers)
    over a device that takes gpu_s per decode step and returns random tokens."""
    name = "simulated"
    async_decode = True
    mixed_steps = samples_chunks = True     # prefill chunks ride in a step (instantly) and sample a first token
    max_segments = 16
    _kv_slot = CudaExecutor._kv_slot
    _write_step_values = CudaExecutor._write_step_values
    _sampling_values = CudaExecutor._sampling_values

    def __init__(self, bundle, gpu_s: float, vocab: int, seed: int = 0):
        target = bundle.manifest["kernels"]["targets"][0]
        p = bundle.program(target)
        c = p.constants
        self.page_size, self.num_pages = c["page_size"], c["kv_pages"]
        self.max_batch, self.max_context, self.prefill_chunk = c["max_batch"], c["max_context"], c["prefill_chunk"]
        self.decode_buckets = p.buckets("decode")
        self.penalty_values = "pen_counts" in p.buffers     # as the cuda executor: the step carries penalty values
        self.penalties_on_device = self.penalty_values
        self.step = {b.name: np.zeros(b.shape[0], NP_DTYPES[b.dtype]) for b in p.buffers.values() if b.kind == "step"}
        self.feeds_sampled, self._sampled_rows = "token_src" in self.step, {}
        self.gpu_s, self.vocab = gpu_s, vocab
        self.rng = np.random.default_rng(seed)
        self.first_logits = self.rng.standard_normal(c["vocab_size"]).astype(np.float32)
        self._seqs: dict[int, _Seq] = {}
        self._next = 0
        self.device_free_at = 0.0        # when the simulated device finishes the work queued on it
        self.idle_s = 0.0                # the device's idle time between a step's end and the next launch
        self.wake_s = 0.0                # of which the host took to wake from the wait (the GIL, the OS)

    def new_sequence(self) -> int:
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = _Seq(slot=sid % 1000 + 1)
        return sid

    def set_pages(self, sid: int, pages: list[int]) -> None:
        self._seqs[sid].pages = list(pages)

    def free(self, sid: int) -> None:
        self._seqs.pop(sid, None)

    def prefill(self, sid: int, tokens: list[int], start: int, all_logits: bool = False) -> np.ndarray:
        return self.first_logits        # instant: the measurement is of decode steps

    def decode_submit(self, rows: list[StepRow], chunks=None):
        """A step of gpu_s queued behind the device's work (a prompt's chunks riding in it cost nothing: the
        measurement is of decode steps); random tokens, a first token for each chunk that samples one."""
        chunks = chunks or []
        if rows:
            self._write_step_values(rows)
        now = time.perf_counter()
        self.idle_s += max(now - self.device_free_at, 0.0)
        self.device_free_at = max(now, self.device_free_at) + self.gpu_s
        tokens = self.rng.integers(0, self.vocab, len(rows)).tolist()
        firsts = [int(self.rng.integers(0, self.vocab)) if c.sample else None for c in chunks]
        # what a token None row feeds: 1 + its row in sampled (decode rows, then the sampled chunks' head rows)
        self._sampled_rows = {r.sid: i + 1 for i, r in enumerate(rows)}
        heads = [c.sid for c in chunks if c.sample]
        self._sampled_rows.update({sid: len(rows) + k + 1 for k, sid in enumerate(heads)})
        return self.device_free_at, tokens, [self.first_logits if c.want_logits else None for c in chunks], firsts

    def decode_collect(self, handle) -> StepResult:
        done_at, tokens, chunk_logits, firsts = handle
        wait = done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
            self.wake_s += time.perf_counter() - done_at
        return StepResult(tokens, {}, chunk_logits, firsts)

    def decode(self, rows: list[StepRow]) -> StepResult:
        return self.decode_collect(self.decode_submit(rows))


class MeasuredQueue(FairQueue):
    """The server's queue; once armed, its worker thread's CPU time per step (the step and the hand-off,
    not its waits: a figure the other load on the machine barely moves), and a cProfile of it if asked."""
    armed = False
    profiler: cProfile.Profile | None = None
    cpu_first: float | None = None
    cpu_last = 0.0
    cpu_steps = 0

    def _work(self) -> None:
        step = self.scheduler.step

        def measured_step():
            if self.armed:
                now = time.thread_time()
                if self.cpu_first is None:
                    self.cpu_first = now
                    if self.profiler:
                        self.profiler.enable()      # this thread's calls from now on, the hand-off included
                self.cpu_last, self.cpu_steps = now, self.cpu_steps + 1
            return step()
        self.scheduler.step = measured_step
        try:
            super()._work()
        finally:
            if self.profiler and self.cpu_first is not None:
                self.profiler.disable()

    def cpu_ms_per_step(self) -> float:
        return 1e3 * (self.cpu_last - (self.cpu_first or 0.0)) / max(self.cpu_steps - 1, 1)


def serve(bundle_path: str, rows: int, gpu_ms: float, steps: int, mode: str, stops: list[str],
          profile: bool, loop_us: float) -> dict:
    bundle = load_bundle(bundle_path, verify=False)
    tok_vocab = Tokenizer(bundle.tokenizer_json(), bundle.manifest["tokenizer"]).vocab_size
    engine_module.make_executor = lambda b, device, kv_pages: SimulatedGpu(b, gpu_ms / 1e3, tok_vocab)
    eng = engine_module.Engine(bundle_path, verify=False, max_running=rows)
    c = eng.scheduler.config           # serial; pipelined (launch, then describe); ahead (launch before collecting)
    c.pipeline, c.ahead = mode != "serial", mode == "ahead"
    c.mixed = mode == "ahead"
    profiler = cProfile.Profile() if profile else None
    q = MeasuredQueue(eng, Metrics(), max_running=rows)
    params = SamplingParams(max_tokens=eng.max_context - 64, temperature=0.8, ignore_eos=True, stop=stops)
    rng = np.random.default_rng(1)
    result: dict = {}

    async def consume(job, counts):
        async for ev in job.stream():
            counts[0] += 1
            busy_until = time.perf_counter() + loop_us / 1e6      # the HTTP side's work on the event (GIL held)
            while time.perf_counter() < busy_until:
                pass

    async def main():
        counts = [0]
        jobs = [q.submit(rng.integers(0, tok_vocab, 32).tolist(), params, None) for _ in range(rows)]
        tasks = [asyncio.create_task(consume(j, counts)) for j in jobs]
        while not (len(eng.scheduler.running) == rows and all(r.gen.out for r in eng.scheduler.running)):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)                         # a few steps of steady decoding first
        t = eng.scheduler.times = StepTimes()
        gpu = eng.executor
        gpu.idle_s = gpu.wake_s = 0.0
        q.profiler, q.armed = profiler, True
        tokens0, t0 = counts[0], time.perf_counter()
        while t.steps < steps:
            await asyncio.sleep(0.01)
        wall, tokens = time.perf_counter() - t0, counts[0] - tokens0
        result.update(steps_per_s=t.steps / wall, tokens_per_s=tokens / wall, line=t.line(),
                      host_ms=1e3 * (t.total_s - t.decode_s - t.prefill_s) / max(t.steps, 1),
                      hidden_ms=1e3 * t.hidden_s / max(t.steps, 1),
                      between_ms=1e3 * (wall - t.total_s) / max(t.steps, 1),
                      idle_ms=1e3 * gpu.idle_s / max(t.steps, 1), wake_ms=1e3 * gpu.wake_s / max(t.steps, 1),
                      cpu_ms=q.cpu_ms_per_step())
        for j in jobs:
            q.cancel(j)
        q.close(wait_s=1.0)
        for task in tasks:
            task.cancel()

    asyncio.run(main())
    if profiler:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(18)
        # ... and the runtime's own functions by cumulative time: which part of a step (landing the last step's
        # tokens, scheduling, the step values, describing, the hand-off) the time belongs to
        pstats.Stats(profiler, stream=s).sort_stats("cumulative").print_stats("imp_runtime|runtime/", 24)
        result["profile"] = s.getvalue()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--gpu-ms", type=float, default=6.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--stop", action="append", default=[], help="a stop string every request carries")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--loop-us", type=float, default=0.0, help="Python work the event loop does per event "
                    "(formatting and sending it), holding the GIL")
    ap.add_argument("--switch-ms", type=float, help="sys.setswitchinterval: how long a thread may hold the GIL "
                    "while another waits for it (Python's default 5 ms)")
    a = ap.parse_args()
    if a.switch_ms:
        sys.setswitchinterval(a.switch_ms / 1e3)
    print(f"{a.rows} streams, simulated GPU decode step {a.gpu_ms} ms, stop strings {a.stop or 'none'}, "
          f"event loop work {a.loop_us} us an event, GIL switch interval {1e3 * sys.getswitchinterval():.1f} ms")
    for mode in ("serial", "pipelined", "ahead"):
        r = serve(a.bundle, a.rows, a.gpu_ms, a.steps, mode, a.stop, a.profile, a.loop_us)
        print(f"{mode:9}: {r['steps_per_s']:.1f} steps/s, {r['tokens_per_s']:.0f} tok/s "
              f"(GPU-bound ceiling {1e3 / a.gpu_ms:.1f} steps/s); host {r['host_ms']:.2f} ms a step, "
              f"{r['hidden_ms']:.2f} of it while the device decodes; between steps (the hand-off) "
              f"{r['between_ms']:.2f} ms; the device idle {r['idle_ms']:.2f} ms a step (of which waking from the wait "
              f"{r['wake_ms']:.2f}); the worker thread's CPU time {r['cpu_ms']:.2f} ms a step\n  scheduler: {r['line']}")
        if a.profile:
            print(r["profile"])


if __name__ == "__main__":
    main()
