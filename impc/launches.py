"""Stage 4b: the launch program (runtime/program.py describes its form).

From the model spec, each tensor's stored format, the target (targets/<arch>/target.json) and the memory
plan, decide once every device buffer and, for every decode batch bucket, the prefill chunk and the logits
buckets, the exact sequence of kernel launches: which kernel, its grid and block, its shared memory, its
arguments, and the bytes it moves. The cuda executor only binds and replays what is written here; kernel
tests take their launches from here too, so a grid or an argument list exists in one place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from impc.errors import CompileError
from imp_runtime.activation_formats import GEMV_NB, XF_BF16, XF_F16, XF_F16W, gfmt, xfmt
from imp_runtime.nvfp4 import BLOCK
from imp_runtime.program import ALIGN, Buffer, Launch, Phase, Program, evaluate, validate
from imp_runtime.rope import inv_freq
from imp_runtime.spec import ModelSpec

# Kernels that begin with pdl_wait() (templates/prelude.cuh.j2), so the decode graphs may launch them with
# programmatic dependent launch: each starts while its predecessor drains, its weight loads issued early.
PDL_KERNELS = ("gemv_", "rmsnorm_residual", "rmsnorm_add", "qkv_rope_cache_f16", "attn_decode_f16",
               "logits_softcap", "sample_tokens", "gemm_wq", "apply_penalties", "count_sampled")
ATTN_GRID_SPLITS = 16         # decode attention: at most this many blocks per (sequence, kv head)
ATTN_MAX_SPLITS = 64          # and at most this many splits of a sequence's keys (templates/attn_decode.cu.j2)
GEMM_TILE_N, GEMM_TILE_M, GEMM_TILE_K = 128, 64, 64     # templates/gemm.cu.j2
WG_TILE_M, WG_TILE_K = 128, 64                          # templates/gemm_wgmma.cu.j2 (tiles 128 x BN x 64; rendered
WG_STAGES = {64: 8, 128: 6, 256: 4}                     # from these), its ring depth per BN: ~192 KB of shared memory
WG_SMALL_CHUNK = 128     # Hopper: smaller prefill phases for chunks of one row tile (split keys) and of two
WG_MID_CHUNK = 256       # (a mixed step: decode rows plus a short prefill chunk), their GEMMs split over K
FA_KV_SPLIT = 512        # that phase's attention: keys a block (templates/attn_prefill.cu.j2, split keys)
MAX_SEGMENTS = 16        # sequences' chunks one call of the largest prefill phase takes (a tile table each step)
FA_TILE_INTS = 8         # ints of a tile-table entry (templates/attn_prefill.cu.j2)
# templates/gemm_wgmma_nvfp4.cu.j2 (rendered from these): a kernel per NB, the activation rows of a block (wgmma's N),
# with its activation ring depth; K a stage, weight rows a block, raw stages in flight and their bytes (codes + scales)
WQ_RA = {16: 4, 32: 4, 64: 4}
WQ_NB = tuple(WQ_RA)
WQ_K, WQ_ROWS, WQ_RW = 256, 64, 8
WQ_RAW = WQ_ROWS * (WQ_K // 2 + WQ_K // BLOCK)
F16_NVFP4_UNSCALE = 2.0 ** 20    # NVFP4 expanded to fp16 holds q * s * 2^-14, its XF_F16 activations x * 2^-6
LOGITS_BUCKETS = (1, 16)      # rows of logits one call computes (the last prompt token; all-token logits)
ROWS = {"sym": "rows"}


@dataclass(frozen=True)
class ProgramOptions:
    """Compile options that shape the launch sequence (recorded in the manifest and the program)."""
    gemv_max_rows: int | None = None   # decode steps of up to this many rows use the GEMV, larger ones the GEMM
                                       # (None: ProgramBuilder.gemv_rows decides by the shape)
    pdl: bool = True                # programmatic dependent launch inside the decode graphs
    prefill_split_k: bool = False   # atomic split-K in prefill GEMMs (faster for small chunks, not bitwise
                                    # reproducible: sums then depend on arrival order)
    decode_gemm: str = "nvfp4"      # Hopper decode batches past the GEMV: the wgmma GEMM reading NVFP4 as stored
                                    # (nvfp4) or the fp16 copies (fp16)
    gpu_penalties: bool = False     # repetition / presence / frequency penalties applied on the GPU before sampling
                                    # (per-sequence token counts on the device); off: the host samples such rows

    def to_dict(self) -> dict:
        return {"gemv_max_rows": self.gemv_max_rows, "pdl": self.pdl, "prefill_split_k": self.prefill_split_k,
                "decode_gemm": self.decode_gemm, "gpu_penalties": self.gpu_penalties}


def rows_for(chunk: int, max_batch: int) -> tuple[int, int]:
    """(R, MB): rows of the activation scratch (the widest of a prefill chunk and a decode batch) and rows
    of the logits/sampling scratch."""
    return max(chunk, max_batch, 64), max(max_batch, 64)


def scratch_sizes(spec: ModelSpec, rows: int, logit_rows: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, bytes) of every scratch buffer (the plan counts them before KV)."""
    s, R, MB = spec, rows, logit_rows
    qkv = s.q_dim + 2 * s.kv_dim
    return {
        "x": ("f32", (R, s.hidden), R * s.hidden * 4),                 # the residual stream
        "t": ("f32", (R, s.hidden), R * s.hidden * 4),                 # a projection before a sandwich norm
        "hb": ("u16", (R, s.hidden), R * s.hidden * 2),                # normed x: GEMM input or GEMV planes
        "ab": ("u16", (R, s.intermediate), R * s.intermediate * 2),    # act(gate) * up
        "qkv": ("f32", (R, qkv), R * qkv * 4),
        "q": ("f16", (R, s.q_dim), R * s.q_dim * 2),
        "attn": ("u16", (R, s.q_dim), R * s.q_dim * 2),
        "gu": ("f32", (R, 2 * s.intermediate), R * 2 * s.intermediate * 4),
        "logits": ("f32", (MB, s.vocab_size), MB * s.vocab_size * 4),
        "partial": ("f32", (MB, s.n_heads, ATTN_MAX_SPLITS, s.head_dim + 2),
                    MB * s.n_heads * ATTN_MAX_SPLITS * (s.head_dim + 2) * 4),
        "attn_counts": ("i32", (MB, s.n_kv_heads), MB * s.n_kv_heads * 4),    # decode attention's blocks done
        "sampled": ("i32", (MB,), MB * 4),
    }


def max_tiles(rows: int) -> int:
    """Query tiles of the largest prefill phase's attention at most: its rows in tiles of 64 (the smallest), one
    partial tile more per sequence."""
    return -(-rows // 64) + MAX_SEGMENTS


def step_sizes(rows: int, logit_rows: int, penalties: bool = False) -> dict[str, tuple[str, int]]:
    """The values the host sends each step (one contiguous copy): name -> (dtype, count)."""
    R, MB = rows, logit_rows
    out = {"tokens": ("i32", R), "positions": ("i32", R), "kv_slots": ("i32", R), "seq_slot": ("i32", MB),
           "seq_len": ("i32", MB), "top_k": ("i32", MB), "step": ("i32", MB), "temperature": ("f32", MB),
           "top_p": ("f32", MB), "min_p": ("f32", MB), "seed": ("u64", MB),
           "fa_tiles": ("i32", FA_TILE_INTS * max_tiles(R))}
    if penalties:
        out.update({"repetition_penalty": ("f32", MB), "presence_penalty": ("f32", MB),
                    "frequency_penalty": ("f32", MB)})
    return out


def penalty_tables(spec: ModelSpec, max_seqs: int) -> dict[str, tuple[str, tuple[int, int], int]]:
    """The GPU penalties' per-sequence state (rows by sequence slot; the host writes a row when a sequence with
    penalties starts, the sampler adds each token it draws): name -> (dtype, shape, bytes)."""
    v, words = spec.vocab_size, -(-spec.vocab_size // 32)
    return {"pen_counts": ("i32", (max_seqs, v), max_seqs * v * 4),           # tokens generated so far
            "pen_seen": ("i32", (max_seqs, words), max_seqs * words * 4)}      # prompt tokens, one bit each


def wg_smem_bytes(bn: int) -> int:
    """Dynamic shared memory of gemm_wg<bn>: the ring, 1 KB to align it for the 128-byte swizzle, barriers."""
    return WG_STAGES[bn] * (WG_TILE_M + bn) * WG_TILE_K * 2 + 1024 + 256


def wq_shape(spec: ModelSpec) -> bool:
    """Whether any layer linear of this shape can run gemm_wq (K a multiple of WQ_K: qkv and gate_up read the hidden
    size, o the query width; down only after a gate_up on it): the kernels are emitted only then (nvcc time)."""
    return spec.hidden % WQ_K == 0 or spec.q_dim % WQ_K == 0


def wq_smem_bytes(nb: int) -> int:
    """Dynamic shared memory of gemm_wq<nb>: the consumers' reduction, the activation and raw rings, 1 KB to
    align them for the 128-byte swizzle, barriers."""
    return nb * 256 + WQ_RA[nb] * nb * WQ_K * 2 + WQ_RW * WQ_RAW + 1024 + 8 * 2 * (WQ_RW + WQ_RA[nb])


def wgmma_weights(spec: ModelSpec, formats: dict[str, str]) -> list[tuple[str, int, int]]:
    """(name, N, K) of the NVFP4 layer linears the wgmma prefill GEMM reads expanded to fp16."""
    return [(name, *shape) for name, shape in spec.tensor_shapes().items()
            if name.startswith("layers.") and formats[name] == "nvfp4"]


def prefill_weights_mode(spec: ModelSpec, formats: dict[str, str], target: dict, vram_bytes: int,
                         choice: str = "auto") -> str:
    """How prefill reads NVFP4 weights on this target:
    - "none": no wgmma (not Hopper): the mma.sync GEMM expands them in registers;
    - "copy": an fp16 copy of every layer linear, expanded once at load (the init phase), when the copies
      take at most a quarter of the device memory (8B: 14 GB of 139): prefill is then pure GEMM;
    - "dequant": each linear expanded into one scratch buffer just before its GEMM, every prefill chunk
      (bigger models; costs ~0.3 ms a layer of the 8B shape per chunk, bandwidth-bound)."""
    if choice not in ("auto", "copy", "dequant"):
        raise CompileError(f"--prefill-weights {choice}: choose auto, copy or dequant")
    if target["compute_capability"][0] != 9:
        return "none"
    if choice != "auto":
        return choice
    copy = sum(n * k * 2 for _, n, k in wgmma_weights(spec, formats))
    return "copy" if copy <= vram_bytes // 4 else "dequant"


def fa_splits_max(max_context: int) -> int:
    """Key splits of the small prefill phase's attention at most: ceil(start / FA_KV_SPLIT) + 1 (the last holds
    the chunk's own keys) for a start below the context."""
    return -(-max_context // FA_KV_SPLIT) + 1


def aligned(n: int) -> int:
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


def arena_entries(spec: ModelSpec, formats: dict[str, str], rows: int, logit_rows: int, max_seqs: int,
                  max_pages: int, page: int, kv_pages: int, wg_mode: str = "none", penalties: bool = False) -> list[tuple]:
    """Every buffer of the arena in order: (name, kind, dtype, shape, bytes, values). Weights first (as the
    bundle stores them), then constants, block tables, step values, scratch, and the KV pool last."""
    out: list[tuple] = []
    for name, shape in spec.tensor_shapes().items():
        fmt = formats[name]
        if fmt == "nvfp4":
            n, k = shape
            if k % 32:
                raise CompileError(f"{name}: K={k} is not a multiple of 32, which the GPU kernels need; "
                                   f"compile with --target none (cpu only) or --quant bf16")
            out += [(name + ".codes", "weight", "u8", (n, k // 2), n * k // 2, None),
                    (name + ".scales", "weight", "u8", (n, k // BLOCK), n * k // BLOCK, None),
                    (name + ".tscale", "weight", "f32", (1,), 4, None)]
        else:
            out.append((name, "weight", "bf16" if fmt == "bf16" else "f32", shape,
                        math.prod(shape) * (2 if fmt == "bf16" else 4), None))
    for j, (base, scaling) in enumerate(rope_variants(spec)):
        vals = tuple(float(v) for v in inv_freq(spec.head_dim, base, scaling).astype("float32"))
        out.append((f"rope.{j}", "const", "f32", (spec.head_dim // 2,), spec.head_dim // 2 * 4, vals))
    out.append(("block_tables", "table", "i32", (max_seqs, max_pages), max_seqs * max_pages * 4, None))
    if penalties:
        out += [(name, "table", dtype, shape, nbytes, None) for name, (dtype, shape, nbytes)
                in penalty_tables(spec, max_seqs).items()]
    for name, (dtype, count) in step_sizes(rows, logit_rows, penalties).items():
        out.append((name, "step", dtype, (count,), count * (8 if dtype == "u64" else 4), None))
    for name, (dtype, shape, nbytes) in scratch_sizes(spec, rows, logit_rows).items():
        out.append((name, "scratch", dtype, shape, nbytes, None))
    wg = wgmma_weights(spec, formats)
    if wg_mode == "copy":
        out += [(name + ".f16", "scratch", "f16", (n, k), n * k * 2, None) for name, n, k in wg]
    elif wg_mode == "dequant" and wg:
        n, k = max(((n, k) for _, n, k in wg), key=lambda s: s[0] * s[1])
        out.append(("wdq", "scratch", "f16", (n, k), n * k * 2, None))
    if wg_mode != "none":      # the small prefill phase: its attention's key-split partials, and the split-K
        # partial sums and turn flags of its GEMMs (gemm_wgmma)
        n = fa_splits_max(max_pages * page) * WG_SMALL_CHUNK * spec.n_heads * (spec.head_dim + 2)
        out.append(("fa_partial", "scratch", "f32", (n,), n * 4, None))
        tiles = max(-(-shape[0] // 64) for name, shape in spec.tensor_shapes().items() if name.startswith("layers.")
                    and len(shape) == 2)
        tiles = 2 * tiles + 4       # two row tiles (the mid phase) of 64-column tiles, or of wider ones rounded up
        out += [("wg_ws", "scratch", "f32", (tiles, 64 * 128), tiles * 64 * 128 * 4, None),
                ("wg_flags", "scratch", "i32", (tiles,), tiles * 4, None)]
    page_bytes = spec.n_kv_heads * page * spec.head_dim * 2
    for i in range(spec.n_layers):
        for kv in ("k", "v"):
            out.append((f"kv.{i}.{kv}", "kv", "f16", (kv_pages, spec.n_kv_heads, page, spec.head_dim),
                        kv_pages * page_bytes, None))
    return out


def fixed_arena_bytes(spec: ModelSpec, formats: dict[str, str], rows: int, logit_rows: int, max_seqs: int,
                      max_pages: int, wg_mode: str = "none", penalties: bool = False) -> int:
    """Bytes of the arena before the KV pool (the plan gives what is left to KV pages)."""
    return sum(aligned(e[4]) for e in arena_entries(spec, formats, rows, logit_rows, max_seqs, max_pages, 16, 0,
                                                    wg_mode, penalties) if e[1] != "kv")


def rope_variants(spec: ModelSpec) -> list[tuple]:
    """The distinct (base, scaling) RoPE tables of the layers, in first-use order."""
    return list(dict.fromkeys(spec.rope_for(i) for i in range(spec.n_layers)))


def fa_geometry(head_dim: int, smem_limit: int) -> tuple[int, int, int]:
    """(threads, query rows, dynamic shared memory) of a block of attn_prefill_f16 (templates/attn_prefill.cu.j2):
    4 warps of 2 row blocks of 16 (1 above head_dim 128), the Q tile and two double-buffered K and V tiles of
    64 keys (32 where that would not fit the target's shared memory)."""
    qt, ld = 4 * 16 * (2 if head_dim <= 128 else 1), head_dim + 8
    kt = 64 if (qt + 4 * 64) * ld * 2 <= smem_limit else 32
    return 128, qt, (qt * ld + 4 * kt * ld) * 2


@dataclass
class _Lin:
    name: str
    fmt: str
    n: int
    k: int

    def weight_args(self) -> list[dict]:
        if self.fmt == "nvfp4":
            return [ptr(self.name + ".codes"), ptr(self.name + ".scales"), ptr(self.name + ".tscale")]
        return [ptr(self.name)]

    def reads(self) -> list[tuple[str, int]]:
        if self.fmt == "nvfp4":
            return [(self.name + ".codes", self.n * self.k // 2), (self.name + ".scales", self.n * self.k // BLOCK),
                    (self.name + ".tscale", 4)]
        return [(self.name, self.n * self.k * 2)]


def ptr(name: str | None, offset=0) -> dict:
    return {"ptr": name} if offset == 0 else {"ptr": name, "offset": offset}


def i32(v) -> dict:
    return {"i32": v}


def tmap(name: str, dtype: str, rows: int, cols: int, box_rows: int, box_cols: int = 64) -> dict:
    """A TMA descriptor argument: buffer `name` as a row-major [rows, cols] matrix of `dtype`, read in
    [box_rows, box_cols] boxes: 16-bit with the 128-byte swizzle (64 columns), u8 unswizzled
    (runtime/cuda_program.py builds it at bind time)."""
    return {"tmap": {"ptr": name, "dtype": dtype, "rows": rows, "cols": cols, "box_rows": box_rows,
                     "box_cols": box_cols}}


def ev(v, rows: int, dec_max: int | None = None) -> int:
    """A value at `rows` (reads and writes are counted at the phase's full size; decode rows riding in a prefill
    phase at most dec_max)."""
    return evaluate(v, {"rows": rows, "prows": rows, "dec": min(rows, dec_max or rows)})


def rows_div(rows, d: int):
    """ceil(rows / d) for rows an int or a plain symbol ({"sym": name})."""
    return {"sym": rows["sym"], "ceil_div": d} if isinstance(rows, dict) else -(-rows // d)


@dataclass
class _Emitter:
    """Records the launches of one phase."""
    pdl: bool
    launches: list[Launch] = field(default_factory=list)
    no_pdl_next: bool = False       # the next launch waits for its predecessor to finish (see decode's attention)

    def add(self, kernel: str, grid, block, args, reads, writes, smem: int = 0) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        pdl, self.no_pdl_next = self.pdl and not self.no_pdl_next, False
        self.launches.append(Launch(kernel, grid, block, smem, pdl and kernel.startswith(PDL_KERNELS),
                                    tuple(args), tuple((b, int(n)) for b, n in reads if n),
                                    tuple((b, int(n)) for b, n in writes if n)))


class ProgramBuilder:
    def __init__(self, spec: ModelSpec, formats: dict[str, str], target: dict, plan: dict,
                 options: ProgramOptions, synthetic_seed: int | None = None):
        self.spec, self.formats, self.target, self.plan, self.opt = spec, formats, target, plan, options
        self.gemv_rows = options.gemv_max_rows
        self.seed = synthetic_seed
        t = plan["targets"][target["name"]]
        self.page, self.chunk, self.kv_pages = t["page_size"], t["prefill_chunk"], t["kv_pages"]
        self.max_context, self.max_batch = plan["max_context"], plan["max_batch"]
        self.max_pages = math.ceil(self.max_context / self.page)
        self.max_seqs = plan["max_sequences"]
        self.R, self.MB = rows_for(self.chunk, self.max_batch)
        self.sm_count = target["sm_count"]
        self.fa_threads, self.fa_qt, self.fa_smem = fa_geometry(spec.head_dim, target["smem_per_block_bytes"])
        self.wg_mode = t.get("prefill_weights", "none")
        if self.gemv_rows is None:
            self.gemv_rows = self.default_gemv_rows()
        self.kernel_smem = {"attn_prefill_f16": self.fa_smem}
        self.buffers: dict[str, Buffer] = {}

    def default_gemv_rows(self) -> int:
        """Decode batches up to this many rows on the GEMV, by measurement on the H200 (BENCHMARKS.md):
        - where Hopper's NVFP4 decode GEMM takes every layer linear (K a multiple of 256): 4 rows for hidden sizes
          of 4096 and up (8B, batch 8: 1800 tok/s on the GEMM against 1652 on the GEMV), else 8 (Qwen3-0.6B shape:
          batch 8 6319 on the GEMV against 5934, batch 16 10871 on the GEMM against 10225);
        - else, against the wgmma GEMM over the fp16 copies: 8 rows for hidden 4096 and up (2370 against 2252 tok/s
          at 16 rows), 16 below (0.6B 10.5k against 6.4k, SmolLM2 16.2k against 8.6k)."""
        big = self.spec.hidden >= 4096
        if self.wg_mode != "none" and self.opt.decode_gemm == "nvfp4" and all(
                k % WQ_K == 0 for name, (n, k) in self.linear_shapes() if self.formats[name] == "nvfp4"):
            return 4 if big else 8
        return 8 if self.wg_mode == "copy" and big else 16

    def linear_shapes(self) -> list[tuple[str, tuple[int, int]]]:
        return [(name, shape) for name, shape in self.spec.tensor_shapes().items()
                if name.startswith("layers.") and len(shape) == 2]

    # ------------------------------------------------------------------ arena

    def layout(self) -> None:
        offset = 0
        for name, kind, dtype, shape, nbytes, values in arena_entries(
                self.spec, self.formats, self.R, self.MB, self.max_seqs, self.max_pages, self.page, self.kv_pages,
                self.wg_mode, self.opt.gpu_penalties):
            self.buffers[name] = Buffer(name, offset, int(nbytes), dtype, tuple(int(x) for x in shape), kind, values)
            offset += aligned(nbytes)
        self.arena_bytes = offset
        self.rope = {v: f"rope.{j}" for j, v in enumerate(rope_variants(self.spec))}

    # ------------------------------------------------------------------ pieces of a forward pass

    def lin(self, name: str) -> _Lin:
        n, k = self.spec.tensor_shapes()[name]
        return _Lin(name, self.formats[name], n, k)

    def gated_wgmma(self, lin: _Lin) -> bool:
        """gate_up on the wgmma GEMM from an expanded NVFP4 copy: the GEMM's epilogue applies act(gate) * up."""
        return self.wg_layers and lin.fmt == "nvfp4"

    def linear_wgmma(self, e: _Emitter, a: str, lin: _Lin, out: str, rows, mode: int) -> None:
        """Prefill on Hopper: out[rows, N] (= | +=) a[rows, K] @ W^T with the TMA + wgmma GEMM over 16-bit
        operands; NVFP4 weights from their fp16 copy, or expanded into `wdq` first (prefill_weights_mode).
        Modes 2/3 (gate_up): out[rows, N/2] = act(gate) * up as XF_F16 / XF_BF16 activations."""
        m = ev(rows, self.rows_max, self.MB)
        out_bytes = m * lin.n * 4 if mode < 2 else m * lin.n // 2 * 2
        if lin.fmt == "nvfp4":
            wbuf = lin.name + ".f16"
            if self.wg_mode == "dequant":
                wbuf = "wdq"
                self.dequant(e, lin, wbuf)
            dtype, tscale, unscale = "f16", ptr(lin.name + ".tscale"), F16_NVFP4_UNSCALE
            reads = [(wbuf, lin.n * lin.k * 2), (lin.name + ".tscale", 4)]
        else:
            wbuf, dtype, tscale, unscale = lin.name, "bf16", ptr(None), 1.0
            reads = lin.reads()
        # the wider tile where it still gives every SM a block at the chunk's full size; phases of one or two
        # row tiles (short chunks, decode batches past the GEMV, mixed steps) take the width whose waves of blocks
        # carry the fewest columns a block (ties to the wider: gate_up at 128 rows runs 384 64-column tiles in 3
        # waves rather than 192 128-column ones in 2), and split K so the grid (at most one block per SM: the
        # splits wait on each other) fills the GPU
        rtiles = -(-self.rows_max // WG_TILE_M)
        bn = 256 if -(-lin.n // 256) * rtiles >= self.sm_count else 128
        if self.rows_max <= WG_MID_CHUNK:     # the width with the least work a block wave (waves x width)
            bn = min((256, 128, 64), key=lambda w: -(-(-(-lin.n // w) * rtiles) // self.sm_count) * w)
        tiles, splits, split_args = -(-lin.n // bn), 1, [ptr(None), ptr(None)]
        if self.rows_max <= WG_MID_CHUNK:
            splits = max(1, min(-(-lin.k // WG_TILE_K) // 4, self.sm_count // (tiles * rtiles)))
        part = tiles * rtiles * bn * 512        # the split-K partial sums: 128 x bn floats a tile
        if splits > 1:
            split_args = [ptr("wg_ws"), ptr("wg_flags")]
            reads += [("wg_ws", part), ("wg_flags", tiles * rtiles * 4)]
        kern = f"gemm_wg{bn}_{dtype}"
        self.kernel_smem[kern] = wg_smem_bytes(bn)
        rows_a = self.buffers[a].bytes // (lin.k * 2)
        e.add(kern, (tiles, rows_div(rows, WG_TILE_M), splits),
              (384,), [tmap(a, dtype, rows_a, lin.k, WG_TILE_M), tmap(wbuf, dtype, lin.n, lin.k, bn), ptr(out), tscale,
                       {"f32": unscale}, i32(rows), i32(lin.n), i32(lin.k), i32(mode), *split_args],
              reads + [(a, m * lin.k * 2)] + ([(out, out_bytes)] if mode == 1 else []),
              [(out, out_bytes)] + ([("wg_ws", part), ("wg_flags", tiles * rtiles * 4)] if splits > 1 else []),
              smem=wg_smem_bytes(bn))

    def wq_ok(self, lin: _Lin) -> bool:
        """This decode step's layer linear on gemm_wq (NVFP4 read as stored): a Hopper decode batch past the
        GEMV's rows, up to the largest NB, K a multiple of WQ_K (the scales' TMA rows then 16-byte aligned)."""
        if not (self.wq and lin.fmt == "nvfp4" and lin.k % WQ_K == 0 and lin.name.startswith("layers.")):
            return False
        if lin.name.endswith(".down"):      # its input (XF_F16W) comes from gate_up's epilogue on the same GEMM
            return self.wq_ok(self.lin(lin.name[:-len("down")] + "gate_up"))
        return True

    def linear_wq(self, e: _Emitter, a: str, lin: _Lin, out: str, rows, mode: int) -> None:
        """out[rows, N] (= | +=) a[rows, K] @ W^T, a in XF_F16W, W's NVFP4 codes and scales expanded in registers by
        the GEMM itself (templates/gemm_wgmma_nvfp4.cu.j2); modes 2/3/4: gate_up, act(gate) * up as XF_F16 / XF_BF16
        / XF_F16W."""
        m = ev(rows, self.rows_max, self.MB)
        nb = next(x for x in WQ_NB if x >= self.rows_max)
        gated = mode >= 2
        tiles = -(-(lin.n // 2) // (WQ_ROWS // 2)) if gated else -(-lin.n // WQ_ROWS)
        ytiles = -(-self.rows_max // nb)
        # split K over blocks where the tiles leave SMs idle: every split at least 4 stages (both consumers busy)
        splits = max(1, min(lin.k // WQ_K // 4, self.sm_count // (tiles * ytiles)))
        part = tiles * ytiles * nb * WQ_ROWS * 4
        box = WQ_ROWS // 2 if gated else WQ_ROWS
        out_bytes = m * lin.n * 4 if not gated else m * lin.n // 2 * 2
        reads = lin.reads() + [(a, m * lin.k * 2)] + ([(out, out_bytes)] if mode == 1 else [])
        writes = [(out, out_bytes)]
        split_args = [ptr(None), ptr(None)]
        if splits > 1:
            split_args = [ptr("wg_ws"), ptr("wg_flags")]
            reads += [("wg_ws", part), ("wg_flags", tiles * ytiles * 4)]
            writes += [("wg_ws", part), ("wg_flags", tiles * ytiles * 4)]
        kern = f"gemm_wq{nb}"
        self.kernel_smem[kern] = wq_smem_bytes(nb)
        rows_a = self.buffers[a].bytes // (lin.k * 2)
        e.add(kern, (tiles, rows_div(rows, nb), splits), (384,),
              [tmap(a, "f16", rows_a, lin.k, nb), tmap(lin.name + ".codes", "u8", lin.n, lin.k // 2, box, WQ_K // 2),
               tmap(lin.name + ".scales", "u8", lin.n, lin.k // BLOCK, box, WQ_K // BLOCK), ptr(out),
               ptr(lin.name + ".tscale"), {"f32": F16_NVFP4_UNSCALE}, i32(rows), i32(lin.n), i32(lin.k), i32(mode),
               *split_args], reads, writes, smem=wq_smem_bytes(nb))

    def dequant(self, e: _Emitter, lin: _Lin, out: str) -> None:
        """NVFP4 codes and scales of lin -> fp16 q * s * 2^-14 in out (templates/gemm_wgmma.cu.j2); gate_up's
        rows interleaved in groups of 8 for the gated epilogue."""
        blocks = lin.n * lin.k // BLOCK
        interleave = lin.n // 2 if lin.name.endswith(".gate_up") else 0
        e.add("dequant_nvfp4_f16", (min(-(-blocks // 256), 8 * self.sm_count),), (256,),
              [ptr(lin.name + ".codes"), ptr(lin.name + ".scales"), ptr(out), {"u64": blocks}, i32(lin.k // BLOCK),
               i32(interleave)],
              [(lin.name + ".codes", lin.n * lin.k // 2), (lin.name + ".scales", blocks)], [(out, lin.n * lin.k * 2)])

    def linear(self, e: _Emitter, a: str, lin: _Lin, out: str, rows, mode: int, planes: bool, split_k: bool,
               nb: int = 0) -> None:
        """out[rows, N] (= | +=) a[rows, K] @ W^T: the decode GEMV over x planes (planes, rows <= nb), or the
        GEMM over gfmt(W) activations (split over K with atomics when split_k)."""
        if self.wq_ok(lin):
            return self.linear_wq(e, a, lin, out, rows, mode)
        if self.wg_layers and lin.name.startswith("layers."):
            return self.linear_wgmma(e, a, lin, out, rows, mode)
        m = ev(rows, self.rows_max, self.MB)
        reads = lin.reads() + [(a, 2 * m * lin.k * 2 if planes else m * lin.k * 2)] + ([(out, m * lin.n * 4)] if mode else [])
        writes = [(out, m * lin.n * 4)]
        if planes:
            kern = f"gemv_{lin.fmt}_nb{nb}"
            e.add(kern, ((lin.n + 15) // 16,), (256,),
                  [ptr(a), *lin.weight_args(), ptr(out), i32(lin.n), i32(lin.k), i32(rows), i32(mode)], reads, writes)
            return
        gx = (lin.n + GEMM_TILE_N - 1) // GEMM_TILE_N
        gy = rows_div(rows, GEMM_TILE_M)
        splits = 1
        if split_k:     # enough blocks for two waves; a symbolic chunk is split for its full size
            ktiles = (lin.k + GEMM_TILE_K - 1) // GEMM_TILE_K
            splits = max(1, min(ktiles // 2, (2 * self.sm_count) // (gx * ev(gy, self.rows_max))))
        if splits > 1:
            if mode == 0:      # the atomic split-K adds into out: zero it first
                e.add("fill_f32", (min(1024, (m * lin.n + 255) // 256),), (256,),
                      [ptr(out), {"u64": m * lin.n}, {"f32": 0.0}], [], [(out, m * lin.n * 4)])
            mode = 2
        kern = "gemm_nvfp4_f16" if lin.fmt == "nvfp4" else "gemm_bf16"
        e.add(kern, (gx, gy, splits), (256,), [ptr(a), *lin.weight_args(), ptr(out), i32(rows), i32(lin.n),
                                               i32(lin.k), i32(mode)], reads, writes)

    def rmsnorm(self, e: _Emitter, x: str, w: str, out: str, rows, ofmt: int, x_off=0) -> None:
        h, m = self.spec.hidden, ev(rows, self.rows_max, self.MB)
        width = 4 if ofmt not in (XF_BF16, XF_F16) else 2
        e.add("rmsnorm_residual", (rows,), (256,), [ptr(x, x_off), ptr(None), ptr(w), ptr(out), i32(ofmt)],
              [(x, m * h * 4), (w, h * 4)], [(out, m * h * width)])

    def rmsnorm_add(self, e: _Emitter, t: str, w: str, rows) -> None:
        h, m = self.spec.hidden, ev(rows, self.rows_max, self.MB)
        e.add("rmsnorm_add", (rows,), (256,), [ptr(t), ptr(w), ptr("x")],
              [("t", m * h * 4), (w, h * 4), ("x", m * h * 4)], [("x", m * h * 4)])

    def embed(self, e: _Emitter, rows) -> None:
        s, m = self.spec, ev(rows, self.rows_max, self.MB)
        emb = self.lin("embed")
        row_bytes = s.hidden // 2 + s.hidden // BLOCK if emb.fmt == "nvfp4" else s.hidden * 2
        reads = [("tokens", m * 4)] + [(b, min(n, m * row_bytes)) for b, n in emb.reads()]
        kern = "embedding_gather_nvfp4" if emb.fmt == "nvfp4" else "embedding_gather"
        e.add(kern, (rows,), (256,), [ptr("tokens"), *emb.weight_args(), ptr("x")], reads, [("x", m * s.hidden * 4)])

    def norm_fused(self, lin: _Lin, dec: bool, nb: int) -> bool:
        """Batch-1 decode of an NVFP4 projection of the normed residual: the GEMV computes the RMSNorm in its
        prologue (templates/gemv.cu.j2 *_norm_nb1, emitted for hidden sizes whose planes fit 32 KB), where its
        blocks fit one wave (two an SM): each block pays the prologue, so over several waves it costs more
        than the launch it saves (measured: SmolLM2 batch 1 +9%; the 8B shape, 1.5 and 3 waves, -5%)."""
        h = self.spec.hidden
        cols = lin.n // 2 if lin.name.endswith(".gate_up") else lin.n
        return (dec and nb == 1 and lin.fmt == "nvfp4" and lin.k == h and 4 * h <= 32768
                and -(-cols // 16) <= 2 * self.sm_count)

    def gemv_norm(self, e: _Emitter, norm: str, lin: _Lin, out: str, mode: int, gated: bool) -> None:
        h = self.spec.hidden
        cols = lin.n // 2 if gated else lin.n
        e.add(f"gemv_{'gated_' if gated else ''}nvfp4_norm_nb1", ((cols + 15) // 16,), (256,),
              [ptr("x"), ptr(norm), *lin.weight_args(), ptr(out), i32(lin.n), i32(lin.k), i32(1), i32(mode)],
              lin.reads() + [("x", h * 4), (norm, h * 4)],
              [(out, 2 * cols * 2 if gated else cols * 4)])

    def layers(self, e: _Emitter, rows, attention, dec: bool, nb: int, split_k: bool) -> None:
        """Every layer over `rows` rows of x; attention(e, i, ofmt) fills attn from q."""
        s, m = self.spec, ev(rows, self.rows_max, self.MB)
        def fmt(lin: _Lin) -> int:        # the activation format lin's kernel reads
            return XF_F16W if self.wq_ok(lin) else xfmt(lin.fmt) if dec else gfmt(lin.fmt)
        for i in range(s.n_layers):
            p = f"layers.{i}."
            qkv, o, gate_up, down = (self.lin(p + n) for n in ("qkv", "o", "gate_up", "down"))
            if self.norm_fused(qkv, dec, nb):
                self.gemv_norm(e, p + "attn_norm", qkv, "qkv", 0, gated=False)
            else:
                self.rmsnorm(e, "x", p + "attn_norm", "hb", rows, fmt(qkv))
                self.linear(e, "hb", qkv, "qkv", rows, 0, dec, split_k, nb)
            opt = lambda name: ptr(p + name) if p + name in self.formats else ptr(None)  # noqa: E731
            rope = self.rope[s.rope_for(i)]
            e.add("qkv_rope_cache_f16", (rows,), (128,),
                  [ptr("qkv"), opt("qkv_bias"), opt("q_norm"), opt("k_norm"), ptr(rope), ptr("positions"),
                   ptr("kv_slots"), ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v")],
                  [("qkv", m * qkv.n * 4), ("positions", m * 4), ("kv_slots", m * 4)],
                  [("q", m * s.q_dim * 2), (f"kv.{i}.k", m * s.kv_dim * 2), (f"kv.{i}.v", m * s.kv_dim * 2)])
            window = s.sliding_window if s.kind(i) == "sliding" else 0
            attention(e, i, window, fmt(o))
            if s.sandwich_norm:
                self.linear(e, "attn", o, "t", rows, 0, dec, split_k, nb)
                self.rmsnorm_add(e, "t", p + "post_attn_norm", rows)
            else:
                self.linear(e, "attn", o, "x", rows, 1, dec, split_k, nb)
            if self.norm_fused(gate_up, dec, nb):
                self.gemv_norm(e, p + "ffn_norm", gate_up, "ab", xfmt(down.fmt), gated=True)
            elif dec:
                self.rmsnorm(e, "x", p + "ffn_norm", "hb", rows, fmt(gate_up))
                ofmt = xfmt(down.fmt)
                e.add(f"gemv_gated_{gate_up.fmt}_nb{nb}", ((gate_up.n // 2 + 15) // 16,), (256,),
                      [ptr("hb"), *gate_up.weight_args(), ptr("ab"), i32(gate_up.n), i32(gate_up.k), i32(rows),
                       i32(ofmt)],
                      gate_up.reads() + [("hb", 2 * m * gate_up.k * 2)], [("ab", 2 * m * s.intermediate * 2)])
            elif self.wq_ok(gate_up):
                self.rmsnorm(e, "x", p + "ffn_norm", "hb", rows, fmt(gate_up))
                self.linear_wq(e, "hb", gate_up, "ab", rows, {XF_F16: 2, XF_BF16: 3, XF_F16W: 4}[fmt(down)])
            elif self.gated_wgmma(gate_up):
                self.rmsnorm(e, "x", p + "ffn_norm", "hb", rows, fmt(gate_up))
                self.linear_wgmma(e, "hb", gate_up, "ab", rows, 2 if gfmt(down.fmt) == XF_F16 else 3)
            else:
                self.rmsnorm(e, "x", p + "ffn_norm", "hb", rows, fmt(gate_up))
                self.linear(e, "hb", gate_up, "gu", rows, 0, False, split_k)
                e.add("act_gated_x", ((s.intermediate + 255) // 256, rows), (256,),
                      [ptr("gu"), ptr("ab"), i32(gfmt(down.fmt))],
                      [("gu", m * 2 * s.intermediate * 4)], [("ab", m * s.intermediate * 2)])
            if s.sandwich_norm:
                self.linear(e, "ab", down, "t", rows, 0, dec, split_k, nb)
                self.rmsnorm_add(e, "t", p + "post_ffn_norm", rows)
            else:
                self.linear(e, "ab", down, "x", rows, 1, dec, split_k, nb)

    def head(self, e: _Emitter, rows, dec: bool, nb: int, split_k: bool, x_off=0) -> None:
        s, m = self.spec, ev(rows, self.rows_max, self.MB)
        head = self.lin("embed" if s.tie_embeddings else "lm_head")
        self.rmsnorm(e, "x", "final_norm", "hb", rows, xfmt(head.fmt) if dec else gfmt(head.fmt), x_off)
        self.linear(e, "hb", head, "logits", rows, 0, dec, split_k, nb)
        if s.final_softcap:
            e.add("logits_softcap", ((s.vocab_size + 255) // 256, rows), (256,), [ptr("logits")],
                  [("logits", m * s.vocab_size * 4)], [("logits", m * s.vocab_size * 4)])

    # ------------------------------------------------------------------ phases

    def attn_splits(self, b: int) -> int:
        return max(1, min(ATTN_GRID_SPLITS, -(-2 * self.sm_count // (b * self.spec.n_kv_heads))))

    def attn_decode(self, e: _Emitter, i: int, window: int, ofmt: int, rows, splits: int, planes: bool) -> None:
        """Decode attention of `rows` rows (one new token each: sequence seq_slot[r], seq_len[r] keys) from q rows
        0.. into attn rows 0..; one launch: the last block of each (sequence, kv head) merges its splits
        (templates/attn_decode.cu.j2)."""
        s, b = self.spec, ev(rows, self.rows_max, self.MB)
        part = b * s.n_heads * splits * (s.head_dim + 2) * 4       # partials of a context of `splits` splits
        counts = b * s.n_kv_heads * 4
        e.add("attn_decode_f16", (rows, s.n_kv_heads, splits), (128,),
              [ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v"), ptr("block_tables"), ptr("seq_slot"), ptr("seq_len"),
               ptr("partial"), ptr("attn_counts"), ptr("attn"), i32(window), i32(self.max_pages), i32(ofmt)],
              [("q", b * s.q_dim * 2), ("seq_slot", b * 4), ("seq_len", b * 4), ("partial", part),
               ("attn_counts", counts)],
              [("partial", part), ("attn_counts", counts), ("attn", b * s.q_dim * (4 if planes else 2))])

    def sample(self, e: _Emitter, rows) -> None:
        b, v = ev(rows, self.rows_max, self.MB), self.spec.vocab_size
        pen = [ptr("seq_slot"), ptr("repetition_penalty"), ptr("presence_penalty"), ptr("frequency_penalty")]
        if self.opt.gpu_penalties:      # the rows' penalties on their logits, from their sequences' token counts
            e.add("apply_penalties", (rows,), (1024,), [ptr("logits"), *pen, ptr("pen_counts"), ptr("pen_seen")],
                  [("logits", b * v * 4), ("pen_counts", b * v * 4), ("pen_seen", b * v // 8)], [("logits", b * v * 4)])
        e.add("sample_tokens", (rows,), (1024,),
              [ptr("logits"), ptr("temperature"), ptr("top_k"), ptr("top_p"), ptr("min_p"), ptr("seed"), ptr("step"),
               ptr("sampled")],
              [("logits", b * v * 4)], [("sampled", b * 4)])
        if self.opt.gpu_penalties:      # ... and each drawn token counted for the next step
            e.add("count_sampled", (1,), (256,), [ptr("sampled"), *pen, ptr("pen_counts"), i32(rows)],
                  [("sampled", b * 4)], [("pen_counts", b * 4)])

    def decode(self, b: int) -> Phase:
        dec = b <= self.gemv_rows
        # Batches past the GEMV's rows on Hopper, where the fp16 copies exist: the layer linears on the wgmma
        # GEMM, which streams the copies (3.6x the NVFP4 bytes) near the copy bandwidth; the mma.sync GEMM
        # expanding NVFP4 in registers is bound by that expansion instead (8B at 64 rows: 9.3 ms a step).
        self.rows_max, self.wg_layers = b, not dec and self.wg_mode == "copy"
        # ... and on gemm_wq, reading the NVFP4 weights as stored (a quarter of the copies' bytes), up to 64 rows
        self.wq = not dec and self.wg_mode != "none" and self.opt.decode_gemm == "nvfp4" and b <= WQ_NB[-1]
        e = _Emitter(pdl=self.opt.pdl and self.target["compute_capability"][0] >= 9)
        nb = next((x for x in GEMV_NB if x >= b), 0)
        splits = self.attn_splits(b)
        self.embed(e, b)

        def attention(e: _Emitter, i: int, window: int, ofmt: int) -> None:
            self.attn_decode(e, i, window, ofmt, b, splits, planes=dec)
            # the o projection after it without programmatic dependent launch: with it, its GEMV blocks (two an SM,
            # up to half the register file each) sit waiting beside the attention's last, merging blocks, and
            # batches 8-16 ran 7-10% slower; without it batches 1-16 gain 1.6-3.5% on the session before
            # (BENCHMARKS, "Decode attention in one launch").
            e.no_pdl_next = True

        self.layers(e, b, attention, dec, nb, split_k=True)
        self.head(e, b, dec, nb, split_k=True)
        self.sample(e, b)
        return Phase("decode", b, tuple(e.launches))

    def prefill_buckets(self) -> list[int]:
        """Row counts of the prefill phases: the chunk, and on Hopper split-K phases for one and two row tiles."""
        if self.wg_mode == "none":
            return [self.chunk]
        return sorted({min(WG_SMALL_CHUNK, self.chunk), min(WG_MID_CHUNK, self.chunk), self.chunk})

    def prefill(self, chunk: int) -> Phase:
        """Prefill chunks, with the decode rows of other sequences riding in the same launches (a mixed step: the
        layer GEMMs read each weight once for both). Rows [0, dec) decode one token each: decode's attention, then
        the head and sampling over them at the end; rows [dec, rows) are the chunks: in the largest phase those of
        up to MAX_SEGMENTS sequences (the tile table says which rows), in the others one sequence's `prows` tokens
        at positions start.. of block-table row `slot`. A plain prefill has dec = 0: launches whose grid is then
        empty are skipped (runtime/cuda_program.py)."""
        s = self.spec
        self.rows_max, self.wg_layers, self.wq = chunk, self.wg_mode != "none", False
        e = _Emitter(pdl=False)
        self.embed(e, ROWS)
        bt_row = {"sym": "slot", "mul": self.max_pages * 4}
        prows, after_dec = {"sym": "prows"}, {"sym": "dec", "mul": s.q_dim * 2}
        dec_splits = self.attn_splits(8)

        # The largest phase takes the chunks of several sequences in one call (a batch of new prompts): its attention
        # walks a table of query tiles, each naming its chunk (the step value fa_tiles, `qtiles` entries). A smaller
        # phase of one row tile splits the keys over blocks (a chunk of few rows after a long cached prefix would
        # otherwise have N_HEADS blocks each walking every key); splits: ceil(start / FA_KV_SPLIT) + 1, merged when
        # there are two or more (start > 0: the merge's grid is empty at start 0).
        many = chunk == max(self.prefill_buckets())
        split = not many and chunk <= WG_SMALL_CHUNK and "fa_partial" in self.buffers
        z = {"sym": "start", "ceil_div": FA_KV_SPLIT, "add": 1} if split else 1
        part = self.buffers["fa_partial"].bytes if split else 0

        def attention(e: _Emitter, i: int, window: int, ofmt: int) -> None:
            self.attn_decode(e, i, window, ofmt, {"sym": "dec"}, dec_splits, planes=False)
            if many:
                grid, args = (s.n_heads, {"sym": "qtiles"}, 1), [
                    ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v"), ptr("block_tables"), i32(0), i32(prows), i32(window),
                    ptr("attn"), i32(ofmt), ptr(None), i32(FA_KV_SPLIT), ptr("fa_tiles")]
            else:
                grid, args = (s.n_heads, rows_div(prows, self.fa_qt), z), [
                    ptr("q", after_dec), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v"), ptr("block_tables", bt_row),
                    i32({"sym": "start"}), i32(prows), i32(window), ptr("attn", after_dec), i32(ofmt),
                    ptr("fa_partial" if split else None), i32(FA_KV_SPLIT), ptr(None)]
            e.add("attn_prefill_f16", grid, (self.fa_threads,), args,
                  [("q", chunk * s.q_dim * 2)] + ([("fa_tiles", self.buffers["fa_tiles"].bytes)] if many else []),
                  [("attn", chunk * s.q_dim * 2)] + ([("fa_partial", part)] if split else []), smem=self.fa_smem)
            if split:
                e.add("attn_prefill_merge", (prows, s.n_heads, {"sym": "start", "ceil_div": 1 << 30}), (s.head_dim,),
                      [ptr("fa_partial"), i32(prows), i32(z), ptr("attn", after_dec), i32(ofmt)],
                      [("fa_partial", part)], [("attn", chunk * s.q_dim * 2)])

        self.layers(e, ROWS, attention, dec=False, nb=0, split_k=self.opt.prefill_split_k)
        self.wg_layers = False
        self.head(e, {"sym": "dec"}, dec=False, nb=0, split_k=False)
        self.sample(e, {"sym": "dec"})
        return Phase("prefill", chunk, tuple(e.launches))

    def logits(self, rows: int) -> Phase:
        """Logits of `rows` consecutive rows of x from row `row0` (after a prefill chunk)."""
        self.rows_max, self.wq = rows, False
        e = _Emitter(pdl=False)
        dec = rows <= self.gemv_rows
        nb = next((x for x in GEMV_NB if x >= rows), 0)
        self.head(e, ROWS, dec, nb, split_k=self.opt.prefill_split_k,
                  x_off={"sym": "row0", "mul": self.spec.hidden * 4})
        return Phase("logits", rows, tuple(e.launches))

    def init(self) -> Phase:
        """Synthetic bundles: every weight generated on the GPU from the seed (templates/synthetic.cu.j2)."""
        e = _Emitter(pdl=False)
        if self.seed is not None:
            self.synthetic_weights(e)
        # decode attention's per-(sequence, kv head) block counters start at 0 (each launch leaves them at 0)
        n = self.buffers["attn_counts"].shape[0] * self.buffers["attn_counts"].shape[1]
        e.add("fill_f32", (1,), (256,), [ptr("attn_counts"), {"u64": n}, {"f32": 0.0}], [], [("attn_counts", n * 4)])
        if "wg_flags" in self.buffers:   # split-K turn flags start at 0
            n = self.buffers["wg_flags"].shape[0]
            e.add("fill_f32", (1,), (256,), [ptr("wg_flags"), {"u64": n}, {"f32": 0.0}], [], [("wg_flags", n * 4)])
        if self.wg_mode == "copy":      # the fp16 copies prefill's wgmma GEMM reads, expanded once at load
            for name, n, k in wgmma_weights(self.spec, self.formats):
                self.dequant(e, _Lin(name, "nvfp4", n, k), name + ".f16")
        return Phase("init", 0, tuple(e.launches))

    def synthetic_weights(self, e: _Emitter) -> None:
        grid, block = (1024,), (256,)
        for idx, name in enumerate(sorted(self.spec.tensor_shapes())):
            shape, fmt = self.spec.tensor_shapes()[name], self.formats[name]
            tseed = self.seed * 1000003 + idx
            if fmt == "nvfp4":
                n, k = shape
                e.add("fill_random_bytes", grid, block, [ptr(name + ".codes"), {"u64": n * k // 2}, {"u64": tseed},
                                                         {"u32": 0xFF}, {"u32": 0}], [], [(name + ".codes", n * k // 2)])
                # E4M3 codes 0x30..0x37: block scales 0.5 .. 0.94
                e.add("fill_random_bytes", grid, block, [ptr(name + ".scales"), {"u64": n * k // BLOCK},
                                                         {"u64": tseed + 1}, {"u32": 0x07}, {"u32": 0x30}],
                      [], [(name + ".scales", n * k // BLOCK)])
                # rms of a uniform random E2M1 code is 2.93, of the scales ~0.72: keep outputs ~unit variance
                e.add("fill_f32", (1,), (32,), [ptr(name + ".tscale"), {"u64": 1},
                                                {"f32": 1.0 / (2.93 * 0.72 * math.sqrt(k))}], [], [(name + ".tscale", 4)])
            elif fmt == "bf16":
                amp = 1.0 if name == "embed" else math.sqrt(3.0 / shape[-1])
                e.add("fill_random_bf16", grid, block, [ptr(name), {"u64": math.prod(shape)}, {"u64": tseed},
                                                        {"f32": amp}], [], [(name, math.prod(shape) * 2)])
            else:
                val = 0.0 if name.endswith("qkv_bias") else 1.0
                e.add("fill_f32", grid, block, [ptr(name), {"u64": math.prod(shape)}, {"f32": val}], [],
                      [(name, math.prod(shape) * 4)])

    def build(self) -> Program:
        self.wg_layers = self.wq = False
        self.layout()
        phases = [self.init()]
        phases += [self.decode(b) for b in self.plan["graph_buckets"]]
        phases += [self.prefill(c) for c in self.prefill_buckets()]
        phases += [self.logits(r) for r in LOGITS_BUCKETS]
        consts = {"page_size": self.page, "max_pages": self.max_pages, "max_seqs": self.max_seqs,
                  "kv_pages": self.kv_pages, "max_context": self.max_context, "max_batch": self.max_batch,
                  "prefill_chunk": self.chunk, "vocab_size": self.spec.vocab_size, "hidden": self.spec.hidden,
                  "rows": self.R, "logit_rows": self.MB, "max_segments": MAX_SEGMENTS, "fa_query_tile": self.fa_qt,
                  "fa_tile_ints": FA_TILE_INTS}
        symbols = {"rows": self.R, "start": self.max_context - 1, "slot": self.max_seqs - 1, "row0": self.R - 1,
                   "dec": self.max_batch, "prows": self.R, "qtiles": max_tiles(self.R)}
        return Program(target=self.target["name"], arena_bytes=self.arena_bytes, buffers=self.buffers, phases=phases,
                       symbols=symbols, kernel_smem=self.kernel_smem, constants=consts,
                       options={**self.opt.to_dict(), "gemv_max_rows": self.gemv_rows})


def build_program(spec: ModelSpec, formats: dict[str, str], target: dict, plan: dict, options: ProgramOptions,
                  kernels: set[str] | None, synthetic_seed: int | None = None) -> Program:
    """The validated launch program of one target; a CompileError if it fails validation."""
    from imp_runtime.program import ProgramError
    prog = ProgramBuilder(spec, formats, target, plan, options, synthetic_seed).build()
    try:
        validate(prog, kernels, target.get("smem_per_block_bytes"))
    except ProgramError as e:
        raise CompileError(f"the launch program failed validation: {e}") from None
    return prog
