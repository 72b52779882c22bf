"""Decode-GEMV measurements on the GPU (scripts/profile_decode.sh runs it).
  step BUNDLE        one eager (non-graph) decode step at batch 1 inside cuProfilerStart/Stop (for ncu)
  micro BUNDLE       times the NVFP4 decode GEMVs at the bundle's shapes, batch 1 and 8, weights rotated over
                     > 2x L2 (cold, as in a decode step); CUDA events around single launches (so launch overhead
                     included), median of 50. Where the executor has a GEMV_PIPE switch (an A/B variant), both
                     settings, with a bitwise comparison of their outputs
  table CSV...       ncu --csv --page raw files -> a short per-kernel table"""
from __future__ import annotations

import csv
import statistics
import sys


def _ctx():
    from imp_runtime.cuda_driver import check, cu
    check(cu.cuInit(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(ctx))


def step(path: str) -> None:
    import numpy as np
    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu
    from imp_runtime.executor_cuda import CudaExecutor
    _ctx()
    ex = CudaExecutor(load_bundle(path), kv_pages=64, use_graphs=False)
    sid = ex.new_sequence()
    logits = ex.prefill(sid, list(range(3, 19)))
    tok = [int(np.argmax(logits))]
    for _ in range(2):
        tok = ex.decode_sample([sid], tok)
    ex.synchronize()
    check(cu.cuProfilerStart())
    tok = ex.decode_sample([sid], tok)
    ex.synchronize()
    check(cu.cuProfilerStop())
    print("step done", tok)


def micro(path: str) -> None:
    import numpy as np
    import imp_runtime.executor_cuda as exc
    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu, dtoh, htod
    _ctx()
    ex = exc.CudaExecutor(load_bundle(path), kv_pages=64, use_graphs=False)
    s = ex.spec
    rng = np.random.default_rng(0)
    qkv_n = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
    shapes = [("qkv", qkv_n, s.hidden, False), ("o", s.hidden, s.n_heads * s.head_dim, False),
              ("gate_up", 2 * s.intermediate, s.hidden, True), ("down", s.hidden, s.intermediate, False)]
    rows = []
    for name, n, k, gated in shapes:
        wbytes = n * k // 2 + n * k // 16
        copies = max(2, (240 << 20) // wbytes + 1)
        lins = []
        for _ in range(copies):
            codes = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
            scales = rng.integers(0x28, 0x48, n * k // 16, dtype=np.uint8)
            pc, ps, pt = (int(check(cu.cuMemAlloc(x))) for x in (codes.nbytes, scales.nbytes, 4))
            htod(pc, codes, ex.stream), htod(ps, scales, ex.stream), htod(pt, np.ones(1, np.float32), ex.stream)
            lins.append(exc._Linear("nvfp4", n, k, pc, ps, pt))
        for m in (1, 8):
            pa = int(check(cu.cuMemAlloc(2 * m * k * 2)))
            htod(pa, exc.to_planes(rng.standard_normal((m, k)).astype(np.float32), exc.XF_F16X2), ex.stream)
            out = int(check(cu.cuMemAlloc(max(m, 16) * n * 4)))
            res = {}
            outs = {}
            variants = (False, True) if hasattr(exc, "GEMV_PIPE") else (None,)
            for pipe in variants:
                if pipe is not None:
                    exc.GEMV_PIPE = pipe
                run = (lambda L: ex.gated(pa, L, out, m, exc.XF_F16X2)) if gated else \
                      (lambda L: ex.linear(pa, L, out, m, 0, planes=True))
                for L in lins[:2]:
                    run(L)
                ex.synchronize()
                times = []
                for i in range(50):
                    e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
                    check(cu.cuEventRecord(e0, ex.stream))
                    run(lins[i % copies])
                    check(cu.cuEventRecord(e1, ex.stream))
                    check(cu.cuEventSynchronize(e1))
                    times.append(check(cu.cuEventElapsedTime(e0, e1)) * 1e3)
                    cu.cuEventDestroy(e0), cu.cuEventDestroy(e1)
                res[pipe] = statistics.median(times)
                run(lins[0]); ex.synchronize()
                outs[pipe] = dtoh(np.empty(m * n // 2 if gated else m * n, np.uint32), out, ex.stream)
            ideal = wbytes / 4.2e12 * 1e6
            line = f"{name:8s} N={n:6d} K={k:6d} m={m}: bytes at 4.2 TB/s {ideal:6.2f} us;"
            for v in variants:
                line += f" {'' if v is None else f'GEMV_PIPE={int(v)} '}{res[v]:7.2f} us ({100 * ideal / res[v]:3.0f}%)"
            if len(variants) == 2:
                line += f" bitwise-equal={bool(np.array_equal(outs[False], outs[True]))}"
            rows.append(line)
            print(rows[-1], flush=True)
    print("\n".join(["== micro"] + rows))


def table(files: list[str]) -> None:
    want = {"gpu__time_duration.sum": "dur_us", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
            "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%", "launch__registers_per_thread": "regs",
            "launch__grid_size": "grid", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
            "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue%"}
    for f in files:
        print(f"== {f}")
        rd = list(csv.reader(open(f)))
        hi = next(i for i, r in enumerate(rd) if r and r[0] == "ID")
        head, units, data = rd[hi], rd[hi + 1], rd[hi + 2:]
        idx = {h: i for i, h in enumerate(head)}
        stall_cols = [h for h in head if h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio")]
        for r in data:
            if len(r) < len(head):
                continue
            name = r[idx["Kernel Name"]][:26]
            vals = []
            for k, lab in want.items():
                if k in idx:
                    v = r[idx[k]].replace(",", "")
                    if k == "gpu__time_duration.sum" and units[idx[k]] in ("nsecond", "ns"):
                        v = f"{float(v) / 1e3:.2f}"
                    elif k == "gpu__time_duration.sum" and units[idx[k]] in ("msecond",):
                        v = f"{float(v) * 1e3:.2f}"
                    vals.append(f"{lab}={v}")
            st = []
            for h in stall_cols:
                try:
                    st.append((float(r[idx[h]].replace(",", "")), h[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]))
                except ValueError:
                    pass
            st.sort(reverse=True)
            print(f"{name:26s} " + " ".join(vals) + " stalls " + ", ".join(f"{n} {v:.1f}" for v, n in st[:4]))


if __name__ == "__main__":
    {"step": lambda: step(sys.argv[2]), "micro": lambda: micro(sys.argv[2]), "table": lambda: table(sys.argv[2:])}[sys.argv[1]]()
