#!/usr/bin/env python
"""The prefill GEMMs of a bundle, alone: correctness against torch and TFLOP/s next to torch.matmul (bf16,
cuBLAS) on the same shapes in the same process. Needs torch with CUDA (the GPU machine has it).

For every linear shape of the model (qkv, o, gate_up, down) at each M: the wgmma GEMM (templates/
gemm_wgmma.cu.j2) on fp16 operands, the NVFP4 -> fp16 expansion it runs before (dequant_nvfp4_f16), the
mma.sync GEMM it replaces (gemm_nvfp4_f16, templates/gemm.cu.j2), CUTLASS's kernel where the bundle was compiled with
`--prefill-gemm cutlass` (its program's Params tables, launched as the runtime does), and cuBLAS bf16. Medians of --runs timed
samples (CUDA events around back-to-back calls, after a sustained warm-up); o and down add into their float32 output as the model's residual adds do (mode 1), and
each wgmma repetition alternates with a cuBLAS one, so both columns see the same clocks. Checks first: the expansion against runtime/nvfp4.py's exact dequantization, and
each wgmma tile shape against torch's float32 product (ragged M, K not a multiple of 64, mode 1 adds).

Usage: scripts/bench_gemm.py BUNDLE [--m 512,4096] [--runs 5] [--cubin FILE]
       scripts/bench_gemm.py BUNDLE --profile GEMM,MODE,M,KERNEL    (one launch for ncu, see profile_one)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from impc.launch_linear import wg_smem_bytes  # noqa: E402
from imp_runtime.cuda_driver import Module, check, tensor_map  # noqa: E402
from imp_runtime.nvfp4 import dequantize  # noqa: E402

WG_SMEM = {bn: wg_smem_bytes(bn) for bn in (128, 256)}


def launch(mod: Module, name: str, grid, block, smem: int, args: list, stream) -> None:
    vals = []
    for a in args:
        if isinstance(a, ctypes.Array) or isinstance(a, ctypes._SimpleCData):
            vals.append(a)
        elif isinstance(a, float):
            vals.append(ctypes.c_float(a))
        elif isinstance(a, torch.Tensor):
            vals.append(ctypes.c_uint64(a.data_ptr()))
        elif a is None:
            vals.append(ctypes.c_uint64(0))
        else:
            vals.append(ctypes.c_int32(a))
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    check(cu.cuLaunchKernel(mod.func(name), *grid, *block, smem, stream, ctypes.addressof(params), 0))


def wg_gemm(mod, a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, bn, mode: int = 0, tscale=None,
            unscale: float = 1.0, stream=0) -> None:
    """gemm_wg<bn> (bn 128 or 256), or the persistent ping-pong gemm_wgp (bn "p": 128 x 128 tiles, a block an SM)."""
    m, k = a.shape
    n = w.shape[0]
    dt = "f16" if a.dtype == torch.float16 else "bf16"
    if bn == "p":
        ta, tw = tensor_map(a.data_ptr(), dt, m, k, 128, 64), tensor_map(w.data_ptr(), dt, n, k, 128, 64)
        tiles = -(-n // 128) * -(-m // 128)
        launch(mod, f"gemm_wgp_{dt}", (min(tiles, sm_count()), 1, 1), (384, 1, 1), WG_SMEM[128],
               [ta, tw, c, tscale, float(unscale), m, n, k, mode, None, None], stream)
        return
    ta = tensor_map(a.data_ptr(), dt, m, k, 128, 64)
    tw = tensor_map(w.data_ptr(), dt, n, k, bn, 64)
    launch(mod, f"gemm_wg{bn}_{dt}", ((n + bn - 1) // bn, (m + 127) // 128, 1), (384, 1, 1), WG_SMEM[bn],
           [ta, tw, c, tscale, float(unscale), m, n, k, mode, None, None], stream)     # no split-K: no ws, flags


class _Addresses:
    """The arena a CutlassParams encodes its descriptors over: torch tensors by operand name."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def ptr(self, name: str) -> int:
        return self.tensors[name].data_ptr()


def cutlass_tables(bundle: Path, manifest: dict) -> dict:
    """--prefill-gemm cutlass bundles (impc/cutlass.py): the program's Params tables by (N, K, mode)."""
    if "sm_90a" not in manifest["kernels"].get("cutlass_cubins", {}):
        return {}
    prog = json.loads((bundle / manifest["kernels"]["programs"]["sm_90a"]).read_text())
    return {(t["n"], t["k"], int(t["beta"])): t for t in prog["constants"].get("cutlass", {}).values()}


def cutlass_launcher(mod, table: dict, a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, m: int, scale, stream):
    """A function launching the table's CUTLASS kernel over a (at least the table's rows), w and c (in place: C = D) at
    m rows, as the runtime does (runtime/cuda_program.py CutlassParams)."""
    from imp_runtime.cuda_program import CutlassParams
    arg = {"rows": m, "A": "A", "W": "W", "C": "C", "D": "C", "scale": "S"}
    p = CutlassParams(table, arg, _Addresses({"A": a, "W": w, "C": c, "S": scale}))
    grid = p.for_rows(m)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(p.buf))
    func = mod.func(table["kernel"])

    def run():
        check(cu.cuLaunchKernel(func, *grid, *table["block"], table["smem"], stream, ctypes.addressof(params), 0))
    run.keep = (p, params)          # (the Params bytes live as long as the function)
    return run


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def timed(fn, runs: int) -> float:
    """Median milliseconds of fn() over `runs` timed samples (after a warm-up)."""
    return timed_pair(fn, None, runs)[0]


def timed_pair(fn, ref, runs: int, sample_ms: float = 5.0, warm_ms: float = 200.0) -> tuple[float, float]:
    """Median milliseconds of one fn() and of one ref() (None: fn alone). Each sample times enough back-to-back calls
    to fill ~sample_ms, after ~warm_ms of the same work: one call timed alone (a third of a millisecond for the o
    projection at M = 4096) started at whatever clock the GPU had idled down to, and cuBLAS's own figure for one
    shape moved from 488 to 680 TFLOP/s between calls. Samples of fn and ref alternate, so both see the same clock
    and power state."""
    fns = [f for f in (fn, ref) if f is not None]
    reps = []
    for f in fns:                                   # calls a sample: from one call's time, after a first warm-up
        f()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        f()
        e1.record()
        torch.cuda.synchronize()
        reps.append(max(1, int(sample_ms / max(e0.elapsed_time(e1), 1e-3))))
    t_end = time.perf_counter() + warm_ms / 1e3
    while time.perf_counter() < t_end:
        for f, r in zip(fns, reps):
            for _ in range(r):
                f()
        torch.cuda.synchronize()
    out = [[] for _ in fns]
    for _ in range(runs):
        for f, r, o in zip(fns, reps, out):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(r):
                f()
            e1.record()
            torch.cuda.synchronize()
            o.append(e0.elapsed_time(e1) / r)
    med = [statistics.median(o) for o in out]
    return med[0], (med[1] if ref is not None else float("nan"))


def checks(mod, stream) -> list[str]:
    fails = []
    g = torch.Generator(device="cuda").manual_seed(0)
    # NVFP4 expansion against the exact numpy dequantization (tscale 1): fp16 holds q * s * 2^-14.
    n, k = 256, 4096
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    scales = torch.randint(0x08, 0x78, (n, k // 16), dtype=torch.uint8, device="cuda", generator=g)
    out = torch.empty((n, k), dtype=torch.float16, device="cuda")
    launch(mod, "dequant_nvfp4_f16", (64, 1, 1), (256, 1, 1), 0, [codes, scales, out, ctypes.c_uint64(n * k // 16), k // 16, 0], stream)
    torch.cuda.synchronize()
    ref = dequantize(codes.cpu().numpy(), scales.cpu().numpy(), 1.0, k)
    got = out.float().cpu().numpy() * 2.0 ** 14
    if not np.array_equal(got, ref):
        fails.append(f"dequant_nvfp4_f16: {int((got != ref).sum())} of {got.size} values differ")
    for dt in (torch.float16, torch.bfloat16):
        for bn in (128, 256, "p"):
            for (m, n, k) in ((300, 1000, 200), (4100, 1000, 336), (128, 256, 64), (513, 768, 1000), (64, 4096, 4096)):
                a = (torch.randn((m, k), generator=g, device="cuda") * 0.5).to(dt)
                w = (torch.randn((n, k), generator=g, device="cuda") * 0.5).to(dt)
                c = torch.full((m, n), 3.0, device="cuda")
                wg_gemm(mod, a, w, c, bn, mode=1, unscale=0.5, stream=stream)
                torch.cuda.synchronize()
                ref = 3.0 + 0.5 * (a.double() @ w.double().T)
                scale = a.double().abs() @ w.double().abs().T       # the magnitude rounding errors live on
                err = ((c.double() - ref).abs() / (0.5 * scale + 3.0)).max().item()
                if not err < 1e-5:
                    fails.append(f"gemm_wg{bn} {dt} m={m} n={n} k={k} mode 1: max rel err {err:.2e}")
                c2 = torch.empty((m, n), device="cuda")
                wg_gemm(mod, a, w, c2, bn, mode=0, unscale=1.0, stream=stream)
                torch.cuda.synchronize()
                err = ((c2.double() - (ref - 3.0) / 0.5).abs() / scale).max().item()
                if not err < 1e-5:
                    fails.append(f"gemm_wg{bn} {dt} m={m} n={n} k={k} mode 0: max rel err {err:.2e}")
    return fails


def layer_shapes(manifest: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of layer 0's NVFP4 linears by name (qkv, o, gate_up, down): the GEMMs timed."""
    return {n.split(".")[-1]: tuple(t["shape"]) for n, t in manifest["quantization"]["tensors"].items()
            if n.startswith("layers.0.") and t["format"] == "nvfp4"}


def profile_one(mod, manifest: dict, spec: str, stream) -> int:
    """One wgmma GEMM launch between cudaProfilerStart and Stop, after a warm-up of the same launch, for
    `ncu --profile-from-start off --set full -o OUT python scripts/bench_gemm.py BUNDLE --profile gate_up,2,2048,p`:
    spec is the layer linear (qkv, o, gate_up, down), the mode (0 store, 1 add, 2 gated fp16 out), M and the kernel
    (128 / 256: gemm_wg<BN>, p: the persistent ping-pong gemm_wgp)."""
    try:
        name, mode, m, kern = spec.split(",")
        mode, m = int(mode), int(m)
        bn = kern if kern == "p" else int(kern)
    except ValueError:
        print(f"--profile: expected GEMM,MODE,M,KERNEL (e.g. gate_up,2,2048,p), got {spec!r}", file=sys.stderr)
        return 2
    shapes = layer_shapes(manifest)
    if name not in shapes or mode not in (0, 1, 2) or bn not in (128, 256, "p"):
        print(f"--profile: GEMM one of {sorted(shapes)}, MODE 0-2, KERNEL 128, 256 or p", file=sys.stderr)
        return 2
    n, k = shapes[name]
    a = (torch.randn((m, k), device="cuda") * 0.5).half()
    w = (torch.randn((n, k), device="cuda") * 0.5).half()
    c = torch.empty((m, n // 2), dtype=torch.float16, device="cuda") if mode == 2 else torch.zeros((m, n), device="cuda")
    for _ in range(3):
        wg_gemm(mod, a, w, c, bn, mode=mode, stream=stream)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    wg_gemm(mod, a, w, c, bn, mode=mode, stream=stream)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one launch: {name} (N {n}, K {k}) mode {mode} M {m} on {'gemm_wgp' if bn == 'p' else f'gemm_wg{bn}'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--cubin", help="use this cubin instead of the bundle's")
    ap.add_argument("--m", default="128,512,2048,4096")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--wgmma-only", action="store_true", help="time the wgmma GEMMs and cuBLAS only (no "
                    "expansion or mma.sync columns)")
    ap.add_argument("--profile", metavar="GEMM,MODE,M,KERNEL", help="no checks or table: one launch of that GEMM "
                    "between cudaProfilerStart and Stop, for ncu --profile-from-start off (e.g. gate_up,2,2048,p)")
    args = ap.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    cubin = Path(args.cubin) if args.cubin else bundle / manifest["kernels"]["cubins"]["sm_90a"]
    tables = cutlass_tables(bundle, manifest)
    more = [(bundle / manifest["kernels"]["cutlass_cubins"]["sm_90a"]).read_bytes()] if tables else []
    mod = Module(cubin.read_bytes(), *more)
    for t in tables.values():
        mod.set_max_dynamic_smem(t["kernel"], t["smem"])
    for bn, smem in WG_SMEM.items():
        for dt in ("f16", "bf16"):
            mod.set_max_dynamic_smem(f"gemm_wg{bn}_{dt}", smem)
            if bn == 128:
                mod.set_max_dynamic_smem(f"gemm_wgp_{dt}", smem)
    stream = torch.cuda.current_stream().cuda_stream
    if args.profile:
        return profile_one(mod, manifest, args.profile, stream)
    fails = checks(mod, stream)
    for f in fails:
        print("FAIL", f)
    print(f"checks: {'all passed' if not fails else f'{len(fails)} failed'}")
    shapes = layer_shapes(manifest)
    rows = []
    for m in (int(x) for x in args.m.split(",")):
        for name, (n, k) in shapes.items():
            a16 = (torch.randn((m, k), device="cuda") * 0.5).half()
            w16 = (torch.randn((n, k), device="cuda") * 0.5).half()
            ab, wb = a16.bfloat16(), w16.bfloat16()
            c = torch.empty((m, n), device="cuda")
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            scales = torch.randint(0x30, 0x38, (n, k // 16), dtype=torch.uint8, device="cuda")
            ts = torch.ones(1, device="cuda")
            flop = 2.0 * m * n * k
            res = {"gemm": name, "M": m, "N": n, "K": k}
            # o and down add into the float32 residual in the model (mode 1), qkv stores (mode 0); each against cuBLAS
            # in alternation (its column: the median of these runs)
            mode = 1 if name in ("o", "down") else 0
            cub = []
            for bn in (128, 256, "p"):
                ms, ref_ms = timed_pair(lambda: wg_gemm(mod, a16, w16, c, bn, mode=mode, stream=stream),
                                        lambda: torch.matmul(ab, wb.T), args.runs)
                res[f"wg{bn}_ms"], res[f"wg{bn}_tflops"] = ms, flop / ms / 1e9
                cub.append(ref_ms)
            res["mode"] = mode
            if args.wgmma_only:
                res.update(dequant_ms=float("nan"), dequant_gbs=float("nan"), mma_sync_ms=float("nan"),
                           mma_sync_tflops=float("nan"))
            if name == "gate_up":      # the prefill's gate_up: act(gate) * up in the epilogue, fp16 out (mode 2)
                g = torch.empty((m, n // 2), dtype=torch.float16, device="cuda")
                for bn in (256, "p"):
                    ms = timed(lambda: wg_gemm(mod, a16, w16, g, bn, mode=2, stream=stream), args.runs)
                    key = "gated" if bn == 256 else "gatedp"
                    res[f"{key}_ms"], res[f"{key}_tflops"] = ms, flop / ms / 1e9
            if not args.wgmma_only:
                ms = timed(lambda: launch(mod, "dequant_nvfp4_f16", (132 * 8, 1, 1), (256, 1, 1), 0,
                                          [codes, scales, w16, ctypes.c_uint64(n * k // 16), k // 16, 0], stream), args.runs)
                res["dequant_ms"], res["dequant_gbs"] = ms, (n * k * (0.5 + 1 / 16 + 2)) / ms / 1e6
                ms = timed(lambda: launch(mod, "gemm_nvfp4_f16", ((n + 127) // 128, (m + 63) // 64, 1), (256, 1, 1), 0,
                                          [a16, codes, scales, ts, c, m, n, k, 0], stream), args.runs)
                res["mma_sync_ms"], res["mma_sync_tflops"] = ms, flop / ms / 1e9
            t = tables.get((n, k, mode))
            if t is not None and m <= t["rows_max"]:
                # CUTLASS's kernel from the bundle's program (--prefill-gemm cutlass): fp16 operands scaled by a tensor
                # scale (NVFP4's copies) or bf16; checked against torch's float32 product, then timed against cuBLAS
                f16 = t["fmt"] == "f16"
                a_big = torch.zeros((t["rows_max"], k), dtype=torch.float16 if f16 else torch.bfloat16, device="cuda")
                a_big[:m] = a16 if f16 else ab
                c_big = torch.zeros((t["rows_max"], n), device="cuda")
                scale = torch.full((1,), 1.0 / t.get("alpha", 1.0), device="cuda")
                run = cutlass_launcher(mod, t, a_big, w16 if f16 else wb, c_big, m, scale, stream)
                run()
                torch.cuda.synchronize()
                want = a_big[:m].float() @ (w16 if f16 else wb).float().T      # (C was zero: mode 1 adds to 0)
                res["cutlass_err"] = float(((c_big[:m] - want).abs().max() / want.abs().max()).item())
                ms, ref_ms = timed_pair(run, lambda: torch.matmul(ab, wb.T), args.runs)
                res["cutlass_ms"], res["cutlass_tflops"] = ms, flop / ms / 1e9
                cub.append(ref_ms)
            ms = statistics.median(cub)
            res["cublas_ms"], res["cublas_tflops"] = ms, flop / ms / 1e9
            rows.append(res)
            print(json.dumps(res), flush=True)
    print("\n| GEMM (mode) | M | N | K | wgmma 128 | wgmma 256 | persistent ping-pong | gated: wgmma 256 / ping-pong | "
          "dequant (GB/s) | mma.sync | CUTLASS (max rel err) | cuBLAS bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        gated = f"{r['gated_tflops']:.0f} / {r['gatedp_tflops']:.0f}" if "gated_tflops" in r else "-"
        cut = f"{r['cutlass_tflops']:.0f} ({r['cutlass_err']:.1e})" if "cutlass_tflops" in r else "-"
        print(f"| {r['gemm']} ({r['mode']}) | {r['M']} | {r['N']} | {r['K']} | {r['wg128_tflops']:.0f} | {r['wg256_tflops']:.0f} | "
              f"{r['wgp_tflops']:.0f} | {gated} | "
              f"{r['dequant_ms'] * 1e3:.0f} us ({r['dequant_gbs']:.0f}) | {r['mma_sync_tflops']:.0f} | {cut} | "
              f"{r['cublas_tflops']:.0f} |")
    print("(TFLOP/s; medians of", args.runs, "runs)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
