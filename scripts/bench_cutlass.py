#!/usr/bin/env python
"""CUTLASS 3.x Hopper GEMMs (scripts/cutlass_gemm.cu, built by scripts/build_cutlass_gemm.sh) next to our wgmma GEMM
(gemm_wg256_f16, templates/gemm_wgmma.cu.j2) and cuBLAS, on Qwen3-8B's prefill shapes (issue 9). Needs torch with
CUDA, numpy and cuda-bindings (the GPU machine has them) and the library.

Checks first: every CUTLASS config against a float64 torch product, D = alpha * A @ W^T + beta * C with beta = 1
in place (C == D filled with 3.0, alpha 0.5: our residual add, mode 1) and beta = 0 (D filled with NaN beforehand,
no C: our plain store, mode 0), on a ragged shape (M=300, N=1000, K=200) and on each model shape at the first M;
error relative to |A| @ |W|^T as scripts/bench_gemm.py's checks, < 1e-5. Then TFLOP/s: each config timed in
alternation with torch.matmul bf16 (cuBLAS) by bench_gemm.timed_pair (o and down with beta = 1 in place, qkv and
gate_up with beta = 0), and ours (with a bundle or --cubin) the same way in mode 1 / mode 0.

Usage: scripts/bench_cutlass.py BUNDLE_OR_NONE [--cubin FILE] [--lib build/cutlass/libcutlass_gemm.so]
                                [--m 2048,4096] [--runs 10] [--configs 0,1,...] [--list]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gemm  # noqa: E402  (imports torch and cuda.bindings; adds ROOT to sys.path)
import torch  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}   # (N, K)
RESIDUAL = ("o", "down")          # beta = 1 in place (our mode 1); the others beta = 0 (mode 0)
RAGGED = (300, 1000, 200)         # M, N, K


class Cutlass:
    """libcutlass_gemm.so through ctypes."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        lib.cutlass_gemm_count.restype = ctypes.c_int
        lib.cutlass_gemm_count.argtypes = []
        lib.cutlass_gemm_name.restype = ctypes.c_char_p
        lib.cutlass_gemm_name.argtypes = [ctypes.c_int]
        lib.cutlass_gemm_last_error.restype = ctypes.c_char_p
        lib.cutlass_gemm_last_error.argtypes = []
        lib.cutlass_gemm_workspace.restype = ctypes.c_size_t
        lib.cutlass_gemm_workspace.argtypes = [ctypes.c_int] * 4
        lib.cutlass_gemm_run.restype = ctypes.c_int
        lib.cutlass_gemm_run.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_float] * 2 + [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.lib = lib
        self.count = lib.cutlass_gemm_count()
        self._ws: dict[tuple, torch.Tensor] = {}

    def name(self, config: int) -> str:
        return self.lib.cutlass_gemm_name(config).decode()

    def workspace(self, config: int, m: int, n: int, k: int) -> torch.Tensor | None:
        key = (config, m, n, k)
        if key not in self._ws:
            nbytes = self.lib.cutlass_gemm_workspace(config, m, n, k)
            self._ws[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda") if nbytes else None
        return self._ws[key]

    def call(self, config: int, a: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, d: torch.Tensor,
             alpha: float, beta: float, stream: int) -> int:
        """D = alpha * a @ w^T + beta * c (c may be d: in place; None with beta = 0). Returns the library's code."""
        m, k = a.shape
        n = w.shape[0]
        ws = self.workspace(config, m, n, k)
        return self.lib.cutlass_gemm_run(config, m, n, k, a.data_ptr(), w.data_ptr(),
                                         None if c is None else c.data_ptr(), d.data_ptr(), alpha, beta,
                                         None if ws is None else ws.data_ptr(), 0 if ws is None else ws.numel(),
                                         stream)

    def error(self, rc: int) -> str:
        return f"rc {rc}: {self.lib.cutlass_gemm_last_error().decode()}"


def check_shape(cut: Cutlass, configs, m: int, n: int, k: int, stream: int, g, refusal_ok: bool = False) -> list[str]:
    """Every config at one shape, beta 1 in place and beta 0, against float64. With refusal_ok, a config's
    can_implement refusing the shape is printed, not a failure."""
    fails = []
    a = (torch.randn((m, k), generator=g, device="cuda") * 0.5).half()
    w = (torch.randn((n, k), generator=g, device="cuda") * 0.5).half()
    prod = a.double() @ w.double().T
    scale = a.double().abs() @ w.double().abs().T            # the magnitude rounding errors live on
    for cfg in configs:
        c = torch.full((m, n), 3.0, device="cuda")
        rc = cut.call(cfg, a, w, c, c, 0.5, 1.0, stream)
        torch.cuda.synchronize()
        if rc == 1 and refusal_ok:
            print(f"config {cfg} cannot implement m={m} n={n} k={k}: {cut.error(rc)}")
            continue
        if rc:
            fails.append(f"config {cfg} m={m} n={n} k={k} beta 1: {cut.error(rc)}")
        else:
            err = ((c.double() - (3.0 + 0.5 * prod)).abs() / (0.5 * scale + 3.0)).max().item()
            if not err < 1e-5:
                fails.append(f"config {cfg} m={m} n={n} k={k} beta 1 in place: max rel err {err:.2e}")
        d = torch.full((m, n), float("nan"), device="cuda")
        rc = cut.call(cfg, a, w, None, d, 1.0, 0.0, stream)
        torch.cuda.synchronize()
        if rc:
            fails.append(f"config {cfg} m={m} n={n} k={k} beta 0: {cut.error(rc)}")
        else:
            err = ((d.double() - prod).abs() / scale).max().item()
            if not err < 1e-5:
                fails.append(f"config {cfg} m={m} n={n} k={k} beta 0: max rel err {err:.2e}")
    del prod, scale
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", help="a bundle whose cubin holds gemm_wg256_f16 (ours), or 'none'")
    ap.add_argument("--cubin", help="our kernels from this cubin instead of the bundle's")
    ap.add_argument("--lib", default=str(ROOT / "build/cutlass/libcutlass_gemm.so"))
    ap.add_argument("--m", default="2048,4096")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--configs", help="comma-separated CUTLASS config numbers (default: all)")
    ap.add_argument("--list", action="store_true", help="print the library's configs and exit (no GPU needed)")
    args = ap.parse_args()
    ms = [int(x) for x in args.m.split(",")]

    cut = Cutlass(Path(args.lib))
    configs = [int(x) for x in args.configs.split(",")] if args.configs else list(range(cut.count))
    for cfg in configs:
        if not 0 <= cfg < cut.count:
            ap.error(f"no config {cfg}: the library has {cut.count}")
        print(f"config {cfg}: {cut.name(cfg)}")
    if args.list:
        return 0

    cubin = None
    if args.cubin:
        cubin = Path(args.cubin)
    elif args.bundle.lower() != "none":
        bundle = Path(args.bundle)
        manifest = json.loads((bundle / "manifest.json").read_text())
        cubin = bundle / manifest["kernels"]["cubins"]["sm_90a"]

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    stream = torch.cuda.current_stream().cuda_stream
    mod = None
    if cubin is not None:
        mod = bench_gemm.Module(cubin.read_bytes())
        mod.set_max_dynamic_smem("gemm_wg256_f16", bench_gemm.WG_SMEM[256])
        print(f"ours: gemm_wg256_f16 from {cubin}")

    g = torch.Generator(device="cuda").manual_seed(0)
    fails = check_shape(cut, configs, *RAGGED, stream, g, refusal_ok=True)
    for name, (n, k) in SHAPES.items():
        fails += check_shape(cut, configs, ms[0], n, k, stream, g)
        torch.cuda.empty_cache()
    for f in fails:
        print("FAIL", f)
    print(f"checks: {'all passed' if not fails else f'{len(fails)} failed'}", flush=True)
    bad = {int(f.split()[1]) for f in fails}          # configs that failed a check are not timed

    rows = []
    for m in ms:
        for name, (n, k) in SHAPES.items():
            a16 = (torch.randn((m, k), device="cuda") * 0.5).half()
            w16 = (torch.randn((n, k), device="cuda") * 0.5).half()
            ab, wb = a16.bfloat16(), w16.bfloat16()
            c = torch.zeros((m, n), device="cuda")
            beta = 1.0 if name in RESIDUAL else 0.0
            flop = 2.0 * m * n * k
            cublas = lambda: torch.matmul(ab, wb.T)  # noqa: E731
            res = {"gemm": name, "M": m, "N": n, "K": k, "beta": beta}
            cub = []
            for cfg in configs:
                if cfg in bad:
                    continue

                def run(cfg=cfg):
                    rc = cut.call(cfg, a16, w16, c if beta else None, c, 1.0, beta, stream)
                    if rc:
                        raise RuntimeError(f"config {cfg} {name} M={m}: {cut.error(rc)}")

                try:
                    ms_, ref_ms = bench_gemm.timed_pair(run, cublas, args.runs)
                except RuntimeError as e:
                    print("FAIL", e)
                    res[f"c{cfg}_ms"] = res[f"c{cfg}_tflops"] = float("nan")
                    continue
                res[f"c{cfg}_ms"], res[f"c{cfg}_tflops"] = ms_, flop / ms_ / 1e9
                cub.append(ref_ms)
            if mod is not None:
                mode = 1 if beta else 0
                ms_, ref_ms = bench_gemm.timed_pair(
                    lambda: bench_gemm.wg_gemm(mod, a16, w16, c, 256, mode=mode, stream=stream), cublas, args.runs)
                res["ours_ms"], res["ours_tflops"] = ms_, flop / ms_ / 1e9
                cub.append(ref_ms)
            if not cub:
                cub.append(bench_gemm.timed(cublas, args.runs))
            ms_ = statistics.median(cub)
            res["cublas_ms"], res["cublas_tflops"] = ms_, flop / ms_ / 1e9
            rows.append(res)
            print(json.dumps(res), flush=True)

    timed_cfgs = [cfg for cfg in configs if cfg not in bad]
    head = ["GEMM (beta)", "M", "N", "K"] + [f"c{cfg}" for cfg in timed_cfgs] + [
        "best CUTLASS / ours", "ours wg256", "cuBLAS bf16"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for r in rows:
        vals = [r[f"c{cfg}_tflops"] for cfg in timed_cfgs]
        ok = [v for v in vals if v == v]                  # not NaN
        ours = r.get("ours_tflops")
        cells = [f"{r['gemm']} ({r['beta']:.0f})", str(r["M"]), str(r["N"]), str(r["K"])]
        cells += [f"{v:.0f}" if v == v else "fail" for v in vals]
        cells += [f"{max(ok) / ours:.2f}" if ok and ours else "-", f"{ours:.0f}" if ours else "-",
                  f"{r['cublas_tflops']:.0f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"(TFLOP/s; medians of {args.runs} samples; beta 1: D = C + A W^T in place, float32, as our mode 1; "
          "cuBLAS: bf16 out, no add)")
    for cfg in timed_cfgs:
        print(f"c{cfg}: {cut.name(cfg)}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
