#!/usr/bin/env python
"""What a decode step costs on the GPU beyond its graph: N steps back to back on the executor's stream, timed with
events, as (1) the graph alone, (2) the step values' host-to-device copy and the graph, (3) the graph and the sampled
ids' device-to-host copy, (4) both copies (what a step queued before the staged step values), and (5) the executor's
own submit / collect loop (the bench's "ahead" decode: host work beside the GPU), every step at the same position so
that its context is the graph rows'; with the host's time in decode_submit and decode_collect and how often the GPU
had finished the step before when the host came to collect it (--profile: where that host time goes). The
differences say how much of a step is the copies' and the launches' gaps rather than kernels.

Usage: python scripts/step_gap.py BUNDLE [--tokens 1] [--context 100] [--steps 200] [--profile]"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also cProfile the executor loop's host work (top functions)")
    a = ap.parse_args()

    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu
    from imp_runtime.executor import StepRow
    from imp_runtime.executor_cuda import CudaExecutor
    from scripts.decode_setup import decode_phase_at_context

    ex = CudaExecutor(load_bundle(a.bundle))
    ph = decode_phase_at_context(ex, a.tokens, a.context)
    bp = ex.phases[("decode", ph.tokens)]
    e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    out = ex._out_bufs[0]

    def timed(step) -> float:
        ts = []
        for _ in range(a.rounds):
            step()
            check(cu.cuEventRecord(e0, ex.stream))
            for _ in range(a.steps):
                step()
            check(cu.cuEventRecord(e1, ex.stream))
            check(cu.cuEventSynchronize(e1))
            ts.append(check(cu.cuEventElapsedTime(e0, e1)) * 1e3 / a.steps)
        return statistics.median(ts)

    def h2d():
        check(cu.cuMemcpyHtoDAsync(ex.arena.base + ex.step_off, ex.step_host.ptr, ex.step_host.nbytes, ex.stream))

    def d2h():
        check(cu.cuMemcpyDtoHAsync(out.ptr, ex.arena.ptr("sampled"), 4 * ph.tokens, ex.stream))

    rows = {"graph": timed(lambda: bp.run(ex.stream)),
            "h2d + graph": timed(lambda: (h2d(), bp.run(ex.stream))),
            "graph + d2h": timed(lambda: (bp.run(ex.stream), d2h())),
            "h2d + graph + d2h": timed(lambda: (h2d(), bp.run(ex.stream), d2h()))}
    # the executor's loop (the bench's ahead decode), host time included, at the same context
    from imp_runtime.kv_blocks import BlockManager, SoloSequence
    import numpy as np
    blocks = BlockManager(ex.num_pages, ex.page_size)
    rng = np.random.default_rng(1)
    seqs = [SoloSequence(ex, blocks) for _ in range(a.tokens)]
    for s in seqs:
        s.prefill(rng.integers(3, ex.vocab, a.context).tolist())
        s._cover(s.length + 4)
    start = seqs[0].length

    def executor_round(prof=None) -> tuple[float, float, float, float]:
        """One round from the same position (the context of the graph rows above): us a step, in decode_submit, in
        decode_collect with its wait, and the share of steps whose predecessor had already finished at collect (the
        GPU waited for the host). prof: a cProfile.Profile enabled around the steps."""
        pos = start
        ex.decode([StepRow(s.sid, 5, pos) for s in seqs])
        pos += 1
        last, t_sub, t_col, n_done = None, 0.0, 0.0, 0
        if prof is not None:
            prof.enable()
        t = time.perf_counter()
        for _ in range(a.steps):
            t0 = time.perf_counter()
            # every step at the same position (its KV row rewritten): the context of the graph rows above, not one
            # that grows over the round (at 100 + 200 steps a SmolLM2-shape sequence crosses into two splits)
            h = ex.decode_submit([StepRow(s.sid, None, pos) for s in seqs])
            t1 = time.perf_counter()
            if last is not None:
                n_done += cu.cuEventQuery(ex._out_done[last.number % 2])[0] == cu.CUresult.CUDA_SUCCESS
                ex.decode_collect(last)
            t_sub, t_col = t_sub + t1 - t0, t_col + time.perf_counter() - t1
            last = h
        ex.decode_collect(last)
        total = time.perf_counter() - t
        if prof is not None:
            prof.disable()
        return total * 1e6 / a.steps, t_sub * 1e6 / a.steps, t_col * 1e6 / a.steps, n_done / (a.steps - 1)

    ts, sub, col, done = zip(*(executor_round() for _ in range(a.rounds)))
    rows["executor submit / collect"] = statistics.median(ts)
    if a.profile:                       # one more round under cProfile: where the host's time a step goes
        import cProfile
        import pstats
        prof = cProfile.Profile()
        executor_round(prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    host = (f"  (host: decode_submit {statistics.median(sub):.1f} us a step, decode_collect {statistics.median(col):.1f} "
            f"us incl. its wait; the step before already done at collect in {100 * statistics.median(done):.0f}% of "
            f"steps)")
    print(f"{ex.bundle.name}: decode {ph.tokens} at context {a.context}, {a.steps} steps a round, medians of "
          f"{a.rounds} rounds (us a step)")
    for k, v in rows.items():
        print(f"  {k:28s} {v:8.1f}  (+{v - rows['graph']:.1f})")
    print(host)
    ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
