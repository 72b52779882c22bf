#!/usr/bin/env python
"""Where one decode kernel launch spends its time: the phase timers of a developer build (the prelude's phase_mark:
thread 0 of each block stores %globaltimer at marked points), read after replaying the decode graph up to and
including that launch, so it runs after its real predecessors (programmatic dependent launch included) and is the
last of its kind to write the timers. Prints, per phase, when the grid's blocks reached it: the earliest, median
and latest block, in us after the first block started; medians over --reps replays.

Marked kernels (TIMER_GEMV, TIMER_ATTN, TIMER_NORM, TIMER_ROPE in templates/prelude.cuh.j2):
  gemv_ring_*       0 entry, 1 past pdl_wait, 2 first stage landed, 3 last stage done, 4 exit (warp 0's view);
                    and the share of thread 0's loop spent waiting for its stages (memory) against computing
  attn_decode_f16*  0 entry, 1 past pdl_wait, 2 splits done (partials stored), 3 counted in; the merging blocks:
                    5 past the count, 7 weights staged, 6 thread 0's outputs summed, 4 merged (outputs stored);
                    a sequence of one split (attn_decode_rope_*): 3 q staged, 5 first chunk landed, 4 second
                    chunk landed, 7 chunks done, 6 outputs stored (under the merge's names)
  gemv_nvfp4*, gemv_gated_nvfp4* (the per-block GEMVs) 0 entry, 1 past pdl_wait, 2 the norm's planes staged (*_norm),
                    3 the block's sums reduced, 4 exit
  rmsnorm_residual  0 entry, 1 past pdl_wait, 2 thread 0's loads summed, 3 the block's sum reduced, 4 exit
  qkv_rope_cache_f16 0 entry, 1 past pdl_wait, 4 exit
--blocks N prints the N blocks that exited last and the N that exited first, each block's phases (medians over the
replays) and, for gemv_ring, its stages: whether a launch's tail is blocks that started late or blocks that ran slow.
--with KIND prints the last launch of another marked kind before the timed one on the same time axis (e.g. the
attention before an o projection: the time from its last block's end to the GEMV's pdl_wait is the boundary).

The bundle must be compiled with the timers (they change the kernels' code; never ship such a bundle):
  IMP_KERNEL_TIMERS=1 impc compile --synthetic examples/qwen3-8b.json -o build/syn-8b-timers --target sm_90a
  python scripts/kernel_phases.py build/syn-8b-timers --kernel attn_decode --tokens 1 --context 512"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# family: (timer slot, phase names by index, the order they are printed in)
FAMILIES = {"gemv_ring": (0, ("entry", "past pdl_wait", "first stage landed", "last stage done", "exit"), (0, 1, 2, 3, 4)),
            "attn_decode": (1, ("entry", "past pdl_wait", "splits done", "counted in", "merged", "merge start",
                                "outputs summed", "weights staged"), (0, 1, 2, 3, 5, 7, 6, 4)),
            "rmsnorm_residual": (2, ("entry", "past pdl_wait", "loads summed", "sum reduced", "exit"), (0, 1, 2, 3, 4)),
            "qkv_rope": (3, ("entry", "past pdl_wait", "", "", "exit"), (0, 1, 4)),
            "gemv_nvfp4": (4, ("entry", "past pdl_wait", "norm planes", "sums reduced", "exit"), (0, 1, 2, 3, 4)),
            "gemv_gated_nvfp4": (5, ("entry", "past pdl_wait", "norm planes", "sums reduced", "exit"), (0, 1, 2, 3, 4))}
TIMER_FAMILIES, TIMER_BLOCKS, TIMER_PHASES = 6, 1024, 8     # templates/prelude.cuh.j2


def phase_table(timers, blocks: int, names, start=None) -> list[tuple[str, int, float, float, float]]:
    """(phase, blocks that reached it, earliest, median, latest us after the first block's entry) of one
    replay's timers [TIMER_BLOCKS, TIMER_PHASES] (ns; 0 where a block did not reach a phase). Every block of the
    timed launch stores its entry; a phase value older than its block's entry was left by an earlier launch of the
    same kind (a block that did not reach that phase this time: the attention's non-merging blocks) and is
    skipped. start: the time axis's zero (ns; default this launch's first entry)."""
    t = timers[:blocks].astype("int64")
    if start is None:
        start = t[:, 0][t[:, 0] > 0].min()
    rows = []
    for p, name in enumerate(names):
        v = t[:, p][(t[:, p] > 0) & (t[:, p] >= t[:, 0])]
        if len(v):
            us = (v - start) / 1e3
            rows.append((name, len(v), float(us.min()), float(statistics.median(us.tolist())), float(us.max())))
    return rows


def wait_share(counters, blocks: int) -> tuple[float, float, float, float] | None:
    """From the ring GEMV's cycle counts [TIMER_BLOCKS, TIMER_PHASES] (per block: 0 cycles thread 0 waited for its
    stages to land, 1 cycles from its first stage to its exit, 2 stages): the share of the loop spent waiting
    (median, lowest, highest block) and the median cycles a stage; None without counts."""
    c = counters[:blocks].astype("float64")
    c = c[(c[:, 1] > 0) & (c[:, 2] > 0)]
    if not len(c):
        return None
    share = (c[:, 0] / c[:, 1]).tolist()
    return (statistics.median(share), min(share), max(share), statistics.median((c[:, 1] / c[:, 2]).tolist()))


def hits_of(phase, kind: str) -> list[int]:
    return [i for i, x in enumerate(phase.launches) if x.kernel.startswith(kind)]


def print_phases(tables, names, order) -> None:
    for p in order:
        rows = [r for t in tables for r in t if r[0] == names[p]]
        if rows:
            med = lambda k: statistics.median(r[k] for r in rows)    # noqa: E731
            print(f"  {names[p]:20s} {int(med(1)):6d} {med(2):9.2f} {med(3):9.2f} {med(4):9.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--kernel", required=True, choices=sorted(FAMILIES), help="the kernel kind (a name prefix)")
    ap.add_argument("--occurrence", type=int, default=-1,
                    help="which launch of that kind in the step (default -1: the last; 0: the first)")
    ap.add_argument("--tokens", type=int, default=1, help="decode rows (default 1)")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each sequence's cache (default 512)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--with", dest="other", choices=sorted(FAMILIES),
                    help="also the last launch of this kind before the timed one, on the same time axis")
    ap.add_argument("--blocks", type=int, default=0, help="print the N latest and N earliest blocks to exit")
    a = ap.parse_args()

    import numpy as np

    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu, dtoh
    from imp_runtime.cuda_program import BoundPhase
    from imp_runtime.executor_cuda import CudaExecutor
    from imp_runtime.program import evaluate
    from scripts.decode_setup import decode_phase_at_context

    ex = CudaExecutor(load_bundle(a.bundle))
    err, dptr, nbytes = cu.cuModuleGetGlobal(ex.module.module, b"imp_timers")
    if err != cu.CUresult.CUDA_SUCCESS:
        print(f"error: {a.bundle} has no phase timers; compile it with IMP_KERNEL_TIMERS=1", file=sys.stderr)
        return 2
    family, names, order = FAMILIES[a.kernel]
    full = decode_phase_at_context(ex, a.tokens, a.context)
    b = full.tokens
    hits = hits_of(full, a.kernel)
    if not hits:
        print(f"error: decode {b} launches no {a.kernel}*", file=sys.stderr)
        return 2
    index = hits[a.occurrence]
    x = full.launches[index]
    grid = [evaluate(g, {"rows": a.tokens}) for g in x.grid]
    nblocks = min(TIMER_BLOCKS, int(np.prod(grid)))
    bp = BoundPhase(replace(full, launches=full.launches[:index + 1]), ex.module, ex.arena, ex.program.symbols)
    bp.capture(ex.stream)
    _, cptr, _ = cu.cuModuleGetGlobal(ex.module.module, b"imp_counters")
    host = np.zeros((TIMER_FAMILIES, TIMER_BLOCKS, TIMER_PHASES), np.uint64)
    counts = np.zeros_like(host)
    tables, shares, others, per_block = [], [], [], []
    if a.other:
        ofam, onames, oorder = FAMILIES[a.other]
        ohits = [i for i in hits_of(full, a.other) if i < index]
        if not ohits or ofam == family:
            print(f"error: no {a.other}* launch of another timer family before launch {index}", file=sys.stderr)
            return 2
        ox = full.launches[ohits[-1]]
        oblocks = min(TIMER_BLOCKS, int(np.prod([evaluate(g, {"rows": a.tokens}) for g in ox.grid])))
    for rep in range(a.reps + 3):
        check(cu.cuMemsetD8Async(dptr, 0, nbytes, ex.stream))
        check(cu.cuMemsetD8Async(cptr, 0, nbytes, ex.stream))
        bp.run(ex.stream)
        dtoh(host, dptr, ex.stream)
        dtoh(counts, cptr, ex.stream)
        if rep >= 3:
            tables.append(phase_table(host[family], nblocks, names))
            if a.other:
                t0 = host[family][:nblocks, 0].astype("int64")
                others.append(phase_table(host[ofam], oblocks, onames, start=t0[t0 > 0].min()))
            shares.append(wait_share(counts[family], nblocks))
            t = host[family][:nblocks].astype("int64")
            per_block.append((t - t[:, 0][t[:, 0] > 0].min()) / 1e3)
    bp.release()
    print(f"{ex.bundle.name}: decode {b} at context {a.context}, launch {index} {x.kernel} grid {tuple(grid)} "
          f"({nblocks} blocks timed); us after the first block's entry, medians of {a.reps} replays")
    print(f"  {'phase':20s} {'blocks':>6s} {'earliest':>9s} {'median':>9s} {'latest':>9s}")
    if a.other:
        print(f"  launch {ohits[-1]} {ox.kernel} (before it):")
        print_phases(others, onames, oorder)
        print(f"  launch {index} {x.kernel}:")
    print_phases(tables, names, order)
    shares = [x for x in shares if x]
    if shares:
        med = lambda k: statistics.median(x[k] for x in shares)    # noqa: E731
        print(f"  thread 0 of a block waited for its stages {100 * med(0):.0f}% of its loop (blocks "
              f"{100 * med(1):.0f}-{100 * med(2):.0f}%); {med(3):.0f} cycles a stage")
    if a.blocks:
        print_blocks(np.median(np.stack(per_block), axis=0), counts[family][:nblocks, 2], names, order, a.blocks)
    ex.close()
    return 0


def print_blocks(us, stages, names, order, n: int) -> None:
    """The n blocks that exited last and the n that exited first (phases: medians over the replays, us after the
    launch's first entry); for gemv_ring also each block's stages (thread 0's count, the last replay)."""
    import numpy as np

    last = order[-1]
    rank = np.argsort(us[:, last])
    cols = [p for p in order if names[p]]
    print(f"  block  {'stages':>6s} " + " ".join(f"{names[p][:12]:>12s}" for p in cols))
    for title, idx in (("exited last", rank[::-1][:n]), ("exited first", rank[:n])):
        print(f"  {title}:")
        for i in idx:
            print(f"  {i:5d}  {int(stages[i]):6d} " + " ".join(f"{us[i, p]:12.2f}" for p in cols))
    if len(us) > 2:
        c = np.corrcoef(us[:, 1], us[:, last])[0, 1]
        print(f"  correlation of a block's pdl_wait with its exit over {len(us)} blocks: {c:+.2f}")


if __name__ == "__main__":
    sys.exit(main())
