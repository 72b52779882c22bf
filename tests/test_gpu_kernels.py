"""Each kernel launch of a compiled launch program against its kernel family's numpy reference, on the GPU.

A test takes a launch from the bundle's program (runtime/program.py) — its kernel, grid, arguments and
buffers exactly as the decode graphs and prefill run them — writes fresh random inputs into the buffers
the launch reads (random weights too, overwriting the bundle's), poisons what it writes (0xFF bytes: NaN),
runs that one launch and compares every output element with the reference: executor_cpu's functions,
runtime/nvfp4.dequantize, runtime/rope, all in float64. No argument list is written here.

Tolerances (relative error: max |gpu - ref| / max |ref|): <= 1e-2 for fp16/bf16 outputs and for the GEMMs
(their activations are fp16/bf16); <= 1e-4 for the decode GEMV, which takes float32 activations as hi/lo
x planes and must follow float32 (rows whose NVFP4 block scales are tiny included), and for x planes.
"""
from __future__ import annotations

import numpy as np
import pytest

try:
    from tests.gpu_common import gpu_bundle, have_gpu, random_float_rows, random_int8_rows, random_nvfp4
except ImportError:
    from gpu_common import gpu_bundle, have_gpu, random_float_rows, random_int8_rows, random_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs an NVIDIA GPU")]

BUNDLES = ["llama", "llama-qe", "llama-i8", "syn-qwen3-0.6b", "syn-gemma3-hd256", "qwen3-wide", "qwen3-wide-i8",
           "qwen3-pen"]
TOL, TOL_F32 = 1e-2, 1e-4


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the kernel's output (an element left unwritten?)"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def bf16_bits(a):
    from impc.quantize import to_bf16_bits
    return to_bf16_bits(np.asarray(a, np.float32))


def bf16_round(a):
    from imp_runtime.bundle import bf16_to_f32
    return bf16_to_f32(bf16_bits(a)).reshape(np.shape(a))


def f16_round(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


# ------------------------------------------------------------------ the program and the arena


@pytest.fixture(scope="module", params=BUNDLES)
def ex(request):
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    e = CudaExecutor(load_bundle(gpu_bundle(request.param)), use_graphs=False)
    yield e
    e.close()


def find(ex, phase: str, tokens: int, prefix: str, nth: int = 0) -> tuple[int, object]:
    hits = [(i, x) for i, x in enumerate(ex.program.phase(phase, tokens).launches) if x.kernel.startswith(prefix)]
    if len(hits) <= nth:
        pytest.skip(f"the {phase} {tokens} program launches no {prefix} #{nth}")
    return hits[nth]


def buf(x, i: int) -> str:
    return x.args[i]["ptr"]


def scalar(x, i: int) -> int:
    (v,) = x.args[i].values()
    return v


def put(ex, name: str, arr, offset: int = 0) -> None:
    from imp_runtime.cuda_driver import htod
    arr = np.ascontiguousarray(arr)
    assert offset + arr.nbytes <= ex.program.buffers[name].bytes, f"test writes past {name}"
    htod(ex.arena.ptr(name, offset), arr, ex.stream)


def get(ex, name: str, dtype, count: int, offset: int = 0) -> np.ndarray:
    from imp_runtime.cuda_driver import dtoh
    return dtoh(np.empty(count, dtype), ex.arena.ptr(name, offset), ex.stream)


def poison(ex, name: str) -> None:
    from imp_runtime.cuda_driver import check, cu
    check(cu.cuMemsetD8Async(ex.arena.ptr(name), 0xFF, ex.program.buffers[name].bytes, ex.stream))


def run(ex, phase: str, tokens: int, index: int, **env) -> None:
    ex.run_launch(phase, tokens, index, env)
    ex.synchronize()


def activation(ex, name: str, rows: int, k: int, fmt: int) -> np.ndarray:
    from imp_runtime.activation_formats import XF_BF16, XF_F16, XF_F16W, read_activation
    n = rows * k if fmt in (XF_BF16, XF_F16, XF_F16W) else 2 * rows * k
    return read_activation(get(ex, name, np.uint16, n), rows, k, fmt)


XF_F16X2_HI = -1     # (tests) XF_F16X2 planes written, the hi plane alone read: a streamed GEMV's input (ring_read)


def gemv_input_format(kernel: str, fmt: str) -> int:
    """The activation format a decode GEMV kernel over weights of format fmt reads (put_activation's fmt)."""
    from imp_runtime.activation_formats import xfmt
    return XF_F16X2_HI if kernel.startswith("gemv_ring") else xfmt(fmt)


def put_activation(ex, name: str, a: np.ndarray, fmt: int) -> np.ndarray:
    """Write float32 a [rows, k] into an activation buffer in format fmt; the float32 its reader multiplies."""
    from imp_runtime.activation_formats import (XF_BF16, XF_F16, XF_F16_SCALE, XF_F16W, XF_F16X2, ring_read, to_planes,
                                                write_activation)
    if fmt == XF_F16X2_HI:
        put(ex, name, to_planes(a, XF_F16X2))
        return ring_read(a)
    if fmt in (XF_F16, XF_F16W):
        put(ex, name, write_activation(a, fmt))
        return (a * np.float32(XF_F16_SCALE)).astype(np.float16).astype(np.float32) / np.float32(XF_F16_SCALE)
    if fmt == XF_BF16:
        put(ex, name, bf16_bits(a))
        return bf16_round(a)
    put(ex, name, to_planes(a, fmt))
    return a


def random_weights(ex, x, w_args: list[int], n: int, k: int, rng, tiny_rows: int = 0) -> np.ndarray:
    """Random weights [n, k] with row scales spanning 30x (the first tiny_rows scaled by 1e-4, so their block
    scales sit far below the tensor's) written over the launch's weight buffers (its arguments w_args: codes,
    scales and tscale of NVFP4, or one bf16 buffer); their exact values."""
    return put_random_weights(ex, [buf(x, i) for i in w_args], n, k, rng, tiny_rows)


def put_random_weights(ex, names: list[str], n: int, k: int, rng, tiny_rows: int = 0) -> np.ndarray:
    """random_weights over named buffers (NVFP4 codes, scales, tscale; INT8 codes, rscale; or one bf16 buffer),
    drawn as stored (tests/gpu_common.py random_nvfp4, random_int8_rows)."""
    if len(names) == 2:
        q = random_int8_rows(n, k, rng, tiny_rows)
        put(ex, names[0], q.codes)
        put(ex, names[1], q.rscale)
        return q.dequantize()
    if len(names) == 3:
        q = random_nvfp4(n, k, rng, tiny_rows)
        for name, arr in zip(names, (q.codes, q.scales, q.tscale)):
            put(ex, name, arr)
        return q.dequantize()
    w = random_float_rows(n, k, rng, tiny_rows)
    put(ex, names[0], bf16_bits(w))
    return bf16_round(w)


def dot_rel(got, ref, a, w, base=None) -> float:
    """Worst error of each output element relative to the sum of the magnitudes of its products,
    sum_k |a_mk w_nk| (plus |base| for a residual add): the scale rounding errors of a dot product live on.
    Every element is held to its own scale, so rows of weights 1e-4 smaller than the rest (tiny NVFP4 block
    scales) and outputs near zero by cancellation are checked as strictly as the large ones; a tolerance
    relative to the global maximum would let small rows be 30% wrong."""
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in the kernel's output (an element left unwritten?)"
    scale = np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    if base is not None:
        scale = scale + np.abs(base)
    return float(np.max(np.abs(got - ref) / np.maximum(scale, 1e-30)))


# ------------------------------------------------------------------ linear layers


def rope_tail_slots(ex, x, rows: int) -> None:
    """A qkv GEMV with the rope tail (gemv_ring3_rope_*) writes q and the KV pages at the step's positions and slots:
    give its rows position 0 and slots 0..rows-1 in the pool (test_decode_gemv_rope_tail checks what it writes)."""
    if "_rope_" in x.kernel:
        put(ex, "positions", np.zeros(rows, np.int32))
        put(ex, "kv_slots", np.arange(rows, dtype=np.int32))


def check_linear(ex, phase: str, tokens: int, index: int, x, m: int, rng, env: dict) -> None:
    """A GEMV or GEMM launch: out[m, N] (= | +=) a[m, K] @ W^T, with the activation format it reads."""
    from imp_runtime.activation_formats import gfmt
    if x.kernel.startswith("gemm_wg"):
        return check_wgmma(ex, phase, tokens, index, x, m, rng, env)
    if x.kernel.startswith("gemm_wq"):
        return check_wq(ex, phase, tokens, index, x, m, rng, env)
    fmt = next((f for f in ("nvfp4", "int8") if f in x.kernel), "bf16")
    nw = {"nvfp4": 3, "int8": 2}.get(fmt, 1)
    a_name, out = buf(x, 0), buf(x, 1 + nw)
    if x.kernel.startswith("gemv"):
        n, k, mode = scalar(x, 2 + nw), scalar(x, 3 + nw), scalar(x, 5 + nw)
        afmt, tol = gemv_input_format(x.kernel, fmt), TOL_F32
    else:
        n, k, mode = scalar(x, 3 + nw), scalar(x, 4 + nw), scalar(x, 5 + nw)
        afmt, tol = gfmt(fmt), TOL
    wref = random_weights(ex, x, list(range(1, 1 + nw)), n, k, rng, tiny_rows=min(40, n // 4))
    check_product(ex, phase, tokens, index, x, m, rng, env, a_name, out, n, k, mode, afmt, tol, wref)


def check_wgmma(ex, phase: str, tokens: int, index: int, x, m: int, rng, env: dict) -> None:
    """The Hopper prefill GEMM (TMA + wgmma): its operands are tensor maps; NVFP4 weights reach it as the
    fp16 expansion that dequant_nvfp4_f16 writes, at load (the init phase) or just before it."""
    from imp_runtime.activation_formats import gfmt
    a_name, w_name, out = x.args[0]["tmap"]["ptr"], x.args[1]["tmap"]["ptr"], buf(x, 2)
    n, k, mode = scalar(x, 6), scalar(x, 7), scalar(x, 8)
    if x.kernel.endswith("_f16"):
        lin = buf(x, 3)[:-len(".tscale")]
        wref = put_random_weights(ex, [f"{lin}.codes", f"{lin}.scales", f"{lin}.tscale"], n, k, rng,
                                  tiny_rows=min(40, n // 4))
        poison(ex, w_name)
        expand = [(ph, i) for ph, launches in (("init", ex.program.phase("init", 0).launches),
                                                (phase, ex.program.phase(phase, tokens).launches[:index]))
                  for i, y in enumerate(launches) if y.kernel == "dequant_nvfp4_f16" and buf(y, 2) == w_name
                  and buf(y, 0) == lin + ".codes"]
        assert expand, f"no launch expands {lin} into {w_name}"
        ph, i = expand[-1]
        ex.run_launch(ph, 0 if ph == "init" else tokens, i, env)
        afmt = gfmt("nvfp4")
        if mode >= 2:
            return check_gated(ex, phase, tokens, index, m, rng, env, a_name, out, n, k, mode, afmt, wref)
    else:
        wref = put_random_weights(ex, [w_name], n, k, rng)
        afmt = gfmt("bf16")
    check_product(ex, phase, tokens, index, x, m, rng, env, a_name, out, n, k, mode, afmt, TOL, wref)


def check_wq(ex, phase: str, tokens: int, index: int, x, m: int, rng, env: dict) -> None:
    """The Hopper decode GEMM that reads NVFP4 codes and scales as stored and expands them in shared memory:
    against the float64 product of runtime/nvfp4.dequantize's weights (rows with tiny block scales included)."""
    from imp_runtime.activation_formats import XF_F16W
    a_name, lin, out = x.args[0]["tmap"]["ptr"], x.args[1]["tmap"]["ptr"][:-len(".codes")], buf(x, 3)
    n, k, mode = scalar(x, 7), scalar(x, 8), scalar(x, 9)
    wref = put_random_weights(ex, [f"{lin}.codes", f"{lin}.scales", f"{lin}.tscale"], n, k, rng,
                              tiny_rows=min(40, n // 4))
    if mode >= 2:
        return check_gated(ex, phase, tokens, index, m, rng, env, a_name, out, n, k, mode, XF_F16W, wref)
    check_product(ex, phase, tokens, index, x, m, rng, env, a_name, out, n, k, mode, XF_F16W, TOL, wref)


def check_gated(ex, phase, tokens, index, m, rng, env, a_name, out, n, k, mode, afmt, wref) -> None:
    """gate_up with act(gate) * up in the GEMM's epilogue (modes 2, 3): the down projection's activation,
    against executor_cpu.gated_act of the float64 product. Each element is held to the rounding its inputs
    carry: the products' magnitudes sum_k |a w| of its gate (times |act'| <= 1.13 and |up|) and of its up
    (times |act(gate)|), plus the 16-bit output's own rounding (XF_F16 holds v * 2^-6: below 2^-8, v lands in
    fp16's subnormals, an absolute step of 2^-19)."""
    from imp_runtime.activation_formats import XF_BF16, XF_F16, XF_F16W
    from imp_runtime.executor_cpu import gated_act, gelu_tanh, silu
    a = (rng.standard_normal((m, k)) * rng.uniform(0.01, 3, (1, k)) / np.sqrt(k)).astype(np.float32)
    a = put_activation(ex, a_name, a, afmt)
    gu = a.astype(np.float64) @ wref.T.astype(np.float64)
    ref = gated_act(gu, ex.spec.activation)
    poison(ex, out)
    run(ex, phase, tokens, index, **env)
    inter = n // 2
    got = activation(ex, out, m, inter, {2: XF_F16, 3: XF_BF16, 4: XF_F16W}[mode])
    scale = np.abs(a.astype(np.float64)) @ np.abs(wref.astype(np.float64)).T
    act = silu if ex.spec.activation == "silu" else gelu_tanh
    bound = 1.13 * np.abs(gu[:, inter:]) * scale[:, :inter] + np.abs(act(gu[:, :inter])) * scale[:, inter:]
    ulp = 2.0 ** (-7 if mode == 3 else -10)
    err = np.abs(got - ref) - ulp * np.abs(ref) - (0.0 if mode == 3 else 2.0 ** -19)
    worst = float(np.max(err / np.maximum(bound, 1e-30)))
    assert worst <= TOL, f"gated gate_up, {m} rows: error {worst:.2e} of the inputs' rounding scale"


def check_product(ex, phase, tokens, index, x, m, rng, env, a_name, out, n, k, mode, afmt, tol, wref) -> None:
    a = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30, (1, k))).astype(np.float32)
    a = put_activation(ex, a_name, a, afmt)
    ref = (a.astype(np.float64) @ wref.T.astype(np.float64)) * ring_norm_scale(ex, x, m, k, rng)
    base = rng.standard_normal((m, n)).astype(np.float32)
    prev = ex.program.phase(phase, tokens).launches[index - 1]
    zeroed = prev.kernel == "fill_f32" and buf(prev, 0) == out     # atomic split-K of a store: zeroed first
    if mode and not zeroed:            # a residual add (mode 1, or 2: split-K atomics into the residual)
        put(ex, out, base)
        ref = ref + base
    else:
        poison(ex, out)
    if zeroed:
        ex.run_launch(phase, tokens, index - 1, env)
    run(ex, phase, tokens, index, **env)
    got = get(ex, out, np.float32, m * n).reshape(m, n)
    err = dot_rel(got, ref, a, wref, base if mode and not zeroed else None)
    assert err <= tol, f"{x.kernel} mode {mode}, {m} rows: error {err:.2e} of the products' magnitude"


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16])
def test_decode_gemv(ex, b):
    """Every distinct GEMV launch of a decode bucket: qkv (store), o and down (residual add), the head."""
    if ("decode", b) not in ex.phases:
        pytest.skip(f"no decode bucket {b}")
    rng = np.random.default_rng(30 + b)
    seen = set()
    for i, x in enumerate(ex.program.phase("decode", b).launches):
        nw = 3 if "nvfp4" in x.kernel else 2 if "int8" in x.kernel else 1
        if x.kernel.startswith("gemv_") and "gated" not in x.kernel and "_norm_" not in x.kernel \
                and (x.kernel, scalar(x, 5 + nw)) not in seen:
            seen.add((x.kernel, scalar(x, 5 + nw)))
            rope_tail_slots(ex, x, b)
            check_linear(ex, "decode", b, i, x, b, rng, {})
    if not seen:
        pytest.skip(f"decode {b} runs the GEMM (above the GEMV's rows)")


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16])
def test_decode_gemv_int8_rows_ending_inside_a_block(ex, b):
    """The INT8 GEMV (the head) over N rows ending inside a block's 16-row tiles and the tiles it takes together
    (impc/launch_linear.py GV_I8_TILES): the program's launch with N less 40 (its grid unchanged, so blocks past
    the rows run too), against float64 products; outputs past N are not written."""
    import dataclasses

    from imp_runtime.activation_formats import xfmt
    from imp_runtime.cuda_program import bind_launch
    if ("decode", b) not in ex.phases:
        pytest.skip(f"no decode bucket {b}")
    i, x = find(ex, "decode", b, "gemv_int8")
    a_name, out = buf(x, 0), buf(x, 3)
    n, k, mode = scalar(x, 4) - 40, scalar(x, 5), scalar(x, 7)
    assert mode == 0 and scalar(x, 6) == b
    x2 = dataclasses.replace(x, args=(*x.args[:4], {"i32": n}, *x.args[5:]))
    rng = np.random.default_rng(70 + b)
    wref = random_weights(ex, x, [1, 2], n, k, rng, tiny_rows=10)
    a = (rng.standard_normal((b, k)) * rng.uniform(0.01, 30, (1, k))).astype(np.float32)
    a = put_activation(ex, a_name, a, xfmt("int8"))
    poison(ex, out)
    bind_launch(x2, ex.module, ex.arena, dict(ex.program.symbols, rows=b, dec=0)).run(ex.stream)
    ex.synchronize()
    got = get(ex, out, np.float32, b * n + 64)
    err = dot_rel(got[:b * n].reshape(b, n), a.astype(np.float64) @ wref.T.astype(np.float64), a, wref)
    assert err <= TOL_F32, f"{x.kernel}, {b} rows, N {n}: error {err:.2e} of the products' magnitude"
    assert np.all(got[b * n:].view(np.uint32) == 0xFFFFFFFF), "written past the last row"


@pytest.mark.parametrize("m", [1, 3, 17, 100, 300, 1100])
def test_prefill_gemm(ex, m):
    """The prefill GEMMs of every prefill phase with a ragged number of rows (the grid shrinks to them);
    on Hopper the wgmma GEMM, split over K in the phase of one row tile, and its gated gate_up epilogue; in the
    large phases the persistent ping-pong one at every row count."""
    from imp_runtime.program import evaluate
    rng = np.random.default_rng(3 + m)
    seen = set()
    for tokens in ex.prefill_buckets:
        if m > tokens:
            continue
        for i, x in enumerate(ex.program.phase("prefill", tokens).launches):
            if not x.kernel.startswith("gemm_") or {"sym": "srows", "ceil_div": 64} in x.grid:
                continue        # (the output head over a mixed step's sampled rows: test_mixed_step_vs_cpu)
            if not all(evaluate(g, {"rows": m}) for g in x.grid if isinstance(g, dict) and g["sym"] == "rows"):
                continue        # the alternative kernel for other row counts
            key = (tokens, x.kernel, str(x.args[8:]) if x.kernel.startswith("gemm_wg")
                   else (x.args[9]["i32"], x.args[13]["i32"]) if x.kernel.startswith("gemm_wq")   # mode, K splits
                   else x.args[-1]["i32"], x.grid[2])
            if key not in seen:
                seen.add(key)
                check_linear(ex, "prefill", tokens, i, x, m, rng, {"rows": m, "start": 0, "slot": 1})
    if not seen:
        pytest.skip("the chunk is smaller than the rows")


def test_decode_gemm_split_k(ex):
    """The largest decode bucket runs the GEMM with atomic split-K (zeroed output first, or added to x)."""
    b = ex.decode_buckets[-1]
    rng = np.random.default_rng(9)
    hits = [(i, x) for i, x in enumerate(ex.program.phase("decode", b).launches) if x.kernel.startswith("gemm_")]
    if not hits:
        pytest.skip("the largest bucket runs the GEMV")
    for i, x in hits[:4]:
        check_linear(ex, "decode", b, i, x, b, rng, {})


@pytest.mark.parametrize("b", [1, 2, 8, 16, 32, 64])
def test_decode_gemm_nvfp4(ex, b):
    """Every distinct launch (mode, split-K) of the NVFP4 decode GEMM in decode bucket b: qkv (store), o and down
    (residual add, split over K), gate_up (act(gate) * up); b below the kernel's 16 rows too."""
    if ("decode", b) not in ex.phases:
        pytest.skip(f"no decode bucket {b}")
    rng = np.random.default_rng(70 + b)
    seen = set()
    for i, x in enumerate(ex.program.phase("decode", b).launches):
        if x.kernel.startswith("gemm_wq") and (x.kernel, scalar(x, 9), scalar(x, 13)) not in seen:
            seen.add((x.kernel, scalar(x, 9), scalar(x, 13)))     # (kernel, mode, K splits)
            check_linear(ex, "decode", b, i, x, b, rng, {})
    if not seen:
        pytest.skip(f"decode {b} does not run the NVFP4 decode GEMM")


@pytest.mark.parametrize("b,rows", [(8, 8), (16, 11), (32, 32), (64, 64), (64, 37)])
def test_decode_gemm_norm_tail(ex, b, rows):
    """The RMSNorm in the tail of the NVFP4 decode GEMM that adds into x (o before gate_up, down before the next
    layer's qkv: templates/gemm_wgmma_nvfp4.cu.j2 wq_norm_tail): x after the add against the float64 product, the
    normed rows against rms_norm of that x, and bit for bit what rmsnorm_residual (layer 0's attention norm, still a
    launch) writes from the same x and weight; the tail's counts back at 0 for the next launch, twice over."""
    from imp_runtime.activation_formats import XF_F16W, read_activation
    from imp_runtime.executor_cpu import rms_norm
    if ("decode", b) not in ex.phases:
        pytest.skip(f"no decode bucket {b}")
    launches = ex.program.phase("decode", b).launches
    tails = [(i, x) for i, x in enumerate(launches) if x.kernel.startswith("gemm_wq") and buf(x, 14) is not None]
    if not tails:
        pytest.skip(f"decode {b} norms in no GEMM's tail")
    j, xn = next((j, y) for j, y in enumerate(launches) if y.kernel == "rmsnorm_residual" and scalar(y, 4) == XF_F16W)
    s, rng = ex.spec, np.random.default_rng(90 + rows)
    h = s.hidden
    for i, x in tails[:2]:                     # o (the MLP's norm in its tail) and down (the next layer's)
        a_name, lin, out = x.args[0]["tmap"]["ptr"], x.args[1]["tmap"]["ptr"][:-len(".codes")], buf(x, 3)
        n, k, nout = scalar(x, 7), scalar(x, 8), buf(x, 15)
        assert out == buf(xn, 0) and nout == buf(xn, 3) and n == h
        wref = put_random_weights(ex, [f"{lin}.codes", f"{lin}.scales", f"{lin}.tscale"], n, k, rng)
        a = put_activation(ex, a_name, (rng.standard_normal((rows, k)) * 0.5).astype(np.float32), XF_F16W)
        base = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
        w = rng.standard_normal(h).astype(np.float32)
        put(ex, out, base)
        put(ex, buf(x, 14), w)
        poison(ex, nout)
        run(ex, "decode", b, i, rows=rows)
        xs = get(ex, out, np.float32, rows * n).reshape(rows, n)
        ref = a.astype(np.float64) @ wref.T.astype(np.float64) + base
        assert dot_rel(xs, ref, a, wref, base) <= TOL
        assert np.array_equal(get(ex, "norm_count", np.int32, 2), [0, 0]), "the tail's counts not reset"
        tail = get(ex, nout, np.uint16, rows * h)
        assert rel(read_activation(tail, rows, h, XF_F16W), rms_norm(xs.astype(np.float64), w, s.norm_eps)) <= TOL
        put(ex, buf(xn, 0), xs)                # the same x and weight through the norm launch
        put(ex, buf(xn, 2), w)
        poison(ex, nout)
        run(ex, "decode", b, j, rows=rows)
        assert np.array_equal(get(ex, nout, np.uint16, rows * h), tail), f"{x.kernel}: not rmsnorm_residual's bits"
        run(ex, "decode", b, i, rows=rows)     # again: the counts it left let it finish and reset them
        assert np.array_equal(get(ex, "norm_count", np.int32, 2), [0, 0])


@pytest.mark.parametrize("b", [1, 3, 8, 16])
def test_decode_gemv_gated(ex, b):
    """gate_up GEMV with act(gate) * up fused: x planes in, x planes out (the down GEMV's input)."""
    got, ref = gated_case(ex, b)
    assert rel(got, ref) <= TOL_F32


def gated_case(ex, b):
    """test_decode_gemv_gated's launch on random weights, activation and norm partials drawn from a seed of b:
    (its outputs, their float64 reference)."""
    from imp_runtime.executor_cpu import gated_act
    bucket = next((t for t in ex.decode_buckets if t >= b), None)
    hits = [(i, x) for i, x in enumerate(ex.program.phase("decode", bucket).launches)
            if x.kernel.startswith("gemv_") and "gated" in x.kernel and "_norm_" not in x.kernel]
    if not hits:
        pytest.skip(f"decode {bucket} fuses the norm into its gated GEMV (test_decode_gemv_norm)")
    i, x = hits[0]
    fmt = "nvfp4" if "nvfp4" in x.kernel else "bf16"
    nw = 3 if fmt == "nvfp4" else 1
    n, k, ofmt = scalar(x, 2 + nw), scalar(x, 3 + nw), scalar(x, 5 + nw)
    rng = np.random.default_rng(50 + b)
    wref = random_weights(ex, x, list(range(1, 1 + nw)), n, k, rng)
    a = (rng.standard_normal((bucket, k)) * 0.3).astype(np.float32)
    a = put_activation(ex, buf(x, 0), a, gemv_input_format(x.kernel, fmt))
    sc = ring_norm_scale(ex, x, bucket, k, rng)
    poison(ex, buf(x, 1 + nw))
    run(ex, "decode", bucket, i)
    ref = gated_act((a.astype(np.float64) @ wref.T.astype(np.float64)) * sc, ex.spec.activation)
    return activation(ex, buf(x, 1 + nw), bucket, n // 2, ofmt), ref


def ring_norm_scale(ex, x, rows: int, k: int, rng) -> np.ndarray:
    """A ring GEMV that scales its rows by the norm's partial sums (its last argument, templates/gemv_ring.cu.j2
    gemv_ring_body): random partials written there and each row's float64 scale 1 / sqrt(sum / K + eps) [rows, 1];
    ones for any other launch."""
    if not (x.kernel.startswith("gemv_ring") and buf(x, len(x.args) - 1)):
        return np.ones((rows, 1))
    part = rng.uniform(0.2, 5.0, (rows, k // 16)).astype(np.float32)
    put(ex, buf(x, len(x.args) - 1), part)
    return 1.0 / np.sqrt(part.astype(np.float64).sum(axis=1, keepdims=True) / k + ex.spec.norm_eps)


# The 8B-class shapes' layers (2 of them, a 32k vocabulary; scripts/build_gpu_bundles.py): Qwen3-8B's (intermediate
# 12,288: down 6 stages a warp; q/k norm in the rope tail) and Llama-3.1-8B's (14,336: 7 stages; no q/k norm, Llama-3
# RoPE scaling). Each has -rolled (--no-gemv-ring-unroll) and -pair (--gemv-pair) builds beside it.
SHAPES_8B = ["syn-qwen3-8b-2l", "syn-llama-8b-2l"]


@pytest.fixture(scope="module", params=SHAPES_8B)
def ex8b(request):
    """An 8B-class shape's layers (SHAPES_8B): only its decode GEMVs are tested here (the other kernels' shapes are
    covered by the bundles above, and its large prefill references cost minutes on the host). Its bundle's name is
    `ex8b.test_bundle`."""
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    e = CudaExecutor(load_bundle(gpu_bundle(request.param)), use_graphs=False)
    e.test_bundle = request.param
    yield e
    e.close()


@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_decode_gemv_8b_shape(ex8b, b):
    """The 8B shape's streamed decode GEMVs at 1, 2, 4 and 8 rows: qkv on gemv_ring3_* (384 tiles: a block each, three
    an SM; at one row gemv_ring3_rope_*, qkv_rope's work in its tail, test_decode_gemv_rope_tail; at 8 rows
    gemv_ring_*, two n8 groups), o and down on gemv_ring_*, gate_up on gemv_ring_gated_*; at one row o and down on gemv_ringx_* and gate_up
    on gemv_ringxr_gated_* (the activation's hi plane staged in shared memory, the stage loop unrolled over the ring);
    against float64 products of the hi plane they read (ring_read)."""
    kernels = {x.kernel for x in ex8b.program.phase("decode", b).launches}
    expect = ({"gemv_ring3_rope_nvfp4_nb1", "gemv_ringx_nvfp4_nb1", "gemv_ringxr_gated_nvfp4_nb1"} if b == 1 else
              {"gemv_ring_nvfp4_nb8", "gemv_ring_gated_nvfp4_nb8"} if b == 8 else
              {f"gemv_ring3_nvfp4_nb{b}", f"gemv_ring_nvfp4_nb{b}", f"gemv_ring_gated_nvfp4_nb{b}"})
    assert expect <= kernels
    test_decode_gemv(ex8b, b)
    test_decode_gemv_gated(ex8b, b)


def test_decode_gemv_8b_unrolled(ex8b):
    """--no-gemv-ring-unroll: the 8B shape's one-row gate_up on the rolled gemv_ringx_gated_* against float64 products
    of the hi plane, and bit for bit the outputs of the default gemv_ringxr_gated_* (its stage loop unrolled over the
    ring, a tile being one revolution of it) on the same weights, activation and norm partials (the same bundle
    otherwise); down the same, on gemv_ringx_* and gemv_ringxr_* (intermediate / 2048 stages a tile unrolled: 6 for
    Qwen3-8B, 7 for Llama-3.1-8B; a tile a block)."""
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    ex = CudaExecutor(load_bundle(gpu_bundle(ex8b.test_bundle + "-rolled")), use_graphs=False)
    try:
        kernels = {x.kernel for x in ex.program.phase("decode", 1).launches}
        assert "gemv_ringx_gated_nvfp4_nb1" in kernels and "gemv_ringxr_gated_nvfp4_nb1" not in kernels
        assert "gemv_ringxr_gated_nvfp4_nb1" in {x.kernel for x in ex8b.program.phase("decode", 1).launches}
        rolled, ref = gated_case(ex, 1)
        assert rel(rolled, ref) <= TOL_F32
        got, _ = gated_case(ex8b, 1)
        assert np.array_equal(got, rolled), "the unrolled loop's outputs differ from the rolled loop's"
        # down (intermediate / 2048 stages a tile, one tile a block): gemv_ringxr_* against the rolled gemv_ringx_*
        kern_r, *rolled = down_case(ex, 1)
        kern_u, *got = down_case(ex8b, 1)
        assert (kern_r, kern_u) == ("gemv_ringx_nvfp4_nb1", "gemv_ringxr_nvfp4_nb1")
        for u, v in zip(got, rolled):
            assert np.array_equal(u, v), "down: the unrolled loop's outputs differ from the rolled loop's"
    finally:
        ex.close()


def down_case(ex, b):
    """The first down GEMV of the decode bucket b (adding into x and writing the next norm's planes and partial sums)
    on random weights, activation, residual and norm weight drawn from a seed of b, held to float64 products: (its
    kernel, the x it stored, the planes, the partial sums)."""
    i, x = next((i, x) for i, x in enumerate(ex.program.phase("decode", b).launches)
                if x.kernel.startswith("gemv_ring") and buf(x, 1).endswith(".down.codes"))
    rng = np.random.default_rng(160 + b)
    n, k = scalar(x, 5), scalar(x, 6)
    wref = random_weights(ex, x, [1, 2, 3], n, k, rng)
    a = put_activation(ex, buf(x, 0), (rng.standard_normal((b, k)) * 0.5).astype(np.float32), XF_F16X2_HI)
    base = (rng.standard_normal((b, n)) * 3).astype(np.float32)
    put(ex, buf(x, 4), base)
    put(ex, buf(x, len(x.args) - 4), rng.uniform(0.5, 1.5, n).astype(np.float32))
    poison(ex, "hb")
    poison(ex, "norm_part")
    run(ex, "decode", b, i)
    xs = get(ex, buf(x, 4), np.float32, b * n).reshape(b, n)
    assert dot_rel(xs, a.astype(np.float64) @ wref.T.astype(np.float64) + base, a, wref, base) <= TOL_F32
    return (x.kernel, xs, get(ex, "hb", np.uint16, 2 * b * n), get(ex, "norm_part", np.float32, b * n // 16))


@pytest.mark.parametrize("b", [1])
def test_decode_gemv_rope_tail(ex8b, b):
    """The 8B shape's qkv GEMV at one row with qkv_rope_cache_f16's work in its tail (check_rope_tail)."""
    check_rope_tail(ex8b, b)


def test_decode_gemv_rope_tail_other_heads(ex):
    """The same at the other head dims (the tiny qwen3's 32, 128 with 16 heads, Gemma-3's 256: rope_consts'
    pairs a lane and the q / k norm's sum of squares differ by head dim; each kernel inlines that sum, so its bits
    are the same as qkv_rope_cache_f16's only if both compile it alike: prelude rope_rotate writes its one FMA
    explicitly)."""
    check_rope_tail(ex, 1)


def check_rope_tail(ex, b: int) -> None:
    """The qkv GEMV at b rows with qkv_rope_cache_f16's work in its tail (gemv_ring3_rope_*,
    templates/gemv_ring.cu.j2 rope_tail): its float32 qkv rows against float64 products; q and the new keys and values
    in the paged cache against q/k norm and RoPE (executor_cpu.rms_norm, runtime/rope.py) of those rows; bit for bit
    what qkv_rope_cache_f16 writes from the same rows (the launch the other batches keep); the heads' counts left at
    0, so a second launch writes the same."""
    from imp_runtime.executor_cpu import rms_norm
    from imp_runtime.rope import apply_rope, cos_sin
    s = ex.spec
    i, x = find(ex, "decode", b, "gemv_ring3_rope_nvfp4")
    assert not any(y.kernel == "qkv_rope_cache_f16" for y in ex.program.phase("decode", b).launches)
    rng = np.random.default_rng(140 + b)
    n, k = scalar(x, 5), scalar(x, 6)
    assert n == s.q_dim + 2 * s.kv_dim and buf(x, 4) == "qkv"
    assert [buf(x, j) for j in (15, 16, 17, 18)] == ["q", "kv.0.k", "kv.0.v", "rope_count"]
    wref = random_weights(ex, x, [1, 2, 3], n, k, rng)
    a = put_activation(ex, buf(x, 0), (rng.standard_normal((b, k)) * 0.5).astype(np.float32), XF_F16X2_HI)
    sc = ring_norm_scale(ex, x, b, k, rng)
    qn, kn = (rng.uniform(0.5, 1.5, s.head_dim).astype(np.float32) for _ in range(2))
    qk_norm = buf(x, 10) is not None                     # Qwen3's q / k norm; Llama's rope tail has none
    assert qk_norm == (buf(x, 11) is not None)
    if qk_norm:
        put(ex, buf(x, 10), qn), put(ex, buf(x, 11), kn)
    pos = rng.integers(0, ex.max_context, b).astype(np.int32)
    slots = (np.arange(1, b + 1) * ex.page_size + 3).astype(np.int32)          # pages 1..b, offset 3
    put(ex, "positions", pos), put(ex, "kv_slots", slots)
    outs = []
    for rep in range(2):
        for name in ("qkv", "q", "kv.0.k", "kv.0.v"):
            poison(ex, name)
        run(ex, "decode", b, i)
        qkv = get(ex, "qkv", np.float32, b * n).reshape(b, n)
        q = get(ex, "q", np.uint16, b * s.q_dim)
        kv = [np.stack([read_kv_slot(ex, f"kv.0.{c}", sl) for sl in slots]) for c in "kv"]
        outs.append((qkv, q, *kv))
        assert not get(ex, "rope_count", np.int32, s.n_heads + 2 * s.n_kv_heads).any(), "a head's count left"
    for u, v in zip(*outs):
        assert np.array_equal(u, v), "a second launch wrote other values"
    qkv, q16, kc, vc = outs[0]
    ref = (a.astype(np.float64) @ wref.T.astype(np.float64)) * sc
    assert dot_rel(qkv, ref, a * sc.astype(np.float32), wref) <= TOL_F32
    qh = qkv[:, :s.q_dim].reshape(b, s.n_heads, s.head_dim)
    kh = qkv[:, s.q_dim:s.q_dim + s.kv_dim].reshape(b, s.n_kv_heads, s.head_dim)
    vh = qkv[:, s.q_dim + s.kv_dim:].reshape(b, s.n_kv_heads, s.head_dim)
    cos, sin = cos_sin(s, 0, pos.astype(np.int64))
    if qk_norm:
        qh, kh = rms_norm(qh, qn, s.norm_eps), rms_norm(kh, kn, s.norm_eps)
    qr, kr = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
    assert rel(q16.view(np.float16).astype(np.float32), qr.reshape(-1)) <= TOL
    assert rel(kc, kr) <= TOL and rel(vc, vh) <= TOL
    # qkv_rope_cache_f16 (prefill's launch for layer 0) from the same float32 rows: the same bits
    j, y = find(ex, "prefill", ex.prefill_chunk, "qkv_rope_cache_f16")
    assert [buf(y, c) for c in (0, 2, 3, 7, 8, 9)] == ["qkv", buf(x, 10), buf(x, 11), "q", "kv.0.k", "kv.0.v"]
    for name in ("q", "kv.0.k", "kv.0.v"):
        poison(ex, name)
    run(ex, "prefill", ex.prefill_chunk, j, rows=b, start=0, slot=1)
    assert np.array_equal(get(ex, "q", np.uint16, b * s.q_dim), q16), "q: not qkv_rope_cache_f16's bits"
    for c, got in (("k", kc), ("v", vc)):
        want = np.stack([read_kv_slot(ex, f"kv.0.{c}", sl) for sl in slots])
        assert np.array_equal(want, got), f"{c}: not qkv_rope_cache_f16's bits"


def pair_outputs(ex, na: int, nq: int, slot: int) -> list[tuple[str, np.ndarray]]:
    """What layer 0's down and layer 1's qkv write at one row: x, the next norm's planes and partial sums, the qkv rows,
    q and layer 1's new key and value rows (at KV slot `slot`)."""
    s = ex.spec
    return [("x", get(ex, "x", np.float32, na)), ("hb", get(ex, "hb", np.uint16, 2 * na)),
            ("norm_part", get(ex, "norm_part", np.float32, na // 16)), ("qkv", get(ex, "qkv", np.float32, nq)),
            ("q", get(ex, "q", np.uint16, s.q_dim)), ("kv.1.k", read_kv_slot(ex, "kv.1.k", slot)),
            ("kv.1.v", read_kv_slot(ex, "kv.1.v", slot))]


def pair_case(ex, i: int, ex8b, inputs: list[str], base, poisoned: list[str], outputs, replaced: list[tuple[str, str]],
              check=None) -> list[tuple[str, np.ndarray]]:
    """A --gemv-pair launch (decode 1's launch i of ex, its inputs written) against the two launches it replaces: run
    twice (x reset to base, the outputs poisoned), the barrier's count back at 0 after each (and check(ex)), the same
    outputs(ex) both times; then the same inputs (buffers by name) in ex8b, the default bundle, and its launches
    `replaced` ((kernel, weight codes buffer) in order) run: every output bit for bit theirs. Returns the outputs."""
    saved = {n: get(ex, n, np.uint8, ex.program.buffers[n].bytes) for n in inputs}
    outs = []
    for rep in range(2):
        put(ex, "x", base)
        for name in poisoned:
            poison(ex, name)
        run(ex, "decode", 1, i)
        outs.append(outputs(ex))
        assert get(ex, "pair_bar", np.int32, 1)[0] == 0, "the barrier's count left"
        if check is not None:
            check(ex)
    for (name, u), (_, v) in zip(*outs):
        assert np.array_equal(u, v), f"{name}: a second launch wrote other values"
    for name, v in saved.items():
        put(ex8b, name, v)
    for name in poisoned:
        poison(ex8b, name)
    launches = list(enumerate(ex8b.program.phase("decode", 1).launches))
    for kernel, codes in replaced:
        run(ex8b, "decode", 1, next(j for j, y in launches if y.kernel == kernel and buf(y, 1) == codes))
    for (name, got), (_, want) in zip(outs[0], outputs(ex8b)):
        assert np.array_equal(got, want), f"{name}: not the bits of the two launches it replaces"
    return outs[0]


def pair_first_gemv(ex, x, act: str, seed: int):
    """A --gemv-pair launch x's inputs from a seed: its first GEMV's weights, activation (buffer act), residual x and
    the next norm's weight, then its second GEMV's weights. Returns (the generator, for the test's other inputs; the
    first GEMV's weights, activation and residual, for x's float64 check: pair_first_x)."""
    na, ka = scalar(x, 5), scalar(x, 6)
    rng = np.random.default_rng(seed)
    w = random_weights(ex, x, [1, 2, 3], na, ka, rng)
    a = put_activation(ex, act, (rng.standard_normal((1, ka)) * 0.5).astype(np.float32), XF_F16X2_HI)
    base = (rng.standard_normal((1, na)) * 3).astype(np.float32)
    put(ex, "x", base)
    put(ex, buf(x, 7), rng.uniform(0.5, 1.5, na).astype(np.float32))
    random_weights(ex, x, [10, 11, 12], scalar(x, 14), scalar(x, 15), rng)
    return rng, w, a, base


def pair_first_x(outs, w, a, base) -> None:
    """The x a pair launch stored (pair_case's outputs: x first) against float64 products of its first GEMV."""
    xs = outs[0][1].reshape(base.shape)
    assert dot_rel(xs, a.astype(np.float64) @ w.T.astype(np.float64) + base, a, w, base) <= TOL_F32


def test_decode_gemv_pair(ex8b):
    """--gemv-pair (templates/gemv_ring_pair.cu.j2 gemv_ring_pair_nvfp4_nb1): layer 0's down and layer 1's qkv at one
    row in one launch, a grid barrier between, on random weights, activation, residual, norm and q / k norm weights,
    position and KV slot: x against float64 products (down_case's oracle), and every output (x, the norm's planes and
    partial sums, the qkv rows, q, the new key and value) bit for bit what the two launches it replaces write from the
    same inputs (the default bundle's gemv_ringxr_nvfp4_nb1 and gemv_ring3_rope_nvfp4_nb1, each held to float64 and
    qkv_rope_cache_f16 by the tests above); its barrier count and the heads' counts back at 0, so a second launch
    writes the same."""
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    ex = CudaExecutor(load_bundle(gpu_bundle(ex8b.test_bundle + "-pair")), use_graphs=False)
    try:
        s = ex.spec
        i, x = find(ex, "decode", 1, "gemv_ring_pair_nvfp4")
        assert [buf(x, c) for c in (0, 4, 8, 9, 13, 22, 23, 24, 25, 26)] == [
            "ab", "x", "hb", "norm_part", "qkv", "q", "kv.1.k", "kv.1.v", "rope_count", "pair_bar"]
        na, nq = scalar(x, 5), scalar(x, 14)
        rng, wd, a, base = pair_first_gemv(ex, x, "ab", 170)
        for c in (17, 18):                                   # q / k norm weights (Qwen3; Llama has none)
            if buf(x, c) is not None:
                put(ex, buf(x, c), rng.uniform(0.5, 1.5, s.head_dim).astype(np.float32))
        slot = ex.page_size + 3
        put(ex, "positions", np.array([int(rng.integers(0, ex.max_context))], np.int32))
        put(ex, "kv_slots", np.array([slot], np.int32))
        heads = s.n_heads + 2 * s.n_kv_heads

        def counts_left(e):
            assert not get(e, "rope_count", np.int32, heads).any(), "a head's count left"
        inputs = [buf(x, c) for c in (0, 1, 2, 3, 4, 7, 10, 11, 12, 17, 18) if buf(x, c) is not None]
        outs = pair_case(ex, i, ex8b, inputs + ["positions", "kv_slots"], base,
                         ["hb", "norm_part", "qkv", "q", "kv.1.k", "kv.1.v"],
                         lambda e: pair_outputs(e, na, nq, slot),
                         [("gemv_ringxr_nvfp4_nb1", "layers.0.down.codes"),
                          ("gemv_ring3_rope_nvfp4_nb1", "layers.1.qkv.codes")], counts_left)
        pair_first_x(outs, wd, a, base)
    finally:
        ex.close()


def test_decode_gemv_pair_gated(ex8b):
    """--gemv-pair's other launch (templates/gemv_ring_pair.cu.j2 gemv_ring_pair_gated_nvfp4_nb1): layer 0's o and
    gate_up at one row in one launch, gate_up's first stages issued before the grid-dependency wait and a grid barrier
    between them, on random weights, activation, residual and norm weight: x against float64 products, and x, the
    norm's planes and partial sums and gate_up's act(gate) * up planes bit for bit what the two launches it replaces
    write from the same inputs (the default bundle's gemv_ringx_nvfp4_nb1 and gemv_ringxr_gated_nvfp4_nb1, each held
    to float64 by the tests above); its barrier count back at 0, so a second launch writes the same."""
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    ex = CudaExecutor(load_bundle(gpu_bundle(ex8b.test_bundle + "-pair")), use_graphs=False)
    try:
        i, x = find(ex, "decode", 1, "gemv_ring_pair_gated_nvfp4")
        assert [buf(x, c) for c in (0, 4, 8, 9, 13, 17)] == ["attn", "x", "hb", "norm_part", "ab", "pair_bar"]
        na, ng = scalar(x, 5), scalar(x, 14)
        _, wo, a, base = pair_first_gemv(ex, x, "attn", 171)

        def outputs(e):
            return [("x", get(e, "x", np.float32, na)), ("hb", get(e, "hb", np.uint16, 2 * na)),
                    ("norm_part", get(e, "norm_part", np.float32, na // 16)), ("ab", get(e, "ab", np.uint16, ng))]
        outs = pair_case(ex, i, ex8b, [buf(x, c) for c in (0, 1, 2, 3, 4, 7, 10, 11, 12)], base,
                         ["hb", "norm_part", "ab"], outputs,
                         [("gemv_ringx_nvfp4_nb1", "layers.0.o.codes"),
                          ("gemv_ringxr_gated_nvfp4_nb1", "layers.0.gate_up.codes")])
        pair_first_x(outs, wo, a, base)
    finally:
        ex.close()


@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_decode_gemv_norm_partials(ex8b, b):
    """The RMSNorm between two streamed decode GEMVs as partial sums (templates/gemv_ring.cu.j2 gemv_ring_body): o and
    down, adding into x, also write the planes of x * w bit for bit as every XF_F16X2 writer rounds them (from the x
    they stored and the norm weight) and each 16-row tile's sum of squares of that x; gate_up and the next layer's
    qkv, reading those planes, scale their rows by 1 / sqrt(sum of the partials / K + eps): against float64
    rms_norm(x, w) @ W^T (act(gate) * up for gate_up). No norm launch between them."""
    from imp_runtime.activation_formats import XF_F16X2, ring_read, to_planes, xfmt
    from imp_runtime.executor_cpu import gated_act
    ex, s = ex8b, ex8b.spec
    launches = ex.program.phase("decode", b).launches
    ring = [(i, x) for i, x in enumerate(launches)
            if x.kernel.startswith("gemv_ring") and buf(x, 1).startswith("layers.")]
    writers = [(j, (i, x)) for j, (i, x) in enumerate(ring) if buf(x, len(x.args) - 4)]
    assert len(writers) == 2 * s.n_layers - 1, "o of every layer and down of all but the last"
    assert not any(x.kernel == "rmsnorm_residual" for x in launches[ring[0][0] + 1:ring[-1][0]]), \
        "a norm launch between the layers' GEMVs"
    rng, h = np.random.default_rng(120 + b), s.hidden
    for j, (i, x) in writers[:2]:              # layer 0's o (gate_up reads it) and down (layer 1's qkv)
        ir, xr = ring[j + 1]
        assert buf(xr, len(xr.args) - 1) == "norm_part" and buf(xr, 0) == buf(x, len(x.args) - 3)
        a_name, out, n, k = buf(x, 0), buf(x, 4), scalar(x, 5), scalar(x, 6)
        assert n == h and scalar(x, 8) == 1
        wref = random_weights(ex, x, [1, 2, 3], n, k, rng)
        a = put_activation(ex, a_name, (rng.standard_normal((b, k)) * 0.5).astype(np.float32), XF_F16X2_HI)
        base = (rng.standard_normal((b, n)) * 3).astype(np.float32)
        w = rng.uniform(0.5, 1.5, h).astype(np.float32)
        put(ex, out, base)
        put(ex, buf(x, len(x.args) - 4), w)
        poison(ex, "hb")
        poison(ex, "norm_part")
        run(ex, "decode", b, i)
        xs = get(ex, out, np.float32, b * n).reshape(b, n)
        assert dot_rel(xs, a.astype(np.float64) @ wref.T.astype(np.float64) + base, a, wref, base) <= TOL_F32
        planes = get(ex, "hb", np.uint16, 2 * b * h).reshape(2 * b, h)
        assert np.array_equal(planes, to_planes(xs * w, XF_F16X2)), "x * w planes: not the XF_F16X2 rounding"
        part = get(ex, "norm_part", np.float32, b * h // 16).reshape(b, h // 16)
        want = (xs.astype(np.float64) ** 2).reshape(b, h // 16, 16).sum(axis=2)
        assert np.allclose(part, want, rtol=1e-5, atol=0), "the tiles' sums of squares"
        # the reader, from what the writer left
        gated = "_gated_" in xr.kernel
        nr, kr = scalar(xr, 5), scalar(xr, 6)
        wr = random_weights(ex, xr, [1, 2, 3], nr, kr, rng)
        poison(ex, buf(xr, 4))
        rope_tail_slots(ex, xr, b)
        run(ex, "decode", b, ir)
        # (the reader multiplies the hi plane of x * w, scaled by the row's rms from the float32 partials)
        xd = xs.astype(np.float64)
        inv = 1.0 / np.sqrt((xd ** 2).mean(axis=1, keepdims=True) + s.norm_eps)
        prod = (ring_read(xs * w).astype(np.float64) * inv) @ wr.T.astype(np.float64)
        if gated:
            ofmt = scalar(xr, 8)
            got, ref = activation(ex, buf(xr, 4), b, nr // 2, ofmt), gated_act(prod, s.activation)
            assert ofmt == xfmt("nvfp4")
        else:
            got, ref = get(ex, buf(xr, 4), np.float32, b * nr).reshape(b, nr), prod
        assert rel(got, ref) <= TOL_F32, f"{xr.kernel}: its rows not scaled by the norm"


def test_decode_gemv_norm(ex):
    """Batch-1 GEMVs with RMSNorm fused into the prologue (qkv; gate_up with act(gate) * up): the float32
    residual row and the norm weight in, against rms_norm then the product, in float64."""
    from imp_runtime.executor_cpu import gated_act, rms_norm
    launches = ex.program.phase("decode", 1).launches if 1 in ex.decode_buckets else ()
    hits = {x.kernel: (i, x) for i, x in enumerate(launches) if "_norm_" in x.kernel}
    if not hits:
        pytest.skip("no norm-fused GEMV in decode 1 (bf16 weights, or a hidden size whose planes do not fit)")
    rng = np.random.default_rng(77)
    for kernel, (i, x) in sorted(hits.items()):
        n, k, mode = scalar(x, 6), scalar(x, 7), scalar(x, 9)
        wref = random_weights(ex, x, [2, 3, 4], n, k, rng, tiny_rows=min(40, n // 4))
        row = (rng.standard_normal((1, k)) * rng.uniform(0.1, 10, (1, k))).astype(np.float32)
        w = rng.uniform(0.2, 2.0, k).astype(np.float32)
        put(ex, buf(x, 0), row)
        put(ex, buf(x, 1), w)
        out = buf(x, 5)
        poison(ex, out)
        run(ex, "decode", 1, i)
        h = rms_norm(row.astype(np.float64), w.astype(np.float64), ex.spec.norm_eps)
        prod = h @ wref.T.astype(np.float64)
        if "gated" in kernel:
            ref = gated_act(prod, ex.spec.activation)
            assert rel(activation(ex, out, 1, n // 2, mode), ref) <= TOL_F32, kernel
        else:
            got = get(ex, out, np.float32, n).reshape(1, n)
            assert dot_rel(got, prod, h, wref) <= TOL_F32, kernel


def test_act(ex):
    """act_gated_x (prefill without the gated GEMM epilogue; decode above the GEMV rows): the down projection's input."""
    from imp_runtime.executor_cpu import gated_act
    hits = [(p, t, i, x) for p, t in (("prefill", ex.prefill_chunk), ("decode", ex.decode_buckets[-1]))
            for i, x in enumerate(ex.program.phase(p, t).launches) if x.kernel == "act_gated_x"]
    if not hits:
        pytest.skip("no act_gated_x launch (the gated GEMM epilogue does it)")
    phase, tokens, i, x = hits[0]
    rows, inter = 6, ex.spec.intermediate
    gu = (np.random.default_rng(4).standard_normal((rows, 2 * inter)) * 3).astype(np.float32)
    put(ex, buf(x, 0), gu)
    poison(ex, buf(x, 1))
    run(ex, phase, tokens, i, rows=rows, start=0, slot=1)
    ref = gated_act(gu.astype(np.float64), ex.spec.activation)
    assert rel(activation(ex, buf(x, 1), rows, inter, scalar(x, 2)), ref) <= TOL


def test_penalties(ex):
    """sample_tokens' penalties against the host sampler's penalise (runtime/sampler.py), bit for bit (the same
    float32 operations in the same order, written back into the logits), over rows of each kind: repetition only,
    presence and frequency only, all three, none; greedy rows then draw the first maximum of their penalised logits
    (numpy's argmax), and each penalised row's drawn token is added to its slot's counts, no other."""
    from imp_runtime.sampler import SamplingParams, Sampler
    b = 8
    i, x = find(ex, "decode", b, "sample_tokens")
    if buf(x, 12) is None:
        pytest.skip("a program without the GPU penalties (their six arguments null)")
    assert buf(x, 12) == "pen_counts"
    v, words, rng = ex.vocab, -(-ex.vocab // 32), np.random.default_rng(5)
    kinds = [(1.3, 0.0, 0.0), (1.0, 0.6, 0.25), (1.7, 0.4, 1.1), (1.0, 0.0, 0.0)] * 2
    slots = rng.choice(np.arange(1, ex.max_seqs), b, replace=False).astype(np.int32)
    logits = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    counts = np.zeros((b, v), np.int32)
    ref = logits.copy()
    for r, (rep, pres, freq) in enumerate(kinds):
        prompt = rng.integers(0, v, 50).tolist()
        out = rng.integers(0, v, 30)
        # the row's largest logit on a prompt token, so that the penalty moves the draw
        logits[r, prompt[0]] = ref[r, prompt[0]] = logits[r].max() + 0.5
        s = Sampler(SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq), prompt)
        s.out_counts = {int(t): int(c) for t, c in zip(*np.unique(out, return_counts=True))}
        for t, c in s.out_counts.items():
            counts[r, t] = c
        if (rep, pres, freq) != (1.0, 0.0, 0.0):
            ref[r] = s.penalise(logits[r])
        bits = np.zeros(words, np.uint32)
        np.bitwise_or.at(bits, np.asarray(prompt) >> 5, np.uint32(1) << (np.asarray(prompt) & 31).astype(np.uint32))
        put(ex, "pen_seen", bits.view(np.int32), int(slots[r]) * words * 4)
        put(ex, "pen_counts", counts[r], int(slots[r]) * v * 4)
    put(ex, "logits", logits)
    put(ex, "seq_slot", slots)
    for name, col in (("repetition_penalty", 0), ("presence_penalty", 1), ("frequency_penalty", 2)):
        put(ex, name, np.asarray([k[col] for k in kinds], np.float32))
    put(ex, "temperature", np.zeros(b, np.float32))           # greedy
    put(ex, "top_k", np.zeros(b, np.int32))
    put(ex, "top_p", np.ones(b, np.float32))
    put(ex, "min_p", np.zeros(b, np.float32))
    poison(ex, "sampled")
    run(ex, "decode", b, i)
    got = get(ex, "logits", np.float32, b * v).reshape(b, v)
    assert np.array_equal(got, ref)
    drawn = get(ex, "sampled", np.int32, b)
    assert drawn.tolist() == np.argmax(ref, axis=1).tolist()
    assert any(drawn[r] != np.argmax(logits[r]) for r in range(b))       # (the penalties moved some draws)
    for r, k in enumerate(kinds):
        row = get(ex, "pen_counts", np.int32, v, int(slots[r]) * v * 4)
        want = counts[r].copy()
        want[drawn[r]] += k != (1.0, 0.0, 0.0)
        assert np.array_equal(row, want), f"row {r}"


# ------------------------------------------------------------------ norms, embedding, head helpers


@pytest.mark.parametrize("phase,tokens,rows", [("decode", 4, 4), ("decode", 16, 11), ("prefill", 0, 5)])
def test_rmsnorm(ex, phase, tokens, rows):
    """rmsnorm_residual into the next linear's activation format (x planes for a GEMV: float32 accuracy; at 16
    decode rows, where the decode GEMM takes them, its permuted XF_F16W rows)."""
    from imp_runtime.activation_formats import XF_BF16, XF_F16, XF_F16W
    from imp_runtime.executor_cpu import rms_norm
    s, rng = ex.spec, np.random.default_rng(1)
    tokens = tokens or ex.prefill_chunk
    i, x = find(ex, phase, tokens, "rmsnorm_residual")
    xin = (rng.standard_normal((rows, s.hidden)) * 3).astype(np.float32)
    w = rng.standard_normal(s.hidden).astype(np.float32)
    put(ex, buf(x, 0), xin)
    put(ex, buf(x, 2), w)
    poison(ex, buf(x, 3))
    run(ex, phase, tokens, i, rows=rows, start=0, slot=1)
    ofmt = scalar(x, 4)
    tol = TOL if ofmt in (XF_BF16, XF_F16, XF_F16W) else 1e-5
    assert rel(activation(ex, buf(x, 3), rows, s.hidden, ofmt), rms_norm(xin.astype(np.float64), w, s.norm_eps)) <= tol


def test_rmsnorm_add(ex):
    """gemma3's norm after attention and MLP: x += rms_norm(t) * w."""
    from imp_runtime.executor_cpu import rms_norm
    s, rng = ex.spec, np.random.default_rng(11)
    i, x = find(ex, "decode", 4, "rmsnorm_add")
    t, w = rng.standard_normal((4, s.hidden)).astype(np.float32), rng.standard_normal(s.hidden).astype(np.float32)
    x0 = rng.standard_normal((4, s.hidden)).astype(np.float32)
    put(ex, buf(x, 0), t), put(ex, buf(x, 1), w), put(ex, buf(x, 2), x0)
    run(ex, "decode", 4, i)
    ref = x0 + rms_norm(t.astype(np.float64), w, s.norm_eps)
    assert rel(get(ex, buf(x, 2), np.float32, 4 * s.hidden).reshape(4, -1), ref) <= 1e-5


@pytest.mark.parametrize("staged", [False, True])
def test_embedding(ex, staged):
    """embedding_gather (bf16) or embedding_gather_nvfp4: x = embed[token] * embed_scale, against the
    table read back and de-quantized by the reference (runtime/nvfp4.py); a row whose token_src is j > 0 takes the
    token in sampled[j - 1] (the previous step's, left on the device) instead of tokens. staged: the decode phase's
    launch, whose step values come packed through a staging slot (executor stage_step): it also writes them into
    the step arrays (tokens, token_src, positions checked). Else the prefill phase's, reading the arrays."""
    from imp_runtime.bundle import bf16_to_f32
    from imp_runtime.nvfp4 import dequantize
    s, rng = ex.spec, np.random.default_rng(2)
    if staged and not ex._pack:
        pytest.skip("a bundle compiled before the staged step values")
    phase, n = ("decode", 8) if staged else ("prefill", ex.prefill_buckets[0])
    i, x = find(ex, phase, n, "embedding_gather")
    tokens = rng.integers(0, s.vocab_size, 8).astype(np.int32)
    sampled = rng.integers(0, s.vocab_size, 8).astype(np.int32)
    src = np.array([0, 3, 0, 1, 8, 0, 0, 5], np.int32)
    positions = rng.integers(0, 1000, 8).astype(np.int32)
    put(ex, "sampled", sampled)
    out = next(a["ptr"] for a in x.args if a.get("ptr") == "x")
    poison(ex, out)
    if staged:
        for name in ("tokens", "token_src", "positions"):
            poison(ex, name)
        ex.step["tokens"][:8], ex.step["token_src"][:8], ex.step["positions"][:8] = tokens, src, positions
        ex.stage_step(8)
        run(ex, phase, n, i)
        put(ex, "host_io", np.array([ex._gen], np.uint64), offset=5 * 8)   # (HIO_GEN: as the step's sampler would)
        assert np.array_equal(get(ex, "tokens", np.int32, 8), tokens)
        assert np.array_equal(get(ex, "token_src", np.int32, 8), src)
        assert np.array_equal(get(ex, "positions", np.int32, 8), positions)
    else:
        put(ex, "tokens", tokens)
        put(ex, "token_src", src)
        run(ex, phase, n, i, rows=8)
    v, h = s.vocab_size, s.hidden
    if x.kernel.endswith("nvfp4"):
        table = dequantize(get(ex, buf(x, 3), np.uint8, v * h // 2).reshape(v, h // 2),
                           get(ex, buf(x, 4), np.uint8, v * h // 16).reshape(v, h // 16),
                           get(ex, buf(x, 5), np.float32, 1), h)
    else:
        table = bf16_to_f32(get(ex, buf(x, 3), np.uint16, v * h)).reshape(v, h)
    fed = np.where(src > 0, sampled[np.maximum(src - 1, 0)], tokens)
    ref = table[fed].astype(np.float64) * s.embed_scale
    assert rel(get(ex, out, np.float32, 8 * h).reshape(8, h), ref) <= 1e-6


@pytest.mark.parametrize("dec,last", [(0, [3]), (2, [2, 3, 9]), (5, [5, 6, 7, 8]), (1, [4, 4 + 7, 30, 31, 40])])
def test_gather_rows(ex, dec, last):
    """gather_rows_f32 (a mixed step's prompt-ending chunks' last rows after its decode rows, for the head):
    x[dec + j] = x[last[j]] as they were before, in order, where each source lies at or past its destination (a
    chunk has a row or more; chunks follow each other), a source equal to its destination included; every other row
    unchanged. Oracle: numpy on the rows read back before."""
    s, rng = ex.spec, np.random.default_rng(dec + len(last))
    bucket = ex.prefill_buckets[-1]
    i, _ = find(ex, "prefill", bucket, "gather_rows_f32")
    rows = max(last) + 3
    x0 = rng.standard_normal((rows, s.hidden)).astype(np.float32)
    put(ex, "x", x0)
    put(ex, "chunk_last", np.asarray(last, np.int32))
    run(ex, "prefill", bucket, i, rows=rows, dec=dec, schunks=len(last), srows=dec + len(last))
    ref = x0.copy()
    ref[dec:dec + len(last)] = x0[last]
    assert np.array_equal(get(ex, "x", np.float32, rows * s.hidden).reshape(rows, -1), ref)


def test_softcap(ex):
    s = ex.spec
    i, x = find(ex, "decode", 2, "logits_softcap")
    logits = (np.random.default_rng(12).standard_normal((2, s.vocab_size)) * 40).astype(np.float32)
    put(ex, "logits", logits)
    run(ex, "decode", 2, i)
    ref = np.tanh(logits / s.final_softcap) * s.final_softcap
    assert rel(get(ex, "logits", np.float32, 2 * s.vocab_size).reshape(2, -1), ref) <= 1e-5


# ------------------------------------------------------------------ attention and the KV cache


def pages_of(ex, pages: list[int], slot: int) -> None:
    put(ex, "block_tables", np.asarray(pages, np.int32), slot * ex.max_pages * 4)


def write_kv(ex, name: str, pages: list[int], kv: np.ndarray) -> None:
    """kv [S, KV, hd] float32 -> the layer's pool pages (fp16, [page][KV][PAGE][hd])."""
    s, ps = ex.spec, ex.page_size
    page_bytes = s.n_kv_heads * ps * s.head_dim * 2
    for pi, pg in enumerate(pages):
        blk = np.zeros((s.n_kv_heads, ps, s.head_dim), np.float32)
        part = kv[pi * ps:(pi + 1) * ps]
        blk[:, :len(part)] = part.transpose(1, 0, 2)
        put(ex, name, blk.astype(np.float16), pg * page_bytes)


def read_kv_slot(ex, name: str, slot: int) -> np.ndarray:
    s, ps, slot = ex.spec, ex.page_size, int(slot)
    page_bytes = s.n_kv_heads * ps * s.head_dim * 2
    blk = get(ex, name, np.float16, page_bytes // 2, (slot // ps) * page_bytes).reshape(s.n_kv_heads, ps, s.head_dim)
    return blk.astype(np.float32)[:, slot % ps]


def test_qkv_rope_cache(ex):
    """qkv bias, q/k norm, RoPE (runtime/rope.py's tables), then k, v into the paged pool."""
    from imp_runtime.executor_cpu import rms_norm
    from imp_runtime.rope import apply_rope, cos_sin
    s, rng = ex.spec, np.random.default_rng(5)
    t = 5
    i, x = find(ex, "prefill", ex.prefill_chunk, "qkv_rope_cache_f16")
    qkv = rng.standard_normal((t, s.q_dim + 2 * s.kv_dim)).astype(np.float32)
    put(ex, buf(x, 0), qkv)
    extra = {}
    for j, name in ((1, "bias"), (2, "q_norm"), (3, "k_norm")):
        if x.args[j]["ptr"] is not None:
            n = ex.program.buffers[buf(x, j)].shape[0]
            extra[name] = (rng.standard_normal(n) * 0.3 + (name != "bias")).astype(np.float32)
            put(ex, buf(x, j), extra[name])
    pos = rng.integers(0, ex.max_context, t).astype(np.int32)
    slots = (np.arange(1, t + 1) * ex.page_size + 3).astype(np.int32)          # pages 1..t, offset 3
    put(ex, "positions", pos), put(ex, "kv_slots", slots)
    poison(ex, buf(x, 7))
    run(ex, "prefill", ex.prefill_chunk, i, rows=t, start=0, slot=1)
    y = qkv + extra.get("bias", 0)
    q = y[:, :s.q_dim].reshape(t, s.n_heads, s.head_dim)
    k = y[:, s.q_dim:s.q_dim + s.kv_dim].reshape(t, s.n_kv_heads, s.head_dim)
    v = y[:, s.q_dim + s.kv_dim:].reshape(t, s.n_kv_heads, s.head_dim)
    if s.qk_norm:
        q, k = rms_norm(q, extra["q_norm"], s.norm_eps), rms_norm(k, extra["k_norm"], s.norm_eps)
    cos, sin = cos_sin(s, 0, pos.astype(np.int64))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert rel(get(ex, buf(x, 7), np.float16, t * s.q_dim).astype(np.float32), q.reshape(-1)) <= TOL
    for r in range(t):
        assert rel(read_kv_slot(ex, buf(x, 8), slots[r]), k[r]) <= TOL
        assert rel(read_kv_slot(ex, buf(x, 9), slots[r]), v[r]) <= TOL


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("b", [8, 32, 64])
def test_attn_decode(ex, layer, b):
    """attn_decode_f16, one launch: the program's G blocks a (sequence, kv head) (G > 1 at batch 8; at 64 G = 1,
    on Hopper attn_decode_f16_r3, the three-stage ring, as at 32 with G = 2), the last of them merging the splits, over contexts of 1 to past 4,096 tokens (one split up to 64 keys, 64 splits at
    5,000), for a full layer and (gemma3) a sliding-window one. Run twice: the merging blocks leave their
    counters at 0 for the next launch, and the two results are bitwise the same."""
    from imp_runtime.executor_cpu import attention
    if b not in ex.decode_buckets:
        pytest.skip(f"no decode bucket {b}")
    s, rng = ex.spec, np.random.default_rng(6 + layer)
    i, x = find(ex, "decode", b, "attn_decode_f16", layer % s.n_layers)
    assert not any(y.kernel.startswith("attn_decode_merge") for y in ex.program.phase("decode", b).launches)
    counts, out, window, ofmt = buf(x, 7), buf(x, 8), scalar(x, 9), scalar(x, 11)
    lens = [n for n in (1, 16, 37, 64, 65, 300, 1000, 5000) if n <= ex.max_context]
    pages_per = [-(-n // ex.page_size) for n in lens]
    first = 1
    qs = f16_round(rng.standard_normal((b, s.n_heads, s.head_dim)).astype(np.float32) * 2)
    refs = []
    for r, (n, np_) in enumerate(zip(lens, pages_per)):
        pages = list(range(first, first + np_))
        first += np_
        pages_of(ex, pages, r + 1)
        k = f16_round(rng.standard_normal((n, s.n_kv_heads, s.head_dim)).astype(np.float32))
        v = f16_round(rng.standard_normal((n, s.n_kv_heads, s.head_dim)).astype(np.float32))
        write_kv(ex, buf(x, 1), pages, k)
        write_kv(ex, buf(x, 2), pages, v)
        refs.append(attention(qs[r][None].astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              np.array([n - 1]), s.softmax_scale, window)[0])
    m = len(lens)
    put(ex, "seq_slot", np.array(list(range(1, m + 1)) + [0] * (b - m), np.int32))
    put(ex, "seq_len", np.array(lens + [1] * (b - m), np.int32))
    put(ex, "q", qs.astype(np.float16))
    runs = []
    for _ in range(2):
        poison(ex, "partial"), poison(ex, out)
        run(ex, "decode", b, i)
        assert not get(ex, counts, np.int32, b * s.n_kv_heads).any(), "a block counter left non-zero"
        runs.append(activation(ex, out, b, s.q_dim, ofmt).reshape(b, s.n_heads, s.head_dim))
        for r, n in enumerate(lens):
            assert rel(runs[-1][r], refs[r]) <= TOL, \
                f"sequence of {n} tokens, window {window}, {x.grid[2]} blocks a head, run {len(runs)}"
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("start,t", [(0, 70), (40, 70), (100, 130), (0, 5), (700, 20), (1500, 100), (1024, 128)])
def test_attn_prefill(ex, layer, start, t):
    """attn_prefill_f16 (on Hopper attn_prefill_wg, for head dims that are multiples of 64) over a chunk after a
    cached prefix (start > 0), through the sequence's block table, in every prefill phase that holds the chunk;
    the phase of one row tile (Hopper) splits the keys over blocks, ceil(start / 512) + 1 splits, and
    attn_prefill_merge adds them up; the largest phase reads the chunk from its tile table."""
    from imp_runtime.executor_cpu import attention
    s, rng = ex.spec, np.random.default_rng(7 + start)
    buckets = [b for b in ex.prefill_buckets if b >= t]
    if not buckets or start + t > ex.max_context:
        pytest.skip("chunk too small")
    total = start + t
    pages = list(range(3, 3 + -(-total // ex.page_size)))
    pages_of(ex, pages, 2)
    k = f16_round(rng.standard_normal((total, s.n_kv_heads, s.head_dim)).astype(np.float32))
    v = f16_round(rng.standard_normal((total, s.n_kv_heads, s.head_dim)).astype(np.float32))
    q = f16_round(rng.standard_normal((t, s.n_heads, s.head_dim)).astype(np.float32) * 2)
    for bucket in buckets:
        # Hopper runs the wgmma kernel where the head dim allows (impc/launches.py fa_wg_geometry), else mma.sync
        kernels = {x.kernel for x in ex.program.phase("prefill", bucket).launches}
        i, x = find(ex, "prefill", bucket, "attn_prefill_wg" if "attn_prefill_wg" in kernels else "attn_prefill_f16",
                    layer % s.n_layers)
        write_kv(ex, buf(x, 1), pages, k)
        write_kv(ex, buf(x, 2), pages, v)
        put(ex, buf(x, 0), q.astype(np.float16))
        poison(ex, buf(x, 7))
        env = {"rows": t, "start": start, "slot": 2}
        if x.args[11].get("ptr") == "fa_tiles":     # the largest phase: its tile table names the chunk
            env["qtiles"] = ex.write_tiles([(0, t, start, 2)], send=True)
        run(ex, "prefill", bucket, i, **env)
        merge = ex.program.phase("prefill", bucket).launches[i + 1]
        if merge.kernel == "attn_prefill_merge":
            run(ex, "prefill", bucket, i + 1, **env)
        got = activation(ex, buf(x, 7), t, s.q_dim, scalar(x, 8)).reshape(t, s.n_heads, s.head_dim)
        ref = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), np.arange(start, total),
                        s.softmax_scale, scalar(x, 6))
        assert rel(got, ref) <= TOL, f"prefill phase of {bucket} rows"


# ------------------------------------------------------------------ sampling


def kept_distribution(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The sampling distribution by definition (float64): softmax(logits / T) restricted to the top-k tokens,
    then to the shortest most-likely prefix whose mass reaches top_p, then to tokens of at least min_p times
    the most likely one's probability; renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(p.shape, bool)
    k = top_k if top_k > 0 else len(p)
    kept = order[:k]
    cum = np.cumsum(p[kept]) / p[kept].sum()
    kept = kept[:int(np.searchsorted(cum, top_p - 1e-12)) + 1] if top_p < 1 else kept
    keep[kept] = True
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def sample(ex, logits: np.ndarray, temperature, top_k, top_p, min_p, seeds, step: int = 0) -> list[int]:
    """Run the decode bucket's sample_tokens launch on given logits and parameters."""
    b = logits.shape[0]
    i, x = find(ex, "decode", b, "sample_tokens")
    put(ex, "logits", logits.astype(np.float32))
    put(ex, "temperature", np.full(b, temperature, np.float32)), put(ex, "top_k", np.full(b, top_k, np.int32))
    put(ex, "top_p", np.full(b, top_p, np.float32)), put(ex, "min_p", np.full(b, min_p, np.float32))
    put(ex, "seed", np.asarray(seeds, np.uint64)), put(ex, "step", np.full(b, step, np.int32))
    if "repetition_penalty" in ex.program.buffers:      # (--gpu-penalties: rows without any, as the runtime writes them)
        put(ex, "repetition_penalty", np.ones(b, np.float32))
        put(ex, "presence_penalty", np.zeros(b, np.float32)), put(ex, "frequency_penalty", np.zeros(b, np.float32))
    poison(ex, "sampled")
    run(ex, "decode", b, i)
    return get(ex, "sampled", np.int32, b).tolist()


def test_sampler_greedy(ex):
    logits = (np.random.default_rng(8).standard_normal((8, ex.spec.vocab_size)) * 3).astype(np.float32)
    assert sample(ex, logits, 0.0, 0, 1.0, 0.0, range(8)) == np.argmax(logits, axis=1).tolist()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.8, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0),
                                                           (1.0, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.1)])
def test_sampler_distribution(ex, temperature, top_k, top_p, min_p):
    """The GPU sampler's draws follow the distribution the host sampler defines (imp_runtime.sampler, the
    reference): a chi-square test over 4,096 seeded draws of one row of logits, and never a token outside
    the kept set. A sampler that returned the argmax, ignored the temperature or the seed fails it."""
    rng = np.random.default_rng(13)
    row = np.full(ex.spec.vocab_size, -30.0, np.float32)
    row[:12] = rng.standard_normal(12).astype(np.float32) * 1.5        # twelve live tokens
    p = kept_distribution(row, temperature, top_k, top_p, min_p)
    b = 64
    draws = []
    for rep in range(64):
        draws += sample(ex, np.tile(row, (b, 1)), temperature, top_k, top_p, min_p, [rep * b + j for j in range(b)])
    counts = np.bincount(draws, minlength=ex.spec.vocab_size)
    assert counts[p == 0].sum() == 0, "a token outside the kept set was drawn"
    live = p > 0
    expected = p[live] * len(draws)
    chi2 = float(np.sum((counts[live] - expected) ** 2 / expected))
    dof = int(live.sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * max(dof, 1)) + 10, f"chi-square {chi2:.1f} with {dof} degrees of freedom"


@pytest.mark.parametrize("top_k,top_p", [(5000, 1.0), (0, 0.5), (30, 0.9)])
def test_sampler_many_candidates(ex, top_k, top_p):
    """Rows whose top-k / top-p set is larger than the sampler's shared-memory candidate list (4,096 tokens: top_k
    5000, top_p 0.5 of 6,000 similar tokens) take the whole-row bisections, small ones (top_k 30) the candidate
    list: either way no token outside the kept set of the definition is drawn; a large kept set's more likely half
    is drawn more often than its less likely half, a small one's draws pass a chi-square test."""
    live = 6000
    if ex.spec.vocab_size < live + 200:
        pytest.skip("vocabulary smaller than the test's live tokens")
    row = np.full(ex.spec.vocab_size, -40.0, np.float32)
    row[100:100 + live] = np.linspace(-1.5, 0.0, live, dtype=np.float32)[np.random.default_rng(3).permutation(live)]
    p = kept_distribution(row, 1.0, top_k, top_p, 0.0)
    b = 64
    draws = []
    for rep in range(16):
        draws += sample(ex, np.tile(row, (b, 1)), 1.0, top_k, top_p, 0.0, [rep * b + j for j in range(b)])
    counts = np.bincount(draws, minlength=ex.spec.vocab_size)
    assert counts[p == 0].sum() == 0, "a token outside the kept set was drawn"
    kept = np.flatnonzero(p > 0)
    if len(kept) <= 64:          # few kept tokens (near-equal here): a chi-square test, as test_sampler_distribution
        expected = p[kept] * len(draws)
        chi2 = float(np.sum((counts[kept] - expected) ** 2 / expected))
        assert chi2 < len(kept) - 1 + 6 * np.sqrt(2 * (len(kept) - 1)) + 10, f"chi-square {chi2:.1f}"
        return
    order = kept[np.argsort(-row[kept], kind="stable")]
    top, bottom = order[:len(order) // 2], order[len(order) // 2:]
    assert counts[bottom].sum() > 0 and counts[top].sum() > counts[bottom].sum()


@pytest.fixture(scope="module", params=["llama-bf16-cutlass", "llama-cutlass"])
def ex_cutlass(request):
    """The tiny llama with --prefill-gemm cutlass, all bf16 (every GEMM of its largest prefill phase on CUTLASS's bf16
    kernel) and NVFP4 (qkv, o and down on the scaled fp16 kernel over the weights' fp16 copies)."""
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    e = CudaExecutor(load_bundle(gpu_bundle(request.param)), use_graphs=False)
    yield e
    e.close()


@pytest.mark.parametrize("m", [1, 100, 128, 129, 300, 512])
def test_cutlass_gemm(ex_cutlass, m):
    """Each CUTLASS GEMM shape of the phase (qkv, gate_up: D = A W^T; o, down: D += A W^T in place) at a ragged row
    count (the Params of its 128-row bucket written in by the runtime) against float64 products of the bf16 operands;
    the rows of the bucket past m may be written (the buffers' spare rows), none past the bucket."""
    from imp_runtime.cuda_program import bind_launch
    ex = ex_cutlass
    rng = np.random.default_rng(11 + m)
    tokens = max(ex.prefill_buckets)
    if m > tokens:
        pytest.skip("more rows than the phase")
    seen = set()
    for x in ex.program.phase("prefill", tokens).launches:
        if not x.kernel.startswith("cutlass_"):
            continue
        c = x.args[0]["cutlass"]
        if c["table"] in seen:
            continue
        seen.add(c["table"])
        t = ex.program.constants["cutlass"][c["table"]]
        n, k, beta = t["n"], t["k"], t["beta"]
        rnd, bits = (bf16_round, bf16_bits) if t["fmt"] == "bf16" else \
            (f16_round, lambda v: np.asarray(v, np.float16).view(np.uint16))
        a = rnd(rng.standard_normal((m, k)) * rng.uniform(0.1, 3, (1, k)))
        w = rnd(rng.standard_normal((n, k)) * rng.uniform(0.01, 1, (n, 1)))
        put(ex, c["A"], bits(a))
        put(ex, c["W"], bits(w))
        scale = 1.0
        if "scale" in c:                 # the scaled kernel: D = alpha * tscale * A W^T (+ C)
            ts = 1.5 / t["alpha"]
            put(ex, c["scale"], np.array([ts], np.float32))
            scale = float(np.float32(t["alpha"]) * np.float32(ts))
        poison(ex, c["D"])
        base = rng.standard_normal((m, n)).astype(np.float32)
        put(ex, c["D"], base)
        bind_launch(x, ex.module, ex.arena, dict(ex.program.symbols, rows=m, dec=0)).run(
            ex.stream, dict(ex.program.symbols, rows=m, dec=0))
        ex.synchronize()
        bucket = min(-(-m // 128) * 128, t["rows_max"])
        got = get(ex, c["D"], np.float32, bucket * n + 64)
        ref = scale * (a.astype(np.float64) @ w.astype(np.float64).T) + (base if beta else 0)
        err = dot_rel(got[:m * n].reshape(m, n), ref, a * scale, w, base if beta else None)
        assert err <= TOL_F32, f"{c['table']}, {m} rows: error {err:.2e} of the products' magnitude"
        if bucket < t["rows_max"]:      # (at the phase's rows the bucket ends where the buffer does)
            assert np.all(got[bucket * n:].view(np.uint32) == 0xFFFFFFFF), "written past the row bucket"
    assert len(seen) == (4 if all(key.startswith("bf16") for key in seen) else 3), seen   # (NVFP4: gate_up is imp's)
