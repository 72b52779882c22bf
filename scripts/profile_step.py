#!/usr/bin/env python
"""Time every launch of one step of a bundle's launch program on the GPU, and the bytes each moves.

Runs a decode bucket (or the prefill chunk) eagerly, a CUDA event pair around each launch, `--reps`
times, and prints per kernel: launches, median microseconds, the bytes the program says it reads and
writes, and the achieved GB/s next to the device-to-device copy bandwidth measured in the same run.
Each time (with --back-to-back 1) includes the launch's own latency outside a graph (about 10 us on an H200: a batch-1 8B step
sums to 7.6 ms here against 4.1 ms replayed as a graph), so small kernels read slower than they run;
the big GEMVs, whose time is their bytes, read close to true. `ncu` gives exact kernel durations.
Also the target of `ncu --clock-control none python scripts/profile_step.py ...` for hardware counters: profile a
bundle planned with `impc compile ... --vram 40` (ncu's kernel replay saves and restores the memory a kernel writes;
with a default plan the arena holds nearly all of the GPU's memory and ncu answers "Failed to profile").

With --back-to-back --graph each row's launches replay as one CUDA graph: kernel time without the host's launch rate.
An event pair around each launch still breaks the overlap programmatic dependent launch gives consecutive kernels
in the step's own graph: one-block kernels read 6-8 us here and cost well under 1 us there (BENCHMARKS.md,
twenty-sixth session: two of them fused away moved the step by 0.2%). What a kernel costs in the step is what
leaving it out saves: `ablate_step.py`.

Usage: python scripts/profile_step.py BUNDLE [--phase decode|prefill] [--tokens N] [--reps 20] [--by-shape]
       [--back-to-back [--graph]] [--json]"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--tokens", type=int, default=1, help="decode bucket (default 1); prefill: rows of the chunk")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache (default 512)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--back-to-back", action="store_true",
                    help="time all launches of one row (a kernel, with --by-shape a kernel and weight: one a layer) "
                         "queued back to back, each layer's own weights, so no launch finds the last one's in L2: "
                         "hides the launch latency one launch between two events carries, for kernels over ~5 us")
    ap.add_argument("--graph", action="store_true",
                    help="with --back-to-back: each row's launches captured as one CUDA graph and replayed between the "
                         "events, so the row's time is its kernels' time in a graph (as the decode step runs them), "
                         "not the host's launch rate (~8 us a launch from Python, more than a small kernel takes)")
    ap.add_argument("--by-shape", action="store_true",
                    help="one row per matrix kernel and weight (qkv, o, gate_up, down, head) instead of per kernel")
    a = ap.parse_args()

    import numpy as np

    from impc.cli_bench import copy_bandwidth
    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu
    from imp_runtime.executor import StepRow
    from imp_runtime.executor_cuda import CudaExecutor
    from imp_runtime.kv_blocks import BlockManager, SoloSequence

    check(cu.cuInit(0))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))))
    bw = copy_bandwidth()
    ex = CudaExecutor(load_bundle(a.bundle), use_graphs=False)
    blocks = BlockManager(ex.num_pages, ex.page_size)
    rng = np.random.default_rng(0)
    n = a.tokens if a.phase == "decode" else 1
    seqs = [SoloSequence(ex, blocks) for _ in range(n)]
    for s in seqs:
        if a.context:
            s.prefill(rng.integers(3, ex.vocab, a.context).tolist())
        s._cover(s.length + a.tokens + 1)
    if a.phase == "decode":
        ex.decode([StepRow(s.sid, 5, s.length) for s in seqs])        # the step values of a real step
        phase, env = ex.program.phase("decode", next(b for b in ex.decode_buckets if b >= n)), {}
    else:
        phase = ex.program.phase("prefill", next(b for b in ex.prefill_buckets if b >= min(a.tokens, ex.prefill_chunk)))
        env = {"rows": min(a.tokens, ex.prefill_chunk), "start": seqs[0].length, "slot": ex._seqs[seqs[0].sid].slot}
    import re

    def label(x) -> str:
        """The kernel, and with --by-shape the weight a matrix kernel reads (layers' names without the index)."""
        if a.by_shape and x.kernel.startswith(("gemv_", "gemm_")):
            for b, _ in x.reads:
                m = re.match(r"(?:layers\.\d+\.)?(qkv|o|gate_up|down|lm_head|embed)(?:\.|$)", b)
                if m:
                    return f"{x.kernel} [{m.group(1)}]"
        return x.kernel

    e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    times = collections.defaultdict(list)
    graphs = {}
    for rep in range(a.reps + 2):
        for i in range(len(phase.launches)):
            if a.back_to_back:
                break
            check(cu.cuEventRecord(e0, ex.stream))
            ex.run_launch(phase.phase, phase.tokens, i, env)
            check(cu.cuEventRecord(e1, ex.stream))
            check(cu.cuEventSynchronize(e1))
            if rep >= 2:
                times[i].append(check(cu.cuEventElapsedTime(e0, e1)) * 1e3)
        if a.back_to_back:
            rows_of = collections.defaultdict(list)
            for i, x in enumerate(phase.launches):
                rows_of[label(x)].append(i)
            for key, idx in rows_of.items():
                if a.graph and key not in graphs:
                    check(cu.cuStreamBeginCapture(ex.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
                    for i in idx:
                        ex.run_launch(phase.phase, phase.tokens, i, env)
                    graphs[key] = check(cu.cuGraphInstantiate(check(cu.cuStreamEndCapture(ex.stream)), 0))
                    check(cu.cuGraphLaunch(graphs[key], ex.stream))          # a warm-up replay
                check(cu.cuEventRecord(e0, ex.stream))
                if a.graph:
                    check(cu.cuGraphLaunch(graphs[key], ex.stream))
                else:
                    for i in idx:
                        ex.run_launch(phase.phase, phase.tokens, i, env)
                check(cu.cuEventRecord(e1, ex.stream))
                check(cu.cuEventSynchronize(e1))
                if rep >= 2:
                    per_launch = check(cu.cuEventElapsedTime(e0, e1)) * 1e3 / len(idx)
                    for i in idx:
                        times[i].append(per_launch)
    per = collections.defaultdict(lambda: [0, 0.0, 0])
    for i, x in enumerate(phase.launches):
        k = per[label(x)]
        k[0] += 1
        k[1] += statistics.median(times[i])
        k[2] += sum(b for _, b in x.reads) + sum(b for _, b in x.writes)
    total = sum(v[1] for v in per.values())
    rows = [{"kernel": k, "launches": c, "us": t, "bytes": b, "GBps": b / t / 1e3 if t else 0.0,
             "pct_of_copy_bw": 100 * b / t / 1e-6 / bw if t else 0.0}
            for k, (c, t, b) in sorted(per.items(), key=lambda kv: -kv[1][1])]
    res = {"bundle": ex.bundle.name, "gpu": ex.gpu_name, "phase": phase.phase, "tokens": a.tokens,
           "context": a.context, "copy_bandwidth_Bps": bw, "kernel_us": total, "kernels": rows}
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{res['bundle']} on {res['gpu']}: {phase.phase} {a.tokens} at context {a.context}, "
              f"{len(phase.launches)} launches, {total:.0f} us of kernel time; copy bandwidth {bw / 1e12:.2f} TB/s")
        for r in rows:
            print(f"  {r['kernel']:36s} x{r['launches']:4d} {r['us']:9.1f} us {100 * r['us'] / total:5.1f}%  "
                  f"{r['bytes'] / 1e6:9.2f} MB {r['GBps']:7.0f} GB/s ({r['pct_of_copy_bw']:3.0f}% of copy)")
    ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
