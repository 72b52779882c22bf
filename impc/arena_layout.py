"""Stage 4b, part 1: the device arena of a launch program (impc/launches.py builds the program over it).

Every buffer one allocation holds, in order: the weights as the bundle stores them (on Hopper also their fp16
copies), constants, block tables (and the GPU penalties' per-sequence state), the values the host sends each step,
scratch, and the KV pool last; the plan (impc/plan.py) sizes the KV pool from what the rest leaves.
"""
from __future__ import annotations

import math

from impc.errors import CompileError
from imp_runtime.nvfp4 import BLOCK
from imp_runtime.program import ALIGN
from imp_runtime.rope import inv_freq
from imp_runtime.spec import ModelSpec

ATTN_MAX_SPLITS = 64          # and at most this many splits of a sequence's keys (templates/attn_decode.cu.j2)


def attn_partial_row(head_dim: int) -> int:
    """Floats of one decode-attention split's partial result: m, l, two unused, then acc 16-byte aligned (the
    merge reads it as float4; templates/attn_decode.cu.j2 AD_PROW)."""
    return head_dim + 4
WG_SMALL_CHUNK = 128     # Hopper: the prefill phase of one row tile (its attention splits the keys: fa_partial)
FA_KV_SPLIT = 512        # that phase's attention: keys a block (templates/attn_prefill.cu.j2, split keys)
MAX_SEGMENTS = 16        # sequences' chunks one call of the largest prefill phase takes (a tile table each step)
FA_TILE_INTS = 8         # ints of a tile-table entry (templates/attn_prefill.cu.j2)


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
        "partial": ("f32", (MB, s.n_heads, ATTN_MAX_SPLITS, attn_partial_row(s.head_dim)),
                    MB * s.n_heads * ATTN_MAX_SPLITS * attn_partial_row(s.head_dim) * 4),
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
    out = {"tokens": ("i32", R), "token_src": ("i32", R), "positions": ("i32", R), "kv_slots": ("i32", R), "seq_slot": ("i32", MB),
           "seq_len": ("i32", MB), "top_k": ("i32", MB), "step": ("i32", MB), "temperature": ("f32", MB),
           "top_p": ("f32", MB), "min_p": ("f32", MB), "seed": ("u64", MB),
           "fa_tiles": ("i32", FA_TILE_INTS * max_tiles(R)),
           # a mixed step's prompt-ending chunks: the x row of each one's last token (gathered after the decode rows
           # for the head and the sampler)
           "chunk_last": ("i32", MAX_SEGMENTS)}
    if penalties:
        out.update({"repetition_penalty": ("f32", MB), "presence_penalty": ("f32", MB),
                    "frequency_penalty": ("f32", MB)})
    return out


# Decode steps without copies on the step's stream (runtime/executor_cuda.py stage_step): the host packs a step's
# values, the used rows of each step array one after another (STEP_PACK_SKIP left out: prefill's), behind a 16-byte
# generation header, and sends them by a small copy into one of two device staging slots; the step's first kernel
# (templates/embedding.cu.j2 step_token) spreads them over the step arrays, and the sampler writes the drawn ids into
# mapped host memory. host_io (u64 words, HIO_* in templates/prelude.cuh.j2): 0, 1 the two staging slots' device
# addresses, 2, 3 the two id slots', 4 the id slot of the step that runs, 5 the generation the device ran last, 6 the
# one the running step took; step_pack (i32): the number of arrays, then each one's (word offset in the step region,
# words a row).
HOST_IO_WORDS = 8
STEP_PACK_SKIP = ("fa_tiles", "chunk_last")


def step_pack(rows: int, logit_rows: int, penalties: bool = False) -> tuple[int, ...]:
    """The step_pack table of the step arrays step_sizes lays out (in the arena's order, each aligned)."""
    out, at = [], 0
    for name, (dtype, count) in step_sizes(rows, logit_rows, penalties).items():
        words = 2 if dtype == "u64" else 1
        if name not in STEP_PACK_SKIP:
            out += [at // 4, words]
        at += aligned(count * words * 4)
    return (len(out) // 2, *out)


def penalty_tables(spec: ModelSpec, max_seqs: int) -> dict[str, tuple[str, tuple[int, int], int]]:
    """The GPU penalties' per-sequence state (rows by sequence slot; the host writes a row when a sequence with
    penalties starts, the sampler adds each token it draws): name -> (dtype, shape, bytes)."""
    v, words = spec.vocab_size, -(-spec.vocab_size // 32)
    return {"pen_counts": ("i32", (max_seqs, v), max_seqs * v * 4),           # tokens generated so far
            "pen_seen": ("i32", (max_seqs, words), max_seqs * words * 4)}      # prompt tokens, one bit each


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


def rope_counts(spec: ModelSpec) -> tuple[int, int]:
    """The rope_count buffer's int32 counts (templates/gemv_ring.cu.j2 rope_tail): each qkv head's tiles counted in as
    they are stored, then (--attn-head-ready) each kv head's q, key and value heads, the decode attention's wait
    (templates/attn_decode.cu.j2 attn_decode_ready_*): (where the kv heads' counts start, all of them)."""
    heads = spec.n_heads + 2 * spec.n_kv_heads
    return heads, heads + spec.n_kv_heads


def aligned(n: int) -> int:
    return (int(n) + ALIGN - 1) // ALIGN * ALIGN


def arena_entries(spec: ModelSpec, formats: dict[str, str], rows: int, logit_rows: int, max_seqs: int,
                  max_pages: int, page: int, kv_pages: int, wg_mode: str = "none", penalties: bool = False,
                  pair_bar: bool = False) -> list[tuple]:
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
        elif fmt == "int8":            # runtime/int8.py: uploaded as stored, the kernels read the codes as int8
            n, k = shape
            out += [(name + ".codes", "weight", "u8", (n, k), n * k, None),
                    (name + ".rscale", "weight", "f32", (n,), 4 * n, None)]
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
    pack = step_pack(rows, logit_rows, penalties)
    out.append(("step_pack", "const", "i32", (len(pack),), 4 * len(pack), pack))
    out.append(("host_io", "table", "u64", (HOST_IO_WORDS,), 8 * HOST_IO_WORDS, None))
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
    # the norm in the tail of gemm_wq adding into x (templates/gemm_wgmma_nvfp4.cu.j2 wq_norm_tail): its blocks done,
    # and its norming blocks that saw them done
    out.append(("norm_count", "scratch", "i32", (2,), 8, None))
    # the norm as partial sums between two decode ring GEMVs (templates/gemv_ring.cu.j2 gemv_ring_body): each 16-row tile's
    # sum of squares of the new x, a row of them for each of up to 8 batch rows (GR_NB)
    n = 8 * (spec.hidden // 16)
    out.append(("norm_part", "scratch", "f32", (n,), n * 4, None))
    n = rope_counts(spec)[1]
    out.append(("rope_count", "scratch", "i32", (n,), n * 4, None))
    if pair_bar:    # --gemv-pair: the grid barrier of the launches doing two GEMVs (templates/gemv_ring_pair.cu.j2)
        out.append(("pair_bar", "scratch", "i32", (1,), 4, None))
    page_bytes = spec.n_kv_heads * page * spec.head_dim * 2
    for i in range(spec.n_layers):
        for kv in ("k", "v"):
            out.append((f"kv.{i}.{kv}", "kv", "f16", (kv_pages, spec.n_kv_heads, page, spec.head_dim),
                        kv_pages * page_bytes, None))
    return out


def fixed_arena_bytes(spec: ModelSpec, formats: dict[str, str], rows: int, logit_rows: int, max_seqs: int,
                      max_pages: int, wg_mode: str = "none", penalties: bool = False, pair_bar: bool = False) -> int:
    """Bytes of the arena before the KV pool (the plan gives what is left to KV pages)."""
    return sum(aligned(e[4]) for e in arena_entries(spec, formats, rows, logit_rows, max_seqs, max_pages, 16, 0,
                                                    wg_mode, penalties, pair_bar) if e[1] != "kv")


def rope_variants(spec: ModelSpec) -> list[tuple]:
    """The distinct (base, scaling) RoPE tables of the layers, in first-use order."""
    return list(dict.fromkeys(spec.rope_for(i) for i in range(spec.n_layers)))
