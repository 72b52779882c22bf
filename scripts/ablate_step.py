#!/usr/bin/env python
"""What each kernel kind costs inside the replayed decode graph: the step's time with every launch of one
kernel kind left out (the result is wrong, the timing is what a fusion that removes those launches could
win at most), next to the full step. Graph replays timed with CUDA events, median of --reps.

Usage: python scripts/ablate_step.py BUNDLE [--tokens 1] [--drop rmsnorm_residual,qkv_rope_cache_f16,...]
A kind KERNEL@NAME drops only the launches of KERNEL... that take a buffer whose name ends with NAME (e.g.
gemv_nvfp4_nb1@.o.codes: the o projections, not the down ones that run the same kernel)."""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--drop", default="rmsnorm_residual,qkv_rope_cache_f16,attn_decode_f16,"
                                      "gemv_,embedding_gather,sample_tokens")
    a = ap.parse_args()

    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu
    from imp_runtime.cuda_program import BoundPhase
    from imp_runtime.executor_cuda import CudaExecutor
    from scripts.decode_setup import decode_phase_at_context

    ex = CudaExecutor(load_bundle(a.bundle))
    full = decode_phase_at_context(ex, a.tokens, a.context)
    b = full.tokens
    e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))

    def time_phase(phase) -> float:
        bp = BoundPhase(phase, ex.module, ex.arena, ex.program.symbols)
        bp.capture(ex.stream)
        ts = []
        for i in range(a.reps + 10):
            check(cu.cuEventRecord(e0, ex.stream))
            bp.run(ex.stream)
            check(cu.cuEventRecord(e1, ex.stream))
            check(cu.cuEventSynchronize(e1))
            if i >= 10:
                ts.append(check(cu.cuEventElapsedTime(e0, e1)) * 1e3)
        bp.release()
        return statistics.median(ts)

    base = time_phase(full)
    print(f"{ex.bundle.name}: decode {b} at context {a.context}, {len(full.launches)} launches, "
          f"step {base:.1f} us ({a.tokens * 1e6 / base:.0f} tok/s)")
    for kind in a.drop.split(","):
        kern, _, arg = kind.partition("@")
        kept = tuple(x for x in full.launches if not (x.kernel.startswith(kern) and (
            not arg or any(str(v.get("ptr", "")).endswith(arg) for v in x.args if isinstance(v, dict)))))
        n = len(full.launches) - len(kept)
        if not n:
            continue
        t = time_phase(replace(full, launches=kept))
        print(f"  without {kind:24s} ({n:3d} launches): {t:8.1f} us, saves {base - t:7.1f} us "
              f"({(base - t) / n:5.2f} us a launch)")
    ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
