#!/usr/bin/env python
"""What one dependency between decode steps costs on the GPU: a kernel boundary (the decode graph's way, under
programmatic dependent launch or without it) against a grid-wide barrier inside one persistent kernel. Issue 8's
one-row floors hinge on it: SmolLM2's step is ~156 dependent launches of ~3.4 us each for ~0.1 us of weights apiece
(BENCHMARKS.md, twenty-third and twenty-fifth sessions), and a persistent decode kernel is only worth building if
its barriers cost clearly less than the boundaries they replace.

scripts/boundary_cost.cu's kernels, no model: each step busy-waits --work-ns, then every block writes a word a
different block reads after the next dependency (an L2 round trip, as a real step hands its output on); --pre-ns of
the work does not depend on the previous step (a GEMV's weight loads) and may hide behind the dependency (before
griddepcontrol.wait; between arriving and waiting). A graph of --steps launches of `chain_step` (with and without
PDL), one launch of `persistent_steps` (a grid barrier a step; `persistent_steps_rel` the same with an acquire-release
fence and a relaxed add, as templates/gemv_ring_pair.cu.j2 arrives) and one of `flag_steps` (each block waits for the one
block it reads: a lower bound, a GEMV needs all of the previous one's blocks) are replayed --reps times; per step:
the median replay's time / steps, and that less the work: the dependency.

Usage: python scripts/boundary_cost.py --build OUT.cubin     (here: the compiler wheels' nvcc, sm_90a)
       python scripts/boundary_cost.py CUBIN [--steps 200] [--reps 15] [--blocks-per-sm 1,2] [--work-ns 0,1000]
                                            [--pre-ns 0]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SOURCE = ROOT / "scripts" / "boundary_cost.cu"
THREADS = 256


def build(out: Path, arch: str = "sm_90a") -> None:
    from impc.emit import nvcc_path
    subprocess.run([str(nvcc_path()), "-cubin", "-O3", f"-arch={arch}", "-o", str(out), str(SOURCE)], check=True)
    print(f"built {out}")


def measure(cubin: Path, steps: int, reps: int, blocks_per_sm: list[int], work_ns: list[int], pre_ns: int) -> list[dict]:
    from cuda.bindings import driver as cu
    from imp_runtime.cuda_driver import Module, check, pdl_attribute

    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(dev))))
    sms = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    mod = Module(cubin.read_bytes())
    chain, persistent, flags = mod.func("chain_step"), mod.func("persistent_steps"), mod.func("flag_steps")
    persistent_rel = mod.func("persistent_steps_rel")
    resident = min(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(k, THREADS, 0))
                   for k in (persistent, persistent_rel, flags))
    stream = check(cu.cuStreamCreate(0))
    words = check(cu.cuMemAlloc(2 * 4 * sms * max(blocks_per_sm)))
    bar = check(cu.cuMemAlloc(4 * sms * max(blocks_per_sm)))       # the barrier's counter, or a flag a block
    start, stop = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))

    def graph_of(record) -> object:
        check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            record()
        finally:
            g = check(cu.cuStreamEndCapture(stream))
        return check(cu.cuGraphInstantiate(g, 0))

    def timed(exe) -> float:
        """us per step: the median of reps replays (after one to warm up)."""
        check(cu.cuGraphLaunch(exe, stream))
        check(cu.cuStreamSynchronize(stream))
        times = []
        for _ in range(reps):
            check(cu.cuEventRecord(start, stream))
            check(cu.cuGraphLaunch(exe, stream))
            check(cu.cuEventRecord(stop, stream))
            check(cu.cuEventSynchronize(stop))
            times.append(check(cu.cuEventElapsedTime(start, stop)) * 1000.0 / steps)
        return statistics.median(times)

    rows = []
    for b in blocks_per_sm:
        grid = sms * b
        for w in work_ns:
            keep = []                                    # the argument blocks must outlive the capture

            def launch_chain(pdl: bool) -> None:
                for s in range(steps):
                    vals = [ctypes.c_uint64(int(words)), ctypes.c_int32(w), ctypes.c_int32(min(pre_ns, w)),
                            ctypes.c_int32(s & 1)]
                    params = (ctypes.c_void_p * 4)(*[ctypes.addressof(v) for v in vals])
                    keep.append((vals, params))
                    if pdl:
                        cfg = cu.CUlaunchConfig()
                        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
                        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = THREADS, 1, 1
                        cfg.sharedMemBytes, cfg.hStream = 0, stream
                        cfg.attrs, cfg.numAttrs = [pdl_attribute()], 1
                        check(cu.cuLaunchKernelEx(cfg, chain, ctypes.addressof(params), 0))
                    else:
                        check(cu.cuLaunchKernel(chain, grid, 1, 1, THREADS, 1, 1, 0, stream,
                                                ctypes.addressof(params), 0))

            def launch_persistent(kernel) -> None:
                check(cu.cuMemsetD32Async(bar, 0, grid, stream))
                vals = [ctypes.c_uint64(int(words)), ctypes.c_uint64(int(bar)), ctypes.c_int32(steps),
                        ctypes.c_int32(w), ctypes.c_int32(min(pre_ns, w))]
                params = (ctypes.c_void_p * 5)(*[ctypes.addressof(v) for v in vals])
                keep.append((vals, params))
                check(cu.cuLaunchKernel(kernel, grid, 1, 1, THREADS, 1, 1, 0, stream, ctypes.addressof(params), 0))

            row = {"blocks/SM": b, "work ns": w,
                   "boundary, PDL": timed(graph_of(lambda: launch_chain(True))),
                   "boundary, plain": timed(graph_of(lambda: launch_chain(False)))}
            # a grid barrier (or a ring of flags) needs the whole grid resident at once, or it never returns
            for name, kernel in (("grid barrier", persistent), ("grid barrier, acq_rel", persistent_rel),
                                 ("block flags", flags)):
                row[name] = timed(graph_of(lambda k=kernel: launch_persistent(k))) if b <= resident else float("nan")
            rows.append(row)
    check(cu.cuStreamSynchronize(stream))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cubin", nargs="?", help="scripts/boundary_cost.cu built for the GPU (see --build)")
    ap.add_argument("--build", metavar="OUT", help="compile scripts/boundary_cost.cu into OUT (sm_90a) and stop")
    ap.add_argument("--steps", type=int, default=200, help="dependent steps a replay (default 200)")
    ap.add_argument("--reps", type=int, default=15, help="replays timed (default 15)")
    ap.add_argument("--blocks-per-sm", default="1,2", help="grids of SMs x these blocks (default 1,2)")
    ap.add_argument("--work-ns", default="0,1000", help="each step's busy work in ns (default 0,1000)")
    ap.add_argument("--pre-ns", type=int, default=0, help="of it, the part independent of the previous step, which "
                    "may overlap the dependency (default 0)")
    args = ap.parse_args()
    if args.build:
        build(Path(args.build))
        return 0
    if not args.cubin:
        ap.error("a CUBIN (or --build OUT)")
    bps = [int(x) for x in args.blocks_per_sm.split(",") if x]
    work = [int(x) for x in args.work_ns.split(",") if x]
    rows = measure(Path(args.cubin), args.steps, args.reps, bps, work, args.pre_ns)
    cols = ["boundary, PDL", "boundary, plain", "grid barrier", "grid barrier, acq_rel", "block flags"]
    print(f"us a step (median of {args.reps} replays of {args.steps} steps, {args.pre_ns} ns of each step's work "
          f"independent of the last); in brackets: less the step's work")
    print(f"{'blocks/SM':>9} {'work ns':>8} " + " ".join(f"{c:>22}" for c in cols))
    for r in rows:
        cells = " ".join(f"{r[c]:>10.2f} ({r[c] - r['work ns'] / 1000:>6.2f} us)" for c in cols)
        print(f"{r['blocks/SM']:>9} {r['work ns']:>8} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
