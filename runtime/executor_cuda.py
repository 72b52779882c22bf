"""The `cuda` executor: the bundle's kernels (templates/*.cu.j2, compiled into kernels/<target>.cubin)
run through `cuda.bindings.driver`.

At load it picks the cubin of the present GPU, allocates every device buffer once (weights, the paged
KV pool, scratch, block tables, per-step metadata) and captures the decode step of each batch bucket
(1, 2, 4, ... max_batch) as a CUDA graph. Serving allocates nothing: a decode step is one small
host-to-device copy of the step's metadata, one graph replay and one copy back (logits, or only the
sampled token ids with `decode_sample`). Prefill runs in chunks of the planned size with eager launches.

Memory layout (all device buffers):
  weights   as stored in the bundle (NVFP4 codes [N, K/2], scales [N, K/16], tscale[1]; bf16; f32)
  KV pool   [layer][K|V][page][N_KV_HEADS][PAGE_SIZE][HEAD_DIM] fp16; page 0 is the padding page
            (qkv_rope_cache_f16 writes it, attn_prefill_f16 / attn_decode_f16 read it)

Precision: tensor-core operands are fp16 where the range allows (templates/prelude.cuh.j2): the KV pool and
q, flash attention's products, and the prefill GEMM's activations for NVFP4 weights (x-plane format XF_F16,
pre-scaled by 2^-6); bf16 weights keep bf16 activations (XF_BF16). Decode GEMVs take hi/lo x planes.
  tables    block_tables [slots, max_pages] int32; slot 0 is the padding slot
"""
from __future__ import annotations

import ctypes
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from imp_runtime.bundle import Bundle, BundleError
from imp_runtime.cuda_driver import (F, I, P, U32, U64, Arena, CudaError, Module, check, cu, dtoh,
                                     gpu_available, htod)
from imp_runtime.rope import inv_freq

__all__ = ["CudaExecutor", "gpu_available", "CudaError"]

# Decode steps of up to this many rows run the tensor-core GEMV (templates/gemv.cu.j2) on x planes; larger
# batches and all prefill chunks run the GEMM. IMP_GEMV_MAX_ROWS overrides it (measurements).
GEMV_MAX_ROWS = int(os.environ.get("IMP_GEMV_MAX_ROWS", "16"))
GEMV_NB = (1, 2, 4, 8, 16)
XF_BF16, XF_F16X2, XF_BF16X2, XF_F16 = 0, 1, 2, 3      # x-plane formats (templates/prelude.cuh.j2)
XF_F16_SCALE = 2.0 ** -6
# Split-K over atomicAdd makes a GEMM's sums depend on arrival order: run to run, prefill logits then differ in
# the last bits, which the float32-accurate decode path no longer rounds away (graph replay != eager launches).
# So prefill runs without it (deterministic); decode steps above GEMV_MAX_ROWS rows keep it (their GEMMs
# have small grids and it doubles their speed). IMP_SPLIT_K_ATOMIC=1 turns it on for prefill too.
SPLIT_K_ATOMIC = os.environ.get("IMP_SPLIT_K_ATOMIC", "0") == "1"
# Programmatic dependent launch in the decode graphs (sm_90+): the kernels named here run pdl_wait() before
# touching anything an earlier kernel wrote (templates/prelude.cuh.j2), and the GEMVs load their first weights
# before it, so each starts while its predecessor finishes. IMP_PDL=0 turns it off (measurements).
PDL = os.environ.get("IMP_PDL", "1") != "0"
PDL_KERNELS = ("gemv_", "rmsnorm_residual", "rmsnorm_add", "qkv_rope_cache_f16", "attn_decode_f16",
               "attn_decode_merge", "logits_softcap", "sample_tokens")
SPLIT_MIN_KEYS = 256      # decode attention: a split covers at least this many keys (AD_MIN_SPLIT)
MAX_SPLITS = 16


def target_of(major: int, minor: int) -> str:
    return f"sm_{major}{minor}a"


def _xf_pos(k: int) -> np.ndarray:
    i = np.arange(k)
    j = i & 7
    return (i & ~7) | np.where(j & 1, 4 + (j >> 1), j >> 1)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def to_planes(a: np.ndarray, fmt: int) -> np.ndarray:
    """float32 [M, K] -> x planes [2M, K] as uint16 bits (the layout templates/prelude.cuh.j2 describes)."""
    a = np.asarray(a, np.float32)
    m, k = a.shape
    out = np.empty((2 * m, k), np.uint16)
    if fmt == XF_F16X2:
        s = np.clip(a * np.float32(XF_F16_SCALE), -65504, 65504).astype(np.float32)
        h = s.astype(np.float16)
        lo = (s - h.astype(np.float32)).astype(np.float16)
        pos = _xf_pos(k)
        out[0::2][:, pos] = h.view(np.uint16)
        out[1::2][:, pos] = lo.view(np.uint16)
    elif fmt == XF_BF16X2:
        h = _bf16_bits(a)
        out[0::2] = h
        out[1::2] = _bf16_bits(a - (h.astype(np.uint32) << 16).view(np.float32))
    else:
        raise ValueError(f"x-plane format {fmt}")
    return out


def from_planes(raw: np.ndarray, fmt: int) -> np.ndarray:
    """x planes [2M, K] uint16 bits -> the float32 [M, K] they represent (tests)."""
    raw = np.asarray(raw, np.uint16)
    if fmt == XF_F16X2:
        v = raw.view(np.float16).astype(np.float32)
        v = (v[0::2] + v[1::2]) / np.float32(XF_F16_SCALE)
        return v[:, _xf_pos(raw.shape[1])]
    if fmt == XF_BF16X2:
        v = (raw.astype(np.uint32) << 16).view(np.float32)
        return v[0::2] + v[1::2]
    raise ValueError(f"x-plane format {fmt}")


def xfmt(lin) -> int:
    """The x-plane format a decode GEMV over this linear reads."""
    return XF_F16X2 if lin.fmt == "nvfp4" else XF_BF16X2


def gfmt(lin) -> int:
    """The activation format the model path's GEMM over this linear reads: fp16 (pre-scaled) for NVFP4
    weights (gemm_nvfp4_f16), bf16 for bf16 weights (gemm_bf16)."""
    return XF_F16 if lin.fmt == "nvfp4" else XF_BF16


@dataclass
class _Linear:
    fmt: str                 # nvfp4 | bf16
    n: int
    k: int
    w: int                   # codes (nvfp4) or weights (bf16)
    scales: int = 0
    tscale: int = 0


@dataclass
class _Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class _Layer:
    attn_norm: int
    qkv: _Linear
    qkv_bias: int
    q_norm: int
    k_norm: int
    o: _Linear
    post_attn_norm: int
    ffn_norm: int
    gate_up: _Linear
    down: _Linear
    post_ffn_norm: int
    inv_freq: int
    window: int
    k_cache: int = 0
    v_cache: int = 0


class CudaExecutor:
    name = "cuda"
    _pdl = False              # launches in flight are captured into a decode graph with PDL

    def __init__(self, bundle: Bundle, kv_pages: int | None = None, max_seqs: int | None = None,
                 use_graphs: bool = True, device: int = 0):
        t0 = time.perf_counter()
        if not gpu_available():
            raise CudaError("no NVIDIA GPU with a working driver")
        self.bundle, self.spec = bundle, bundle.spec
        s = self.spec
        self.dev = check(cu.cuDeviceGet(device))
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev))
        check(cu.cuCtxSetCurrent(self.ctx))
        A = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev))
        minor = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev))
        self.sm_count = check(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev))
        self.gpu_name = check(cu.cuDeviceGetName(256, self.dev)).split(b"\0")[0].decode()
        self.target = target_of(major, minor)
        kern = bundle.manifest.get("kernels", {})
        present = kern.get("targets", [])
        if self.target not in present:
            raise BundleError(f"{bundle.path}: this GPU ({self.gpu_name}, {self.target}) has no kernels in the bundle; "
                              f"targets present: {', '.join(present) or 'none (a cpu-only bundle)'}; rebuild with "
                              f"`impc compile ... --target {self.target}` or run with --device cpu")
        self.module = Module(bundle.file(kern["cubins"][self.target]).read_bytes())
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        plan = bundle.manifest["plan"]
        tplan = plan["targets"][self.target]
        self.page = tplan["page_size"]
        self.chunk = tplan["prefill_chunk"]
        self.max_context = plan["max_context"]
        self.max_batch = plan["max_batch"]
        self.buckets = sorted(plan["graph_buckets"])
        self.max_pages = math.ceil(self.max_context / self.page)
        self.max_seqs = max_seqs or max(2 * self.max_batch, 16)
        hd = s.head_dim
        self.fa_kt = 64 if hd <= 128 else 32
        self.fa_smem = (64 * (hd + 8) + self.fa_kt * (hd + 8) + hd * (self.fa_kt + 8)) * 2
        self.module.set_max_dynamic_smem("attn_prefill_f16", self.fa_smem)

        self._load_weights()
        self._alloc_kv(kv_pages)
        self._alloc_scratch()
        self._seqs: dict[int, _Seq] = {}
        self._next = 0
        self.free_slots = list(range(self.max_seqs - 1, 0, -1))
        self.free_pages = list(range(self.kv_pages - 1, 0, -1))
        self.use_graphs = use_graphs
        self._decoding = False
        self.graphs: dict[int, object] = {}
        # PDL while capturing the decode graphs (their first kernel, the embedding gather, launches plainly)
        self.pdl = PDL and major >= 9
        self._graph_handles: list = []
        check(cu.cuStreamSynchronize(self.stream))
        if use_graphs:
            for b in self.buckets:
                self._capture(b)
        check(cu.cuStreamSynchronize(self.stream))
        self.load_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ load

    def _load_weights(self) -> None:
        s, b = self.spec, self.bundle
        tensors = b.tensors
        synthetic = b.manifest.get("synthetic")
        sizes: dict[str, int] = {}
        for name, info in tensors.items():
            shape = info["shape"]
            if info["format"] == "nvfp4":
                n, k = shape
                if k % 32:
                    raise BundleError(f"{name}: K={k} is not a multiple of 32, which the cuda kernels need")
                sizes[name + ".codes"] = n * k // 2
                sizes[name + ".scales"] = n * k // 16
                sizes[name + ".tscale"] = 4
            else:
                sizes[name] = math.prod(shape) * (2 if info["format"] == "bf16" else 4)
        self.rope_tables = {}
        for i in range(s.n_layers):
            base, scaling = s.rope_for(i)
            key = (base, scaling)
            if key not in self.rope_tables:
                self.rope_tables[key] = f"rope{len(self.rope_tables)}"
                sizes[self.rope_tables[key]] = s.head_dim // 2 * 4
        self.weights = Arena(sizes)
        self.weights_bytes = sum(sizes.values())
        st = self.stream
        for (base, scaling), key in self.rope_tables.items():
            htod(self.weights[key], inv_freq(s.head_dim, base, scaling).astype(np.float32), st)
        if synthetic:
            self._fill_synthetic(int(synthetic.get("seed", 0)))
        else:
            from safetensors import safe_open
            from imp_runtime.bundle import WEIGHTS
            with safe_open(str(b.file(WEIGHTS)), framework="numpy") as f:
                for key in sizes:
                    if key.startswith("rope"):
                        continue
                    htod(self.weights[key], f.get_tensor(key), st)
                    check(cu.cuStreamSynchronize(st))
        w = self.weights

        def lin(name: str) -> _Linear:
            info = tensors[name]
            n, k = info["shape"]
            if info["format"] == "nvfp4":
                return _Linear("nvfp4", n, k, w[name + ".codes"], w[name + ".scales"], w[name + ".tscale"])
            if info["format"] != "bf16":
                raise BundleError(f"{name}: format {info['format']} has no cuda kernel (bf16 or nvfp4 only)")
            return _Linear("bf16", n, k, w[name])

        opt = lambda name: w[name] if name in tensors else 0  # noqa: E731
        self.layers: list[_Layer] = []
        for i in range(s.n_layers):
            p = f"layers.{i}."
            base, scaling = s.rope_for(i)
            self.layers.append(_Layer(
                attn_norm=w[p + "attn_norm"], qkv=lin(p + "qkv"), qkv_bias=opt(p + "qkv_bias"),
                q_norm=opt(p + "q_norm"), k_norm=opt(p + "k_norm"), o=lin(p + "o"),
                post_attn_norm=opt(p + "post_attn_norm"), ffn_norm=w[p + "ffn_norm"], gate_up=lin(p + "gate_up"),
                down=lin(p + "down"), post_ffn_norm=opt(p + "post_ffn_norm"),
                inv_freq=w[self.rope_tables[(base, scaling)]],
                window=s.sliding_window if s.kind(i) == "sliding" else 0))
        self.final_norm = w["final_norm"]
        self.embed = lin("embed")
        self.head = self.embed if s.tie_embeddings else lin("lm_head")

    def _fill_synthetic(self, seed: int) -> None:
        """Deterministic random weights from the seed, generated on the GPU (no weights file)."""
        m, st, w = self.module, self.stream, self.weights
        grid, block = (1024,), (256,)
        for idx, (name, info) in enumerate(sorted(self.bundle.tensors.items())):
            tseed = seed * 1000003 + idx
            fmt, shape = info["format"], info["shape"]
            if fmt == "nvfp4":
                n, k = shape
                m.launch(st, "fill_random_bytes", grid, block, [P(w[name + ".codes"]), U64(n * k // 2), U64(tseed), U32(0xFF), U32(0)])
                # E4M3 codes 0x30..0x37: block scales 0.5 .. 0.94
                m.launch(st, "fill_random_bytes", grid, block, [P(w[name + ".scales"]), U64(n * k // 16), U64(tseed + 1), U32(0x07), U32(0x30)])
                # rms of a uniform random E2M1 code is 2.93, of the scales ~0.72: keep outputs ~unit variance
                htod(w[name + ".tscale"], np.array([1.0 / (2.93 * 0.72 * math.sqrt(k))], np.float32), st)
            elif fmt == "bf16":
                k = shape[-1]
                amp = 1.0 if name == "embed" else math.sqrt(3.0 / k)
                m.launch(st, "fill_random_bf16", grid, block, [P(w[name]), U64(math.prod(shape)), U64(tseed), F(amp)])
            else:
                val = 0.0 if name.endswith("qkv_bias") else 1.0
                m.launch(st, "fill_f32", grid, block, [P(w[name]), U64(math.prod(shape)), F(val)])
        check(cu.cuStreamSynchronize(st))

    def _alloc_kv(self, kv_pages: int | None) -> None:
        s = self.spec
        tplan = self.bundle.manifest["plan"]["targets"][self.target]
        page_elems = s.n_kv_heads * self.page * s.head_dim
        self.page_bytes_layer = page_elems * 2
        per_page = 2 * s.n_layers * self.page_bytes_layer
        pages = int(kv_pages or tplan["kv_pages"])
        free, _total = check(cu.cuMemGetInfo())
        headroom = 6 << 30            # scratch, graphs, and room for measurement buffers
        fit = max((int(free) - headroom) // per_page, 2)
        self.kv_pages = max(2, min(pages, fit))
        self.kv_bytes = self.kv_pages * per_page
        self.kv = int(check(cu.cuMemAlloc(self.kv_bytes)))
        check(cu.cuMemsetD8Async(self.kv, 0, self.kv_bytes, self.stream))
        for i, L in enumerate(self.layers):
            L.k_cache = self.kv + (2 * i) * self.kv_pages * self.page_bytes_layer
            L.v_cache = self.kv + (2 * i + 1) * self.kv_pages * self.page_bytes_layer

    def _alloc_scratch(self) -> None:
        s = self.spec
        R = max(self.chunk, self.max_batch, 64)
        MB = max(self.max_batch, 64)
        self.rows, self.mb = R, MB
        self.logit_rows = MB
        sizes = {
            "x": R * s.hidden * 4, "t": R * s.hidden * 4,
            "hb": R * s.hidden * 2, "ab": R * s.intermediate * 2,
            "qkv": R * (s.q_dim + 2 * s.kv_dim) * 4, "q": R * s.q_dim * 2, "attn": R * s.q_dim * 2,
            "gu": R * 2 * s.intermediate * 4, "logits": MB * s.vocab_size * 4,
            "partial": MB * s.n_heads * MAX_SPLITS * (s.head_dim + 2) * 4,
            "block_tables": self.max_seqs * self.max_pages * 4,
            "meta": self._meta_layout(R, MB),
        }
        self.scratch = Arena(sizes)
        self.scratch_bytes = self.scratch.nbytes
        check(cu.cuMemsetD8Async(self.scratch.base, 0, self.scratch.nbytes, self.stream))
        self.bt_host = np.zeros((self.max_seqs, self.max_pages), np.int32)   # slot 0 -> page 0 (padding)
        self.meta_host = np.zeros(self._meta_words, np.int32)

    def _meta_layout(self, R: int, MB: int) -> int:
        """One int32 buffer for everything a step sends to the device (one copy per step)."""
        names = [("tokens", R), ("positions", R), ("kv_slots", R), ("seq_slot", MB), ("seq_len", MB),
                 ("top_k", MB), ("step", MB), ("temperature", MB), ("top_p", MB), ("min_p", MB), ("seed", 2 * MB)]
        self._meta_off, off = {}, 0
        for n, c in names:
            self._meta_off[n] = (off, c)
            off += c
        self._meta_words = off
        return off * 4

    def meta_ptr(self, name: str) -> int:
        return self.scratch["meta"] + 4 * self._meta_off[name][0]

    def meta_view(self, name: str) -> np.ndarray:
        off, c = self._meta_off[name]
        v = self.meta_host[off:off + c]
        if name in ("temperature", "top_p", "min_p"):
            return v.view(np.float32)
        if name == "seed":
            return v.view(np.uint64)
        return v

    def close(self) -> None:
        """Give every device allocation back (the executor is unusable afterwards)."""
        for g in self._graph_handles:
            try:
                cu.cuGraphExecDestroy(g[1])
                cu.cuGraphDestroy(g[0])
            except Exception:
                pass
        self._graph_handles, self.graphs = [], {}
        for arena in ("weights", "scratch"):
            a = getattr(self, arena, None)
            if a is not None:
                a.free()
        if getattr(self, "kv", 0):
            cu.cuMemFree(self.kv)
            self.kv = 0

    def memory(self) -> dict:
        free, total = check(cu.cuMemGetInfo())
        return {"weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes, "kv_pages": self.kv_pages,
                "scratch_bytes": self.scratch_bytes, "device_used_bytes": int(total) - int(free),
                "device_total_bytes": int(total)}

    # ------------------------------------------------------------------ sequences

    def new_sequence(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_seqs - 1} sequence slots are in use")
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = _Seq(slot=self.free_slots.pop())
        return sid

    def free(self, sid: int) -> None:
        seq = self._seqs.pop(sid, None)
        if seq is not None:
            self.free_pages.extend(reversed(seq.pages))
            self.free_slots.append(seq.slot)

    def length(self, sid: int) -> int:
        return self._seqs[sid].length

    def _reserve(self, seq: _Seq, n: int) -> None:
        if n > self.max_context:
            raise ValueError(f"sequence of {n} tokens exceeds the context of {self.max_context}")
        need = math.ceil(n / self.page)
        if need <= len(seq.pages):
            return
        first = len(seq.pages)
        while len(seq.pages) < need:
            if not self.free_pages:
                raise RuntimeError("the KV cache is full")
            seq.pages.append(self.free_pages.pop())
        self.bt_host[seq.slot, first:need] = seq.pages[first:need]
        row = self.scratch["block_tables"] + (seq.slot * self.max_pages + first) * 4
        htod(row, self.bt_host[seq.slot, first:need], self.stream)

    def _slot_of(self, seq: _Seq, pos: int) -> int:
        return seq.pages[pos // self.page] * self.page + pos % self.page

    # ------------------------------------------------------------------ kernels

    def _launch(self, name, grid, block, args, smem=0):
        pdl = self._pdl and name.startswith(PDL_KERNELS)
        self.module.launch(self.stream, name, grid, block, args, smem, pdl=pdl)

    def linear(self, a: int, lin: _Linear, out: int, m: int, mode: int, split_k: bool = False,
               planes: bool = False, afmt: int | None = None) -> None:
        """out[m, N] (=|+=) a[m, K] @ W^T. mode 0: store, 1: add. planes: a holds x planes in xfmt(lin)
        (decode, m <= 16: the tensor-core GEMV); otherwise a is [m, K] in format afmt (the tensor-core GEMM),
        which must be gfmt(lin) (the default): XF_F16 (fp16 of a * 2^-6) for NVFP4 weights, XF_BF16 for bf16."""
        if afmt is None:
            afmt = gfmt(lin)
        if planes:
            nb = next(b for b in GEMV_NB if b >= m)
            grid = ((lin.n + 15) // 16,)
            if lin.fmt == "nvfp4":
                self._launch(f"gemv_nvfp4_nb{nb}", grid, (256,),
                             [P(a), P(lin.w), P(lin.scales), P(lin.tscale), P(out), I(lin.n), I(lin.k), I(m), I(mode)])
            else:
                self._launch(f"gemv_bf16_nb{nb}", grid, (256,), [P(a), P(lin.w), P(out), I(lin.n), I(lin.k), I(m), I(mode)])
            return
        gx, gy = (lin.n + 127) // 128, (m + 63) // 64
        splits = 1
        if split_k and (SPLIT_K_ATOMIC or self._decoding):
            ktiles = (lin.k + 63) // 64
            splits = max(1, min(ktiles // 2, (2 * self.sm_count) // (gx * gy)))
        if splits > 1:
            if mode == 0:
                check(cu.cuMemsetD32Async(out, 0, m * lin.n, self.stream))
            mode = 2
        if lin.fmt == "nvfp4":
            if afmt != XF_F16:
                raise ValueError("NVFP4 weights take XF_F16 activations")
            self._launch("gemm_nvfp4_f16", (gx, gy, splits), (256,),
                         [P(a), P(lin.w), P(lin.scales), P(lin.tscale), P(out), I(m), I(lin.n), I(lin.k), I(mode)])
        else:
            if afmt != XF_BF16:
                raise ValueError("bf16 weights take bf16 activations")
            self._launch("gemm_bf16", (gx, gy, splits), (256,), [P(a), P(lin.w), P(out), I(m), I(lin.n), I(lin.k), I(mode)])

    def gated(self, a: int, lin: _Linear, out: int, m: int, ofmt: int) -> None:
        """out = act(gate) * up of gate_up(a), for m <= 16 rows of x planes; out as x planes of format ofmt."""
        nb = next(b for b in GEMV_NB if b >= m)
        grid = ((lin.n // 2 + 15) // 16,)
        if lin.fmt == "nvfp4":
            self._launch(f"gemv_gated_nvfp4_nb{nb}", grid, (256,),
                         [P(a), P(lin.w), P(lin.scales), P(lin.tscale), P(out), I(lin.n), I(lin.k), I(m), I(ofmt)])
        else:
            self._launch(f"gemv_gated_bf16_nb{nb}", grid, (256,), [P(a), P(lin.w), P(out), I(lin.n), I(lin.k), I(m), I(ofmt)])

    def _layers(self, m: int, attention, dec: bool = False) -> None:
        """Every layer over the m rows in scratch x; attention(layer) fills scratch attn from scratch q.
        dec: a decode step of m <= GEMV_MAX_ROWS rows: activations go through x planes into the GEMV."""
        s, sc = self.spec, self.scratch
        x, t, hb, ab = sc["x"], sc["t"], sc["hb"], sc["ab"]
        fmt = xfmt if dec else gfmt
        for L in self.layers:
            self._launch("rmsnorm_residual", (m,), (256,), [P(x), P(0), P(L.attn_norm), P(hb), I(fmt(L.qkv))])
            self.linear(hb, L.qkv, sc["qkv"], m, 0, split_k=True, planes=dec, afmt=fmt(L.qkv))
            self._launch("qkv_rope_cache_f16", (m,), (128,),
                         [P(sc["qkv"]), P(L.qkv_bias), P(L.q_norm), P(L.k_norm), P(L.inv_freq),
                          P(self.meta_ptr("positions")), P(self.meta_ptr("kv_slots")), P(sc["q"]),
                          P(L.k_cache), P(L.v_cache)])
            attention(L)
            if s.sandwich_norm:
                self.linear(sc["attn"], L.o, t, m, 0, split_k=True, planes=dec, afmt=fmt(L.o))
                self._launch("rmsnorm_add", (m,), (256,), [P(t), P(L.post_attn_norm), P(x)])
            else:
                self.linear(sc["attn"], L.o, x, m, 1, split_k=True, planes=dec, afmt=fmt(L.o))
            self._launch("rmsnorm_residual", (m,), (256,), [P(x), P(0), P(L.ffn_norm), P(hb), I(fmt(L.gate_up))])
            if dec:
                self.gated(hb, L.gate_up, ab, m, xfmt(L.down))
            else:
                self.linear(hb, L.gate_up, sc["gu"], m, 0, split_k=True, afmt=gfmt(L.gate_up))
                self._launch("act_gated_x", ((s.intermediate + 255) // 256, m), (256,),
                             [P(sc["gu"]), P(ab), I(gfmt(L.down))])
            if s.sandwich_norm:
                self.linear(ab, L.down, t, m, 0, split_k=True, planes=dec, afmt=fmt(L.down))
                self._launch("rmsnorm_add", (m,), (256,), [P(t), P(L.post_ffn_norm), P(x)])
            else:
                self.linear(ab, L.down, x, m, 1, split_k=True, planes=dec, afmt=fmt(L.down))

    def _embed(self, m: int) -> None:
        sc = self.scratch
        if self.embed.fmt == "nvfp4":
            self._launch("embedding_gather_nvfp4", (m,), (256,),
                         [P(self.meta_ptr("tokens")), P(self.embed.w), P(self.embed.scales), P(self.embed.tscale), P(sc["x"])])
        else:
            self._launch("embedding_gather", (m,), (256,), [P(self.meta_ptr("tokens")), P(self.embed.w), P(sc["x"])])

    def _head(self, row0: int, m: int) -> None:
        """logits[0:m] = head(final_norm(x[row0:row0+m]))."""
        s, sc = self.spec, self.scratch
        x = sc["x"] + row0 * s.hidden * 4
        dec = m <= GEMV_MAX_ROWS
        self._launch("rmsnorm_residual", (m,), (256,), [P(x), P(0), P(self.final_norm), P(sc["hb"]),
                                                         I(xfmt(self.head) if dec else gfmt(self.head))])
        self.linear(sc["hb"], self.head, sc["logits"], m, 0, split_k=True, planes=dec,
                    afmt=xfmt(self.head) if dec else gfmt(self.head))
        if s.final_softcap:
            self._launch("logits_softcap", ((s.vocab_size + 255) // 256, m), (256,), [P(sc["logits"])])

    def _splits(self, b: int) -> int:
        return max(1, min(MAX_SPLITS, -(-2 * self.sm_count // (b * self.spec.n_kv_heads))))

    def _decode_launches(self, b: int) -> None:
        s, sc = self.spec, self.scratch
        splits = self._splits(b)
        dec = b <= GEMV_MAX_ROWS
        self._decoding = True
        self._embed(b)

        def attention(L: _Layer) -> None:
            self._launch("attn_decode_f16", (b, s.n_kv_heads, splits), (128,),
                         [P(sc["q"]), P(L.k_cache), P(L.v_cache), P(sc["block_tables"]), P(self.meta_ptr("seq_slot")),
                          P(self.meta_ptr("seq_len")), P(sc["partial"]), I(L.window), I(self.max_pages)])
            self._launch("attn_decode_merge", (b, s.n_heads), (s.head_dim,),
                         [P(sc["partial"]), P(sc["attn"]), I(splits), I(xfmt(L.o) if dec else gfmt(L.o))])

        self._layers(b, attention, dec)
        self._head(0, b)
        self._decoding = False
        self._launch("sample_tokens", (b,), (1024,),
                     [P(sc["logits"]), P(self.meta_ptr("temperature")), P(self.meta_ptr("top_k")),
                      P(self.meta_ptr("top_p")), P(self.meta_ptr("min_p")), P(self.meta_ptr("seed")),
                      P(self.meta_ptr("step")), P(self.meta_ptr("tokens") + 0)])

    def _capture(self, b: int) -> None:
        st = self.stream
        check(cu.cuStreamBeginCapture(st, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        self._pdl = self.pdl
        try:
            self._decode_launches(b)
        finally:
            self._pdl = False
            graph = check(cu.cuStreamEndCapture(st))
        gexec = check(cu.cuGraphInstantiate(graph, 0))
        self.graphs[b] = gexec
        self._graph_handles.append((graph, gexec))

    # ------------------------------------------------------------------ forward

    def _send_meta(self) -> None:
        htod(self.scratch["meta"], self.meta_host, self.stream)

    def prefill(self, sid: int, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to sequence sid; logits of the last token [V], or of every token [T, V]."""
        s, sc = self.spec, self.scratch
        seq = self._seqs[sid]
        if not tokens:
            raise ValueError("no tokens to prefill")
        self._reserve(seq, seq.length + len(tokens))
        rows = []
        for c0 in range(0, len(tokens), self.chunk):
            chunk = tokens[c0:c0 + self.chunk]
            t, start = len(chunk), seq.length
            pos = np.arange(start, start + t)
            self.meta_view("tokens")[:t] = chunk
            self.meta_view("positions")[:t] = pos
            self.meta_view("kv_slots")[:t] = [self._slot_of(seq, p) for p in pos]
            self._send_meta()
            self._embed(t)
            bt_row = sc["block_tables"] + seq.slot * self.max_pages * 4

            def attention(L: _Layer, t=t, start=start) -> None:
                self._launch("attn_prefill_f16", ((t + 63) // 64, s.n_heads), (128,),
                             [P(sc["q"]), P(L.k_cache), P(L.v_cache), P(bt_row), I(start), I(t), I(L.window),
                              P(sc["attn"]), I(gfmt(L.o))], smem=self.fa_smem)

            self._layers(t, attention)
            seq.length = start + t
            if all_logits:      # in pieces the decode GEMV takes: float32-accurate logits, as decode's
                step = min(self.logit_rows, GEMV_MAX_ROWS) if GEMV_MAX_ROWS > 0 else self.logit_rows
                for r0 in range(0, t, step):
                    n = min(step, t - r0)
                    self._head(r0, n)
                    rows.append(dtoh(np.empty((n, s.vocab_size), np.float32), sc["logits"], self.stream))
        if all_logits:
            return np.concatenate(rows)
        self._head(t - 1, 1)
        return dtoh(np.empty(s.vocab_size, np.float32), sc["logits"], self.stream)

    def _decode_step(self, sids: list[int], tokens: list[int], params: list | None) -> int:
        n = len(sids)
        if n == 0 or n > self.max_batch:
            raise ValueError(f"decode batch of {n} (1..{self.max_batch})")
        b = next(x for x in self.buckets if x >= n)
        mh = self.meta_view
        tok, pos, slots = mh("tokens"), mh("positions"), mh("kv_slots")
        sslot, slen = mh("seq_slot"), mh("seq_len")
        temp, topk, topp, minp, seed, step = mh("temperature"), mh("top_k"), mh("top_p"), mh("min_p"), mh("seed"), mh("step")
        for i, (sid, t) in enumerate(zip(sids, tokens)):
            seq = self._seqs[sid]
            self._reserve(seq, seq.length + 1)
            tok[i], pos[i], slots[i] = t, seq.length, self._slot_of(seq, seq.length)
            sslot[i], slen[i] = seq.slot, seq.length + 1
            p = params[i] if params else None
            temp[i] = p.temperature if p else 0.0
            topk[i] = p.top_k if p else 0
            topp[i] = p.top_p if p else 1.0
            minp[i] = p.min_p if p else 0.0
            seed[i] = (p.seed if p and p.seed is not None else 0) & 0xFFFFFFFFFFFFFFFF
            step[i] = seq.length
        for i in range(n, b):                      # padding rows: the padding page and slot
            tok[i], pos[i], slots[i], sslot[i], slen[i], temp[i] = 0, 0, 0, 0, 1, 0.0
        self._send_meta()
        if self.use_graphs:
            check(cu.cuGraphLaunch(self.graphs[b], self.stream))
        else:
            self._decode_launches(b)
        for sid in sids:
            self._seqs[sid].length += 1
        return b

    def decode(self, sids: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each sequence: logits [B, V]."""
        self._decode_step(sids, tokens, None)
        return dtoh(np.empty((len(sids), self.spec.vocab_size), np.float32), self.scratch["logits"], self.stream)

    def decode_sample(self, sids: list[int], tokens: list[int], params: list | None = None) -> list[int]:
        """One token for each sequence, sampled on the GPU (params: SamplingParams per sequence, or None
        for greedy); only the token ids come back to the host."""
        self._decode_step(sids, tokens, params)
        out = dtoh(np.empty(len(sids), np.int32), self.meta_ptr("tokens"), self.stream)
        return out.tolist()

    def sample(self, logits: np.ndarray, params: list) -> list[int]:
        """The GPU sampler on given logits [B, V] (tests; the decode graph runs the same kernel)."""
        b = logits.shape[0]
        htod(self.scratch["logits"], logits.astype(np.float32), self.stream)
        mh = self.meta_view
        for i, p in enumerate(params):
            mh("temperature")[i], mh("top_k")[i], mh("top_p")[i] = p.temperature, p.top_k, p.top_p
            mh("min_p")[i], mh("seed")[i], mh("step")[i] = p.min_p, p.seed or 0, i
        self._send_meta()
        sc = self.scratch
        self._launch("sample_tokens", (b,), (1024,),
                     [P(sc["logits"]), P(self.meta_ptr("temperature")), P(self.meta_ptr("top_k")),
                      P(self.meta_ptr("top_p")), P(self.meta_ptr("min_p")), P(self.meta_ptr("seed")),
                      P(self.meta_ptr("step")), P(self.meta_ptr("tokens"))])
        return dtoh(np.empty(b, np.int32), self.meta_ptr("tokens"), self.stream).tolist()

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.stream))
