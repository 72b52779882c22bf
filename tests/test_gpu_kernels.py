"""Each kernel the cuda executor launches against its cpu-executor reference, on the GPU, with fresh random
inputs and poisoned (NaN-filled) outputs, every output element checked. Kernels are specialised by a bundle's
dimensions, so each test runs on several bundles: head_dim 16 (tiny llama), 128 (qwen3-0.6b shape), 256
(gemma3 shape). Activation formats are the executor's (templates/prelude.cuh.j2): XF_F16 (fp16 of x * 2^-6)
into the GEMM over NVFP4 weights, XF_BF16 into the GEMM over bf16 weights, x planes into the decode GEMV; the
KV pool and q are fp16 (qkv_rope_cache_f16, attn_decode_f16, attn_prefill_f16).
Tolerances: relative error (max |gpu - ref| / max |ref|) <= 1e-2 for bf16/fp16-output kernels and for the
GEMMs against the same de-quantized NVFP4 (or bf16) values; <= 1e-4 for the decode GEMV, which takes
float32 activations as hi/lo x planes and must follow the float32 cpu reference (NVFP4 blocks with tiny
scales, whose fp16 products are subnormal, included); x planes themselves within 1e-5 of float32."""
from __future__ import annotations

import numpy as np
import pytest

try:
    from tests.gpu_common import gpu_bundle, have_gpu
except ImportError:
    from gpu_common import gpu_bundle, have_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs an NVIDIA GPU")]

BUNDLES = ["llama", "syn-qwen3-0.6b", "syn-gemma3-hd256"]
TOL = 1e-2
TOL_F32 = 1e-4


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values in the kernel's output"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def bf16_bits(a):
    from impc.compile import to_bf16_bits
    return to_bf16_bits(np.asarray(a, np.float32))


def bf16_round(a):
    from imp_runtime.bundle import bf16_to_f32
    return bf16_to_f32(bf16_bits(a)).reshape(np.shape(a))


def f16_round(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def xf16_bits(a):
    """float32 -> the XF_F16 activation format (fp16 of a * 2^-6) as uint16 bits."""
    from imp_runtime.executor_cuda import XF_F16_SCALE
    return (np.asarray(a, np.float32) * np.float32(XF_F16_SCALE)).astype(np.float16).view(np.uint16)


def xf16_round(a):
    """The float32 value an XF_F16 activation holds for a."""
    from imp_runtime.executor_cuda import XF_F16_SCALE
    return xf16_bits(a).view(np.float16).astype(np.float32) / np.float32(XF_F16_SCALE)


def read_x(dev, p, rows, k, fmt):
    """An activation buffer of rows x k in x-plane format fmt -> float32 [rows, k]."""
    from imp_runtime.executor_cuda import XF_BF16, XF_F16, XF_F16_SCALE, from_planes
    if fmt == XF_BF16:
        return dev.get(p, (rows, k), np.uint16)
    if fmt == XF_F16:
        return dev.get(p, (rows, k), np.float16).astype(np.float32) / np.float32(XF_F16_SCALE)
    return from_planes(dev.get(p, (2 * rows, k), np.int16).view(np.uint16), fmt)


class Dev:
    """Scratch device buffers for one test; outputs start poisoned with 0xFF bytes (NaN)."""

    def __init__(self, ex):
        from imp_runtime.cuda_driver import check, cu
        self.ex, self.cu, self.check, self.ptrs = ex, cu, check, []

    def alloc(self, nbytes: int, poison: bool = True) -> int:
        p = int(self.check(self.cu.cuMemAlloc(max(int(nbytes), 16))))
        self.ptrs.append(p)
        if poison:
            self.check(self.cu.cuMemsetD8Async(p, 0xFF, max(int(nbytes), 16), self.ex.stream))
        return p

    def put(self, arr) -> int:
        from imp_runtime.cuda_driver import htod
        arr = np.ascontiguousarray(arr)
        p = self.alloc(arr.nbytes, poison=False)
        htod(p, arr, self.ex.stream)
        return p

    def get(self, p: int, shape, dtype=np.float32) -> np.ndarray:
        from imp_runtime.cuda_driver import dtoh
        out = dtoh(np.empty(shape, dtype), p, self.ex.stream)
        if dtype == np.uint16:
            from imp_runtime.bundle import bf16_to_f32
            return bf16_to_f32(out).reshape(shape)
        return out

    def close(self):
        self.ex.synchronize()
        for p in self.ptrs:
            self.cu.cuMemFree(p)


@pytest.fixture(scope="module", params=BUNDLES)
def ex(request):
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cuda import CudaExecutor
    e = CudaExecutor(load_bundle(gpu_bundle(request.param)), kv_pages=512, use_graphs=False)
    yield e
    e.close()


@pytest.fixture
def dev(ex):
    d = Dev(ex)
    yield d
    d.close()


def test_rmsnorm(ex, dev):
    from imp_runtime.cuda_driver import I, P
    from imp_runtime.executor_cpu import rms_norm
    s, rng = ex.spec, np.random.default_rng(1)
    rows = 5
    x = rng.standard_normal((rows, s.hidden)).astype(np.float32) * 3
    res = rng.standard_normal((rows, s.hidden)).astype(np.float32)
    w = rng.standard_normal(s.hidden).astype(np.float32)
    from imp_runtime.executor_cuda import XF_BF16X2, XF_F16, XF_F16X2, from_planes
    px, pr, pw, po = dev.put(x), dev.put(res), dev.put(w), dev.alloc(rows * s.hidden * 2)
    ex._launch("rmsnorm_residual", (rows,), (256,), [P(px), P(pr), P(pw), P(po), I(0)])
    ref = rms_norm(x + res, w, s.norm_eps)
    assert rel(dev.get(po, (rows, s.hidden), np.uint16), ref) <= TOL
    assert rel(dev.get(px, (rows, s.hidden)), x + res) <= 1e-6
    px1, ph = dev.put(x + res), dev.alloc(rows * s.hidden * 2)   # XF_F16: the GEMM input for NVFP4 weights
    ex._launch("rmsnorm_residual", (rows,), (256,), [P(px1), P(0), P(pw), P(ph), I(XF_F16)])
    assert rel(read_x(dev, ph, rows, s.hidden, XF_F16), ref) <= TOL
    for fmt in (XF_F16X2, XF_BF16X2):           # x planes for the decode GEMV: float32 accuracy
        px2, pp = dev.put(x + res), dev.alloc(2 * rows * s.hidden * 2)
        ex._launch("rmsnorm_residual", (rows,), (256,), [P(px2), P(0), P(pw), P(pp), I(fmt)])
        assert rel(from_planes(dev.get(pp, (2 * rows, s.hidden), np.int16).view(np.uint16), fmt),
                   ref) <= 1e-5, f"x planes format {fmt}"
    t = rng.standard_normal((rows, s.hidden)).astype(np.float32)
    pt = dev.put(t)
    ex._launch("rmsnorm_add", (rows,), (256,), [P(pt), P(pw), P(px)])
    assert rel(dev.get(px, (rows, s.hidden)), x + res + rms_norm(t, w, s.norm_eps)) <= 1e-5


def test_embedding(ex, dev):
    from imp_runtime.cuda_driver import P
    s, rng = ex.spec, np.random.default_rng(2)
    table = rng.standard_normal((s.vocab_size, s.hidden)).astype(np.float32)
    tokens = rng.integers(0, s.vocab_size, 7).astype(np.int32)
    pt, pe, px = dev.put(tokens), dev.put(bf16_bits(table)), dev.alloc(7 * s.hidden * 4)
    ex._launch("embedding_gather", (7,), (256,), [P(pt), P(pe), P(px)])
    assert rel(dev.get(px, (7, s.hidden)), bf16_round(table)[tokens] * np.float32(s.embed_scale)) <= 1e-6


def random_linear(dev, rng, fmt: str, n: int, k: int, tiny_rows: int = 0):
    """Random weights [n, k] with varied row scales (the first tiny_rows scaled by 1e-4, so their block
    scales sit far below the tensor's), on the device in `fmt`; returns (exact float32 values, _Linear)."""
    from imp_runtime.executor_cuda import _Linear
    from impc.quantize import quantize_nvfp4
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
    w[:tiny_rows] *= 1e-4
    if fmt == "nvfp4":
        q = quantize_nvfp4(w)
        return q.dequantize(), _Linear("nvfp4", n, k, dev.put(q.codes), dev.put(q.scales), dev.put(q.tscale))
    return bf16_round(w), _Linear("bf16", n, k, dev.put(bf16_bits(w)))


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 17, 100])
def test_linear(ex, dev, fmt, m):
    """The GEMM (prefill, decode above the GEMV's rows) in the executor's activation format: XF_F16 for
    NVFP4 weights (gemm_nvfp4_f16), bf16 for bf16 weights (gemm_bf16)."""
    from imp_runtime.executor_cuda import XF_F16, gfmt
    rng = np.random.default_rng(3 + m)
    n, k = 1000, ex.spec.hidden
    wref, lin = random_linear(dev, rng, fmt, n, k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    rows = max(m, 8)
    a_pad = np.vstack([a, np.zeros((rows - m, k), np.float32)])
    if gfmt(lin) == XF_F16:
        a, pa = xf16_round(a), dev.put(xf16_bits(a_pad))
    else:
        a, pa = bf16_round(a), dev.put(bf16_bits(a_pad))
    ref = a.astype(np.float64) @ wref.T.astype(np.float64)
    out = dev.alloc(rows * n * 4)
    ex.linear(pa, lin, out, m, 0)
    assert rel(dev.get(out, (rows, n))[:m], ref) <= TOL
    base = rng.standard_normal((rows, n)).astype(np.float32)
    out2 = dev.put(base)
    ex.linear(pa, lin, out2, m, 1, split_k=True)      # residual add
    assert rel(dev.get(out2, (rows, n))[:m], base[:m] + ref) <= TOL
    import imp_runtime.executor_cuda as exc
    saved, exc.SPLIT_K_ATOMIC = exc.SPLIT_K_ATOMIC, True
    try:
        out3 = dev.put(base)
        ex.linear(pa, lin, out3, m, 1, split_k=True)  # the opt-in atomic split-K
        assert rel(dev.get(out3, (rows, n))[:m], base[:m] + ref) <= TOL
    finally:
        exc.SPLIT_K_ATOMIC = saved


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11, 16])
def test_gemv(ex, dev, fmt, m):
    """The decode GEMV: float32 activations (as x planes) times NVFP4 or bf16 weights, against float64."""
    from imp_runtime.executor_cuda import GEMV_MAX_ROWS, to_planes, xfmt
    if m > GEMV_MAX_ROWS:
        pytest.skip("batch above the GEMV's rows")
    rng = np.random.default_rng(30 + m)
    n, k = 1000, ex.spec.hidden
    wref, lin = random_linear(dev, rng, fmt, n, k, tiny_rows=40)
    a = (rng.standard_normal((m, k)) * rng.uniform(0.01, 30, (1, k))).astype(np.float32)
    ref = a.astype(np.float64) @ wref.T.astype(np.float64)
    pa = dev.put(to_planes(a, xfmt(lin)))
    out = dev.alloc(max(m, 16) * n * 4)
    ex.linear(pa, lin, out, m, 0, planes=True)
    got = dev.get(out, (m, n))
    assert rel(got, ref) <= TOL_F32
    assert rel(got[:, :40], ref[:, :40]) <= TOL_F32, "rows of tiny block scales"
    base = rng.standard_normal((m, n)).astype(np.float32)
    out2 = dev.put(base)
    ex.linear(pa, lin, out2, m, 1, planes=True)       # residual add
    assert rel(dev.get(out2, (m, n)), base + ref) <= TOL_F32


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_gemv_gated(ex, dev, fmt, m):
    """gate_up GEMV with the gated activation fused: x planes in, x planes (of either format) out."""
    from imp_runtime.executor_cpu import gated_act
    from imp_runtime.executor_cuda import XF_BF16X2, XF_F16X2, _Linear, from_planes, to_planes, xfmt
    from impc.quantize import quantize_nvfp4
    if m > __import__("imp_runtime.executor_cuda", fromlist=["GEMV_MAX_ROWS"]).GEMV_MAX_ROWS:
        pytest.skip("batch above the GEMV's rows")
    s, rng = ex.spec, np.random.default_rng(50 + m)
    inter, k = 200, s.hidden
    w = (rng.standard_normal((2 * inter, k)) * rng.uniform(0.1, 3, (2 * inter, 1))).astype(np.float32)
    a = (rng.standard_normal((m, k)) * 0.3).astype(np.float32)
    if fmt == "nvfp4":
        q = quantize_nvfp4(w)
        wref = q.dequantize()
        lin = _Linear("nvfp4", 2 * inter, k, dev.put(q.codes), dev.put(q.scales), dev.put(q.tscale))
    else:
        wref = bf16_round(w)
        lin = _Linear("bf16", 2 * inter, k, dev.put(bf16_bits(w)))
    ref = gated_act((a.astype(np.float64) @ wref.T.astype(np.float64)).astype(np.float32), s.activation)
    pa = dev.put(to_planes(a, xfmt(lin)))
    for ofmt in (XF_F16X2, XF_BF16X2):
        out = dev.alloc(2 * m * inter * 2)
        ex.gated(pa, lin, out, m, ofmt)
        got = from_planes(dev.get(out, (2 * m, inter), np.int16).view(np.uint16), ofmt)
        assert rel(got, ref) <= TOL_F32, f"output planes {ofmt}"


@pytest.mark.parametrize("ofmt", ["XF_F16", "XF_BF16"])
def test_act(ex, dev, ofmt):
    """act_gated_x: the down projection's GEMM input, XF_F16 (NVFP4 down) or bf16 (bf16 down)."""
    import imp_runtime.executor_cuda as exc
    from imp_runtime.cuda_driver import I, P
    from imp_runtime.executor_cpu import gated_act
    fmt = getattr(exc, ofmt)
    s, rng = ex.spec, np.random.default_rng(4)
    rows = 6
    gu = (rng.standard_normal((rows, 2 * s.intermediate)) * 3).astype(np.float32)
    pg, po = dev.put(gu), dev.alloc(rows * s.intermediate * 2)
    ex._launch("act_gated_x", ((s.intermediate + 255) // 256, rows), (256,), [P(pg), P(po), I(fmt)])
    ref = gated_act(gu.astype(np.float64), s.activation)
    assert rel(read_x(dev, po, rows, s.intermediate, fmt), ref) <= TOL


def _pool_layout(ex):
    s = ex.spec
    return s.n_kv_heads, ex.page, s.head_dim


def _write_cache(ex, layer, seq, k, v):
    """k, v [S, KV, hd] float32 -> the layer's pages of sequence seq (the pool is fp16)."""
    from imp_runtime.cuda_driver import htod
    kvh, page, hd = _pool_layout(ex)
    L = ex.layers[layer]
    for pi, pg in enumerate(seq.pages):
        for base, arr in ((L.k_cache, k), (L.v_cache, v)):
            blk = np.zeros((kvh, page, hd), np.float32)
            part = arr[pi * page:(pi + 1) * page]                  # [n, KV, hd]
            blk[:, :len(part)] = part.transpose(1, 0, 2)
            htod(base + pg * ex.page_bytes_layer, blk.astype(np.float16), ex.stream)
    ex.synchronize()


def _read_slot(ex, base, slot):
    from imp_runtime.cuda_driver import dtoh
    kvh, page, hd = _pool_layout(ex)
    slot = int(slot)
    blk = dtoh(np.empty((kvh, page, hd), np.float16), base + (slot // page) * ex.page_bytes_layer, ex.stream)
    return blk.astype(np.float32)[:, slot % page]


def test_qkv_rope_cache(ex, dev):
    from imp_runtime.cuda_driver import P
    from imp_runtime.executor_cpu import rms_norm
    from imp_runtime.rope import apply_rope, cos_sin
    s, rng = ex.spec, np.random.default_rng(5)
    t = 5
    qkv = rng.standard_normal((t, s.q_dim + 2 * s.kv_dim)).astype(np.float32)
    bias = rng.standard_normal(s.q_dim + 2 * s.kv_dim).astype(np.float32) * 0.3
    qn, kn = rng.standard_normal(s.head_dim).astype(np.float32), rng.standard_normal(s.head_dim).astype(np.float32)
    pos = rng.integers(0, 3000, t).astype(np.int32)
    sid = ex.new_sequence()
    seq = ex._seqs[sid]
    ex._reserve(seq, t * ex.page)
    slots = np.array([seq.pages[i] * ex.page + 3 for i in range(t)], np.int32)
    mv = ex.meta_view
    mv("positions")[:t], mv("kv_slots")[:t] = pos, slots
    ex._send_meta()
    L = ex.layers[0]
    pq, pqkv = dev.alloc(t * s.q_dim * 2), dev.put(qkv)
    ex._launch("qkv_rope_cache_f16", (t,), (128,),
               [P(pqkv), P(dev.put(bias)), P(dev.put(qn)), P(dev.put(kn)), P(L.inv_freq), P(ex.meta_ptr("positions")),
                P(ex.meta_ptr("kv_slots")), P(pq), P(L.k_cache), P(L.v_cache)])
    x = qkv + bias
    q = x[:, :s.q_dim].reshape(t, s.n_heads, s.head_dim)
    k = x[:, s.q_dim:s.q_dim + s.kv_dim].reshape(t, s.n_kv_heads, s.head_dim)
    v = x[:, s.q_dim + s.kv_dim:].reshape(t, s.n_kv_heads, s.head_dim)
    if s.qk_norm:
        q, k = rms_norm(q, qn, s.norm_eps), rms_norm(k, kn, s.norm_eps)
    cos, sin = cos_sin(s, 0, pos.astype(np.int64))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert rel(dev.get(pq, (t, s.q_dim), np.float16).astype(np.float32), q.reshape(t, -1)) <= TOL
    for i in range(t):
        assert rel(_read_slot(ex, L.k_cache, slots[i]), k[i]) <= TOL
        assert rel(_read_slot(ex, L.v_cache, slots[i]), v[i]) <= TOL
    ex.free(sid)


@pytest.mark.parametrize("window", [0, 40])
def test_attn_decode(ex, dev, window):
    from imp_runtime.cuda_driver import P, I
    from imp_runtime.executor_cpu import attention
    from imp_runtime.executor_cuda import MAX_SPLITS, XF_BF16, XF_BF16X2, XF_F16, XF_F16X2
    s, rng = ex.spec, np.random.default_rng(6 + window)
    lens = [1, 37, 300, min(700, ex.max_context)]
    b = len(lens)
    sids = [ex.new_sequence() for _ in lens]
    ks, vs = [], []
    for sid, n in zip(sids, lens):
        seq = ex._seqs[sid]
        ex._reserve(seq, n)
        k = rng.standard_normal((n, s.n_kv_heads, s.head_dim)).astype(np.float32)
        v = rng.standard_normal((n, s.n_kv_heads, s.head_dim)).astype(np.float32)
        _write_cache(ex, 1 % s.n_layers, seq, k, v)
        ks.append(f16_round(k)), vs.append(f16_round(v))
    q = f16_round(rng.standard_normal((b, s.n_heads, s.head_dim)).astype(np.float32) * 2)
    mv = ex.meta_view
    mv("seq_slot")[:b] = [ex._seqs[x].slot for x in sids]
    mv("seq_len")[:b] = lens
    ex._send_meta()
    L = ex.layers[1 % s.n_layers]
    pq, part = dev.put(q.astype(np.float16)), dev.alloc(ex.mb * s.n_heads * MAX_SPLITS * (s.head_dim + 2) * 4)
    splits = 4
    ex._launch("attn_decode_f16", (b, s.n_kv_heads, splits), (128,),
               [P(pq), P(L.k_cache), P(L.v_cache), P(ex.scratch["block_tables"]), P(ex.meta_ptr("seq_slot")),
                P(ex.meta_ptr("seq_len")), P(part), I(window), I(ex.max_pages)])
    refs = [attention(q[i][None].astype(np.float64), ks[i].astype(np.float64), vs[i].astype(np.float64),
                      np.array([n - 1]), s.softmax_scale, window)[0] for i, n in enumerate(lens)]
    # the o projection's input: x planes (decode GEMV) or the GEMM's format (batches above the GEMV's rows)
    for ofmt in (XF_F16X2, XF_BF16X2, XF_F16, XF_BF16):
        out = dev.alloc(2 * b * s.q_dim * 2)
        ex._launch("attn_decode_merge", (b, s.n_heads), (s.head_dim,), [P(part), P(out), I(splits), I(ofmt)])
        got = read_x(dev, out, b, s.q_dim, ofmt).reshape(b, s.n_heads, s.head_dim)
        for i, n in enumerate(lens):
            assert rel(got[i], refs[i]) <= TOL, f"sequence {i} (length {n}), output format {ofmt}"
    for sid in sids:
        ex.free(sid)


@pytest.mark.parametrize("ofmt", ["XF_F16", "XF_BF16"])
@pytest.mark.parametrize("start,t,window", [(0, 70, 0), (40, 70, 0), (100, 130, 33), (0, 5, 0)])
def test_attn_prefill(ex, dev, start, t, window, ofmt):
    """attn_prefill_f16; its output is the o projection's GEMM input: XF_F16 (NVFP4 o) or bf16 (bf16 o)."""
    import imp_runtime.executor_cuda as exc
    from imp_runtime.cuda_driver import P, I
    from imp_runtime.executor_cpu import attention
    fmt = getattr(exc, ofmt)
    s, rng = ex.spec, np.random.default_rng(7 + start)
    total = start + t
    sid = ex.new_sequence()
    seq = ex._seqs[sid]
    ex._reserve(seq, total)
    k = rng.standard_normal((total, s.n_kv_heads, s.head_dim)).astype(np.float32)
    v = rng.standard_normal((total, s.n_kv_heads, s.head_dim)).astype(np.float32)
    _write_cache(ex, 0, seq, k, v)
    q = f16_round(rng.standard_normal((t, s.n_heads, s.head_dim)).astype(np.float32) * 2)
    L = ex.layers[0]
    pq, out = dev.put(q.astype(np.float16)), dev.alloc(t * s.q_dim * 2)
    bt = ex.scratch["block_tables"] + seq.slot * ex.max_pages * 4
    ex._launch("attn_prefill_f16", ((t + 63) // 64, s.n_heads), (128,),
               [P(pq), P(L.k_cache), P(L.v_cache), P(bt), I(start), I(t), I(window), P(out), I(fmt)],
               smem=ex.fa_smem)
    got = read_x(dev, out, t, s.q_dim, fmt).reshape(t, s.n_heads, s.head_dim)
    ref = attention(q.astype(np.float64), f16_round(k).astype(np.float64), f16_round(v).astype(np.float64),
                    np.arange(start, total), s.softmax_scale, window)
    assert rel(got, ref) <= TOL
    ex.free(sid)


def test_sampler(ex):
    from imp_runtime.sampler import SamplingParams
    s, rng = ex.spec, np.random.default_rng(8)
    logits = (rng.standard_normal((6, s.vocab_size)) * 3).astype(np.float32)
    greedy = ex.sample(logits, [SamplingParams(temperature=0)] * 6)
    assert greedy == np.argmax(logits, axis=1).tolist()
    assert ex.sample(logits, [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(6)]) == greedy
    order = np.argsort(-logits, axis=1)
    for params, allowed in [
        (SamplingParams(temperature=0.8, top_k=5), lambda i: set(order[i, :5].tolist())),
        (SamplingParams(temperature=1.0, top_p=0.3), None),
        (SamplingParams(temperature=1.0, min_p=0.2), None),
    ]:
        for seed in range(4):
            p = [SamplingParams(**{**params.__dict__, "seed": seed * 10 + i}) for i in range(6)]
            got = ex.sample(logits, p)
            assert got == ex.sample(logits, p), "same seed, same tokens"
            for i, tok in enumerate(got):
                z = logits[i].astype(np.float64) / params.temperature
                pr = np.exp(z - z.max())
                if allowed is not None:
                    assert tok in allowed(i)
                elif params.top_p < 1:
                    srt = np.sort(pr)[::-1] / pr.sum()
                    keep = int(np.searchsorted(np.cumsum(srt), params.top_p)) + 1
                    assert pr[tok] / pr.sum() >= srt[keep - 1] * (1 - 1e-5)
                else:
                    assert pr[tok] >= params.min_p * (1 - 1e-5)
