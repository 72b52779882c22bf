"""Stage 4b, part 2: the launches of one linear layer (impc/launches.py builds the program from them).

Which kernel computes out[rows, N] (= | +=) a[rows, K] @ W^T at a given phase and size, with its grid, arguments
and bytes: the decode GEMV over x planes (templates/gemv.cu.j2; with the RMSNorm fused at batch 1), the mma.sync
GEMM (templates/gemm.cu.j2), and on Hopper the TMA + wgmma GEMM over 16-bit operands (templates/gemm_wgmma.cu.j2:
prefill, from the fp16 copies) and the one that reads NVFP4 as stored (templates/gemm_wgmma_nvfp4.cu.j2: decode
batches past the GEMV). The templates' tile constants are rendered from the ones here (impc/emit.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from imp_runtime.nvfp4 import BLOCK
from imp_runtime.program import Launch, evaluate
from imp_runtime.spec import ModelSpec
from impc.arena_layout import rope_counts

# Kernels that begin with pdl_wait() (templates/prelude.cuh.j2), so the decode graphs may launch them with
# programmatic dependent launch: each starts while its predecessor drains, its weight loads issued early.
PDL_KERNELS = ("gemv_", "rmsnorm_residual", "rmsnorm_add", "qkv_rope_cache_f16", "attn_decode_f16", "attn_decode_rope_f16",
               "attn_decode_ready_f16",
               "logits_softcap", "sample_tokens", "gemm_wq")
# templates/gemv_ring.cu.j2 gemv_ring_* (rendered from these): the decode GEMV streamed through a per-warp cp.async ring,
# GR_STAGES deep, GR_UR chunk groups (4 x 32 k) a stage; its dynamic shared memory; the batches it is built for
GR_STAGES, GR_UR, GR_BLOCKS = 4, 2, 2          # ... and its blocks an SM (the grid)
GR_RESIDENT = 2                                # the blocks an SM its registers are sized for (launch bounds); 3 over a
                                               # grid of 2 an SM, so the next kernel's blocks could start beside and
                                               # prefetch, ran gate_up slower (BENCHMARKS.md, fourteenth session)
# 16-row tiles a block of the INT8 GEMV (templates/gemv.cu.j2 gemv_int8_body) by rows: the activation read once for
# all of them. 8B head (H200): 8 rows 256 -> 188 us (58 -> 79% of the copy) with two tiles, 178 us with three (128
# registers, no spills), 16 rows 442 -> 271 us with two; at 2 rows two tiles ran 150 -> 156 us, and four spill at
# 8 rows (220 us) (BENCHMARKS.md, twenty-first session)
GV_I8_TILES = {1: 1, 2: 1, 4: 1, 8: 3, 16: 2}
GV_WARPS = 8                                   # the decode GEMVs' warps a block (templates/gemv.cu.j2 GV_WARPS)
GV_ADD_EARLY = 2                               # a GEMV's mode: the residual add reading out before pdl_wait (add_mode)
GR_SMEM = GR_STAGES * GV_WARPS * GR_UR * (2 * 32 * 16 + 8 * 2 * 8)
# gemv_ring3_*: three stages, registers for three blocks an SM; an ungated GEMV of more tiles than GR_BLOCKS blocks an
# SM hold but no more than GR3_BLOCKS (the 8B shape's qkv: 384 tiles on 132 SMs) takes it, one tile a block, so no
# block walks a second tile while the others have ended (on two blocks an SM, 120 of 264 blocks did: qkv's last
# block ended ~3 us after its median one)
GR3_STAGES, GR3_BLOCKS = 3, 3
GR3_SMEM = GR3_STAGES * GV_WARPS * GR_UR * (2 * 32 * 16 + 8 * 2 * 8)
GR_NB = (1, 2, 4, 8)
GR_STATIC_SMEM = 10240                         # gemv_ring*'s static shared memory (9 KB at 8 rows: the tiles' partial sums), rounded up
GEMM_TILE_N, GEMM_TILE_M, GEMM_TILE_K = 128, 64, 64     # templates/gemm.cu.j2
WG_TILE_M, WG_TILE_K = 128, 64                          # templates/gemm_wgmma.cu.j2 (tiles 128 x BN x 64; rendered
WG_STAGES = {64: 8, 128: 6, 256: 4}                     # from these), its ring depth per BN: ~192 KB of shared memory
WG_MID_CHUNK = 256       # Hopper: prefill phases of up to this many rows (short chunks, mixed steps: decode rows plus
                         # a short prefill chunk) take the tile width by waves and split their GEMMs over K
# templates/gemm_wgmma_nvfp4.cu.j2 (rendered from these): a kernel per NB, the activation rows of a block (wgmma's N),
# with its activation ring depth; K a stage, weight rows a block, raw stages in flight and their bytes (codes + scales)
WQ_RA = {16: 4, 32: 4, 64: 4}
WQ_NB = tuple(WQ_RA)
WQ_K, WQ_ROWS, WQ_RW = 256, 64, 8
WQ_RAW = WQ_ROWS * (WQ_K // 2 + WQ_K // BLOCK)
WG_THREADS = 384         # gemm_wg and gemm_wq: a producer warpgroup and two consumers (rendered into both)
F16_NVFP4_UNSCALE = 2.0 ** 20    # NVFP4 expanded to fp16 holds q * s * 2^-14, its XF_F16 activations x * 2^-6


def wg_smem_bytes(bn: int) -> int:
    """Dynamic shared memory of gemm_wg<bn>: the ring, 1 KB to align it for the 128-byte swizzle, barriers."""
    return WG_STAGES[bn] * (WG_TILE_M + bn) * WG_TILE_K * 2 + 1024 + 256


def split_k_buffers(splits: int, tiles: int, part: int) -> tuple[list[dict], list[tuple[str, int]]]:
    """The split-K workspace of a wgmma GEMM launch (its splits add up in turn: templates/gemm_wgmma.cu.j2): its two
    arguments (the partial sums `part` bytes, a turn flag a tile; null pointers for one split) and the bytes of each
    it reads and writes."""
    if splits == 1:
        return [ptr(None), ptr(None)], []
    return [ptr("wg_ws"), ptr("wg_flags")], [("wg_ws", part), ("wg_flags", tiles * 4)]


def pair_shape(spec: ModelSpec) -> bool:
    """Whether templates/gemv_ring_pair.cu.j2 renders gemv_ring_pair_nvfp4_nb1 for this shape (its condition): down's
    K range 3 to 8 whole stages a warp (intermediate / 2048, the unrolled one-row down), qkv's two (hidden 4096), heads
    of whole 16-row tiles (the rope tail)."""
    return (spec.intermediate % 2048 == 0 and 3 <= spec.intermediate // 2048 <= 8 and spec.hidden % 2048 == 0
            and spec.hidden // 2048 * 2 == GR_STAGES and spec.head_dim % 16 == 0)


def pair_gated_shape(spec: ModelSpec) -> bool:
    """Whether templates/gemv_ring_pair.cu.j2 renders gemv_ring_pair_gated_nvfp4_nb1: o's K range 1 to 8 whole stages a
    warp (q_dim / 2048), gate_up's tile one revolution of the ring (hidden 4096)."""
    return spec.q_dim % 2048 == 0 and 1 <= spec.q_dim // 2048 <= 8 and spec.hidden // 1024 == GR_STAGES \
        and spec.hidden % 1024 == 0


def wq_shape(spec: ModelSpec) -> bool:
    """Whether any layer linear of this shape can run gemm_wq (K a multiple of WQ_K: qkv and gate_up read the hidden
    size, o the query width; down only after a gate_up on it): the kernels are emitted only then (nvcc time)."""
    return spec.hidden % WQ_K == 0 or spec.q_dim % WQ_K == 0


def wq_smem_bytes(nb: int) -> int:
    """Dynamic shared memory of gemm_wq<nb>: the consumers' reduction, the activation and raw rings, 1 KB to
    align them for the 128-byte swizzle, barriers."""
    return nb * 256 + WQ_RA[nb] * nb * WQ_K * 2 + WQ_RW * WQ_RAW + 1024 + 8 * 2 * (WQ_RW + WQ_RA[nb])


@dataclass
class _Lin:
    name: str
    fmt: str
    n: int
    k: int

    def weight_args(self) -> list[dict]:
        if self.fmt == "nvfp4":
            return [ptr(self.name + ".codes"), ptr(self.name + ".scales"), ptr(self.name + ".tscale")]
        if self.fmt == "int8":
            return [ptr(self.name + ".codes"), ptr(self.name + ".rscale")]
        return [ptr(self.name)]

    def reads(self) -> list[tuple[str, int]]:
        if self.fmt == "nvfp4":
            return [(self.name + ".codes", self.n * self.k // 2), (self.name + ".scales", self.n * self.k // BLOCK),
                    (self.name + ".tscale", 4)]
        if self.fmt == "int8":
            return [(self.name + ".codes", self.n * self.k), (self.name + ".rscale", self.n * 4)]
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
    dec = min(rows, dec_max or rows)
    return evaluate(v, {"rows": rows, "prows": rows, "dec": dec, "srows": dec})


def rows_div(rows, d: int):
    """ceil(rows / d) for rows an int or a plain symbol ({"sym": name})."""
    return {"sym": rows["sym"], "ceil_div": d} if isinstance(rows, dict) else -(-rows // d)


@dataclass
class _Emitter:
    """Records the launches of one phase."""
    pdl: bool
    launches: list[Launch] = field(default_factory=list)
    no_pdl_next: bool = False       # the next launch waits for its predecessor to finish (see decode's attention)

    def add(self, kernel: str, grid, block, args, reads, writes, smem: int = 0, fallback=()) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        pdl, self.no_pdl_next = self.pdl and not self.no_pdl_next, False
        self.launches.append(Launch(kernel, grid, block, smem, pdl and kernel.startswith(PDL_KERNELS),
                                    tuple(args), tuple((b, int(n)) for b, n in reads if n),
                                    tuple((b, int(n)) for b, n in writes if n), tuple(fallback)))

    def take(self, emit) -> tuple[Launch, ...]:
        """The launches emit() adds, taken back out (and the PDL state as before it): a fused launch's fallback."""
        n, no_pdl_next = len(self.launches), self.no_pdl_next
        emit()
        taken = tuple(self.launches[n:])
        del self.launches[n:]
        self.no_pdl_next = no_pdl_next
        return taken

    def add_mode(self, kernel: str, mode: int, out: str) -> int:
        """A per-block decode GEMV's residual add (mode 1) as GV_ADD_EARLY (2: templates/gemv.cu.j2, out's values read
        before pdl_wait) where the launch before it does not write out: a kernel lets its dependent start only after
        its own pdl_wait, so every earlier writer of out has completed by then; the residual's L2 round trip leaves
        the epilogue's critical path (o and down, twice a layer). Measured (BENCHMARKS.md, twenty-eighth session):
        SmolLM2 shape b1 +5.0%, b8 +9.0%. Not the streamed GEMV (gemv_ring*): there the same prefetch cost registers
        (121 -> 127-128, a spill) and the 8B shape lost 0.3-0.6% at one row."""
        if mode == 1 and not kernel.startswith("gemv_ring") and self.launches \
                and all(b != out for b, _ in self.launches[-1].writes):
            return GV_ADD_EARLY
        return mode


SMALL_HEAD_K = 1024     # a head of K up to this: more of its rows a block at one to four rows (gv_i8_tiles, bf16w_ok)


def gv_i8_tiles(k: int) -> dict[int, int]:
    """GV_I8_TILES for a head of K = k: at small K a tile's 16 rows are few bytes (SmolLM2's 576: 9 KB a block, two
    blocks an SM), too few in flight, so one to four rows take four tiles a block (each row's MMAs and their order
    unchanged: the same bits). SmolLM2 shape's INT8 head at one row (H200): 23.2 us with one tile, 19.0 with two,
    17.9 with four, 32.9 with eight (BENCHMARKS.md, twenty-seventh session)."""
    return {**GV_I8_TILES, 1: 4, 2: 4, 4: 4} if k <= SMALL_HEAD_K else GV_I8_TILES


def bf16w_ok(lin) -> bool:
    """A bf16 GEMV at one row on gemv_bf16w_nb1 (templates/gemv.cu.j2, emitted where HIDDEN <= SMALL_HEAD_K): the head
    (K = HIDDEN). SmolLM2 shape's tied bf16 head (H200): 24.7 -> 19.5 us (54 -> 69% of the copy bandwidth), a step at
    one row +1.1% (BENCHMARKS.md, twenty-seventh session)."""
    return lin.name in ("embed", "lm_head") and lin.k <= SMALL_HEAD_K


class LinearLaunches:
    """ProgramBuilder's linear layers (a mixin: it reads the builder's spec, formats, target, options, buffers and
    the phase being built: rows_max, wg_layers, wq, MB)."""

    def default_gemv_rows(self) -> int:
        """Decode batches up to this many rows on the GEMV, by measurement on the H200 (BENCHMARKS.md):
        - where Hopper's NVFP4 decode GEMM takes every layer linear (K a multiple of 256): 4 rows for hidden sizes
          of 4096 and up (8B, batch 8: 1800 tok/s on the GEMM against 1652 on the GEMV; thirty-first session, the
          streamed GEMV at 8 rows: 3,024 against the GEMM's 3,107, and 2,272 against 2,335 at 6), else 8 (Qwen3-0.6B
          shape: batch 8 6319 on the GEMV against 5934, batch 16 10871 on the GEMM against 10225);
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

    def lin(self, name: str) -> _Lin:
        n, k = self.spec.tensor_shapes()[name]
        return _Lin(name, self.formats[name], n, k)

    def gated_wgmma(self, lin: _Lin) -> bool:
        """gate_up on the wgmma GEMM from an expanded NVFP4 copy: the GEMM's epilogue applies act(gate) * up."""
        return self.wg_layers and lin.fmt == "nvfp4"

    def cutlass_ok(self, lin: _Lin, mode: int, rope) -> bool:
        """--prefill-gemm cutlass: a phase past WG_MID_CHUNK rows, bf16 weights or NVFP4's fp16 copies, a plain or
        residual-adding GEMM (gate_up's fused gated epilogue and the qkv one stay imp's)."""
        return (self.opt.prefill_gemm == "cutlass" and self.target["name"] == "sm_90a" and lin.fmt in ("bf16", "nvfp4")
                and mode in (0, 1) and rope is None and self.rows_max > WG_MID_CHUNK and lin.k % 8 == 0
                and lin.n % 4 == 0)

    def linear_cutlass(self, e: _Emitter, a: str, lin: _Lin, out: str, rows, mode: int) -> None:
        """out[rows, N] (= | +=) a[rows, K] @ W^T by CUTLASS's kernel (impc/cutlass.py): one argument, its Params,
        from the table of this shape; the runtime encodes the four descriptors over a, W and out and, each step, writes
        the row bucket's words and grid."""
        from impc.cutlass import params_table, table_key
        m = ev(rows, self.rows_max, self.MB)
        rows_a = self.buffers[a].bytes // (lin.k * 2)
        rows_out = self.buffers[out].bytes // (lin.n * 4)
        rmax = min(self.rows_max, rows_a, rows_out)
        arg = {"rows": rows, "A": a, "W": lin.name, "C": out, "D": out}
        if lin.fmt == "nvfp4":                  # the fp16 copy (expanded at load, or now into wdq), its tensor scale
            fmt, alpha, arg["W"], arg["scale"] = "f16", F16_NVFP4_UNSCALE, lin.name + ".f16", lin.name + ".tscale"
            if self.wg_mode == "dequant":
                arg["W"] = "wdq"
                self.dequant(e, lin, "wdq")
            reads = [(arg["W"], lin.n * lin.k * 2), (arg["scale"], 4)]
        else:
            fmt, alpha, reads = "bf16", 1.0, lin.reads()
        key = table_key(fmt, lin.n, lin.k, mode, rmax)
        if key not in self.cutlass_tables:
            self.cutlass_tables[key] = params_table(fmt, lin.n, lin.k, float(mode), rmax, self.sm_count, alpha)
        t = self.cutlass_tables[key]
        self.kernel_smem[t["kernel"]] = t["smem"]
        reads += [(a, m * lin.k * 2)] + ([(out, m * lin.n * 4)] if mode == 1 else [])
        e.add(t["kernel"], tuple(t["grids"][-1]), tuple(t["block"]), [{"cutlass": {"table": key, **arg}}],
              reads, [(out, m * lin.n * 4)], smem=t["smem"])       # (not a PDL kernel: it has no pdl_wait)

    def linear_wgmma(self, e: _Emitter, a: str, lin: _Lin, out: str, rows, mode: int, rope=None) -> None:
        """Prefill on Hopper: out[rows, N] (= | +=) a[rows, K] @ W^T with the TMA + wgmma GEMM over 16-bit
        operands; NVFP4 weights from their fp16 copy, or expanded into `wdq` first (prefill_weights_mode).
        Modes 2/3 (gate_up): out[rows, N/2] = act(gate) * up as XF_F16 / XF_BF16 activations. rope (layer i, its
        qkv_rope_cache_f16 arguments after the qkv rows; qkv_epilogue_ok): the qkv projection with q / k norm, RoPE and
        the KV append in its epilogue (gemm_wgp_qkv_f16): q and layer i's KV pages written, not out."""
        m = ev(rows, self.rows_max, self.MB)
        out_bytes = m * lin.n * 4 if mode < 2 else m * lin.n // 2 * 2
        if self.cutlass_ok(lin, mode, rope):
            return self.linear_cutlass(e, a, lin, out, rows, mode)
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
        rows_a = self.buffers[a].bytes // (lin.k * 2)
        args = [tmap(a, dtype, rows_a, lin.k, WG_TILE_M), None, ptr(out), tscale, {"f32": unscale}, i32(rows),
                i32(lin.n), i32(lin.k), i32(mode)]
        reads += [(a, m * lin.k * 2)] + ([(out, out_bytes)] if mode == 1 else [])
        if self.rows_max > WG_MID_CHUNK and self.opt.prefill_gemm == "auto":
            # a phase past WG_MID_CHUNK rows: the persistent ping-pong GEMM at every step (128 x 128 tiles, a block an
            # SM: no wave of half-filled SMs, one consumer's epilogue under the other's main loop). With its wgmma
            # descriptors in uniform registers it runs 602-647 TFLOP/s at M = 4096 against the per-tile kernel's
            # 543-622 (BENCHMARKS.md, twenty-fourth session); before that, the per-tile kernel took steps past 512 rows.
            grid = (min(-(-lin.n // 128) * -(-self.rows_max // WG_TILE_M), self.sm_count),)
            args[1] = tmap(wbuf, dtype, lin.n, lin.k, 128)
            if rope is None:
                kern, writes = f"gemm_wgp_{dtype}", [(out, out_bytes)]
                args += [ptr(None), ptr(None)]                    # (no split-K workspace)
            else:                   # gemm_wgp_qkv_f16: no C, mode or workspace; the rope inputs, q and the KV pages
                i, rope_args = rope
                s, kern = self.spec, "gemm_wgp_qkv_f16"
                a_map, w_map, _c, *scalars, _mode = args
                args = [a_map, w_map, *scalars, *rope_args, ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v")]
                reads += [("positions", m * 4), ("kv_slots", m * 4)]
                writes = [("q", m * s.q_dim * 2), (f"kv.{i}.k", m * s.kv_dim * 2), (f"kv.{i}.v", m * s.kv_dim * 2)]
            self.kernel_smem[kern] = wg_smem_bytes(128)
            e.add(kern, grid, (WG_THREADS,), args, reads, writes, smem=wg_smem_bytes(128))
            return
        # the wider tile where it still gives every SM a block at the chunk's full size; phases of one or two
        # row tiles (short chunks, decode batches past the GEMV, mixed steps) take the width whose waves of blocks
        # carry the fewest columns a block (ties to the wider: gate_up at 128 rows runs 384 64-column tiles in 3
        # waves rather than 192 128-column ones in 2), and split K so the grid (at most one block per SM: the
        # splits wait on each other) fills the GPU
        rtiles = -(-self.rows_max // WG_TILE_M)
        bn = 256 if -(-lin.n // 256) * rtiles >= self.sm_count else 128
        if self.rows_max <= WG_MID_CHUNK:     # the width with the least work a block wave (waves x width)
            bn = min((256, 128, 64), key=lambda w: -(-(-(-lin.n // w) * rtiles) // self.sm_count) * w)
        tiles, splits = -(-lin.n // bn), 1
        if self.rows_max <= WG_MID_CHUNK:
            splits = max(1, min(-(-lin.k // WG_TILE_K) // 4, self.sm_count // (tiles * rtiles)))
        # the split-K partial sums: 128 x bn floats a tile
        split_args, ws = split_k_buffers(splits, tiles * rtiles, tiles * rtiles * bn * 512)
        kern = f"gemm_wg{bn}_{dtype}"
        self.kernel_smem[kern] = wg_smem_bytes(bn)
        args[1] = tmap(wbuf, dtype, lin.n, lin.k, bn)
        gy = rows_div(rows, WG_TILE_M)
        e.add(kern, (tiles, gy, splits), (WG_THREADS,), args + split_args, reads + ws, [(out, out_bytes)] + ws,
              smem=wg_smem_bytes(bn))

    def qkv_epilogue_ok(self, lin: _Lin, dec: bool) -> bool:
        """The prefill qkv projection with q / k norm, RoPE and the KV append in its epilogue, no qkv_rope_cache_f16
        launch and no float32 qkv (--prefill-qkv-epilogue, off by default: GPU-tested, measured no faster): Hopper's
        large prefill phases on the ping-pong GEMM (linear_wgmma), NVFP4 weights (their fp16 expansion), heads of 64
        or 128 (a 128-column tile is whole heads: templates/gemm_wgmma.cu.j2 wg_qkv_epilogue)."""
        return (self.opt.prefill_qkv_epilogue and not dec and bool(self.wg_layers) and lin.fmt == "nvfp4"
                and not self.wq_ok(lin) and self.rows_max > WG_MID_CHUNK and self.opt.prefill_gemm == "auto"
                and self.spec.head_dim in (64, 128))

    def wq_ok(self, lin: _Lin) -> bool:
        """This decode step's layer linear on gemm_wq (NVFP4 read as stored): a Hopper decode batch past the
        GEMV's rows, up to the largest NB, K a multiple of WQ_K (the scales' TMA rows then 16-byte aligned)."""
        if not (self.wq and lin.fmt == "nvfp4" and lin.k % WQ_K == 0 and lin.name.startswith("layers.")):
            return False
        if lin.name.endswith(".down"):      # its input (XF_F16W) comes from gate_up's epilogue on the same GEMM
            return self.wq_ok(self.lin(lin.name[:-len("down")] + "gate_up"))
        return True

    def wq_units(self, lin: _Lin, gated: bool) -> tuple[int, int, int, int]:
        """gemm_wq's work for lin in this phase: NB, weight tiles, row tiles, K splits (its grid: min(units, SMs))."""
        nb = next(x for x in WQ_NB if x >= self.rows_max)
        tiles = -(-(lin.n // 2) // (WQ_ROWS // 2)) if gated else -(-lin.n // WQ_ROWS)
        ytiles = -(-self.rows_max // nb)
        # split K over blocks where the tiles leave SMs idle: every split at least 4 stages (both consumers busy)
        splits = max(1, min(lin.k // WQ_K // 4, self.sm_count // (tiles * ytiles)))
        return nb, tiles, ytiles, splits

    def wq_norm_tail_ok(self, writer: _Lin, reader: _Lin) -> bool:
        """The RMSNorm between a gemm_wq launch adding into x (o, down) and the gemm_wq launch reading its result
        (gate_up, the next layer's qkv) in the writer's tail (templates/gemm_wgmma_nvfp4.cu.j2 wq_norm_tail; gemm_wq
        runs only where the one-row GEMV, whose prologue may norm instead, does not: norm_fused never applies): the
        hidden size in whole 256s whose float32 row fits the raw ring, and a block of the grid for every row (the
        norming blocks wait for the rest: a GPU with no more SMs than rows would hang, so the runtime refuses such a
        bundle there: runtime/executor_cuda.py; --no-norm-tail compiles without)."""
        if not (self.opt.norm_tail and self.wq_ok(writer) and self.wq_ok(reader) and writer.n == self.spec.hidden):
            return False
        h = self.spec.hidden
        nb, tiles, ytiles, splits = self.wq_units(writer, False)
        return h % 256 == 0 and h * 4 <= WQ_RW * WQ_RAW and self.rows_max <= min(tiles * ytiles * splits,
                                                                                   self.sm_count)

    def linear_wq(self, e: _Emitter, a: str, lin: _Lin, out: str, rows, mode: int, norm: str | None = None) -> None:
        """out[rows, N] (= | +=) a[rows, K] @ W^T, a in XF_F16W, W's NVFP4 codes and scales expanded in registers by
        the GEMM itself (templates/gemm_wgmma_nvfp4.cu.j2); modes 2/3/4: gate_up, act(gate) * up as XF_F16 / XF_BF16
        / XF_F16W. norm (mode 1, wq_norm_tail_ok): the RMSNorm with that weight of the rows of out after the add,
        into hb as XF_F16W, in the launch's tail."""
        m = ev(rows, self.rows_max, self.MB)
        gated = mode >= 2
        nb, tiles, ytiles, splits = self.wq_units(lin, gated)
        # a slot of partial sums a split and tile (the last split to end adds them: templates/gemm_wgmma_nvfp4.cu.j2)
        split_args, ws = split_k_buffers(splits, tiles * ytiles, splits * tiles * ytiles * nb * WQ_ROWS * 4)
        box = WQ_ROWS // 2 if gated else WQ_ROWS
        out_bytes = m * lin.n * 4 if not gated else m * lin.n // 2 * 2
        reads = lin.reads() + [(a, m * lin.k * 2)] + ([(out, out_bytes)] if mode == 1 else []) + ws
        writes = [(out, out_bytes)] + ws
        if norm is not None:
            assert mode == 1, "the norm tail follows a residual add"
            h = self.spec.hidden
            norm_args = [ptr(norm), ptr("hb"), ptr("norm_count")]
            reads += [(norm, h * 4), ("norm_count", 8)]
            writes += [("hb", m * h * 2), ("norm_count", 8)]
        else:
            norm_args = [ptr(None)] * 3
        kern = f"gemm_wq{nb}"
        self.kernel_smem[kern] = wq_smem_bytes(nb)
        rows_a = self.buffers[a].bytes // (lin.k * 2)
        # persistent: a block an SM at most, walking the units (tile x, row tile, split) in turn
        e.add(kern, (min(tiles * ytiles * splits, self.sm_count),), (WG_THREADS,),
              [tmap(a, "f16", rows_a, lin.k, nb), tmap(lin.name + ".codes", "u8", lin.n, lin.k // 2, box, WQ_K // 2),
               tmap(lin.name + ".scales", "u8", lin.n, lin.k // BLOCK, box, WQ_K // BLOCK), ptr(out),
               ptr(lin.name + ".tscale"), {"f32": F16_NVFP4_UNSCALE}, i32(rows), i32(lin.n), i32(lin.k), i32(mode),
               *split_args, i32(tiles), i32(splits), *norm_args], reads, writes, smem=wq_smem_bytes(nb))

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
               nb: int = 0, norm: str | None = None, partial_norm: str | None = None, scaled: bool = False,
               rope: tuple[int, list] | None = None) -> bool:
        """out[rows, N] (= | +=) a[rows, K] @ W^T: the decode GEMV over x planes (planes, rows <= nb), or the
        GEMM over gfmt(W) activations (split over K with atomics when split_k). norm: gemm_wq's norm tail;
        partial_norm: the ring GEMV adding into x writes the next norm as partial sums with this weight (ring_norm_ok);
        scaled: the ring GEMV reads such planes and scales its rows by their norm. rope: the qkv projection's layer
        and qkv_rope_cache_f16's arguments after the qkv rows, for its work in the GEMV's tail where rope_tail_ok.
        Returns whether the launch took that work."""
        if self.wq_ok(lin):
            assert partial_norm is None and not scaled
            self.linear_wq(e, a, lin, out, rows, mode, norm)
            return False
        assert norm is None, "only gemm_wq norms in its tail"
        if self.wg_layers and lin.name.startswith("layers."):
            self.linear_wgmma(e, a, lin, out, rows, mode)
            return False
        m = ev(rows, self.rows_max, self.MB)
        reads = lin.reads() + [(a, 2 * m * lin.k * 2 if planes else m * lin.k * 2)] + ([(out, m * lin.n * 4)] if mode else [])
        writes = [(out, m * lin.n * 4)]
        if planes:
            tiles = -(-lin.n // (16 * gv_i8_tiles(lin.k)[nb])) if lin.fmt == "int8" else (lin.n + 15) // 16
            kern, grid, smem = self.gemv_launch(f"gemv_{lin.fmt}_nb{nb}", lin, nb, tiles)
            if kern == "gemv_bf16_nb1" and bf16w_ok(lin):
                kern = "gemv_bf16w_nb1"
            norm_args, norm_reads, norm_writes = self.ring_norm(kern, lin, m, partial_norm, scaled)
            rope_args = []
            if rope is not None and self.rope_tail_ok(kern, lin, mode):
                # (before the norm's: a streamed GEMV's last four arguments are those, GEMV_NORM_PARAMS)
                # (--attn-head-ready: the variant that also counts each kv head in for the attention after it, in
                # rope_count past the heads' tile counts)
                ready = self.opt.attn_head_ready
                kern = ("gemv_ring3_rope_ready_" if ready else "gemv_ring3_rope_") + kern[len("gemv_ring3_"):]
                self.kernel_smem[kern] = smem
                i, inputs = rope
                s = self.spec
                rope_args = [*inputs, ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v"), ptr("rope_count")]
                counts = rope_counts(s)[1 if ready else 0] * 4
                reads += [("positions", m * 4), ("kv_slots", m * 4), ("rope_count", counts)]
                writes += [("q", m * s.q_dim * 2), (f"kv.{i}.k", m * s.kv_dim * 2), (f"kv.{i}.v", m * s.kv_dim * 2),
                           ("rope_count", counts)]
            e.add(kern, (grid,), (256,),
                  [ptr(a), *lin.weight_args(), ptr(out), i32(lin.n), i32(lin.k), i32(rows), i32(e.add_mode(kern, mode, out)),
                   *rope_args, *norm_args],
                  reads + norm_reads, writes + norm_writes, smem=smem)
            return bool(rope_args)
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
        kern = {"nvfp4": "gemm_nvfp4_f16", "int8": "gemm_int8_f16"}.get(lin.fmt, "gemm_bf16")
        e.add(kern, (gx, gy, splits), (256,), [ptr(a), *lin.weight_args(), ptr(out), i32(rows), i32(lin.n),
                                               i32(lin.k), i32(mode)], reads, writes)
        return False

    def rope_tail_ok(self, kern: str, lin: _Lin, mode: int) -> bool:
        """qkv_rope_cache_f16's work (bias, q/k norm, RoPE, q out, k and v into the paged cache) in the tail of the qkv
        projection's decode GEMV (templates/gemv_ring.cu.j2 rope_tail: the block storing a head's last tile does the
        head), one launch a layer fewer: where it runs gemv_ring3_* (one tile a block, the whole grid resident: the
        8B shape; a persistent block's next tiles would wait behind a head's tail) at one row (8B shape b1 +0.5%; at 2
        and 4 rows -2.4% and -3.3%, the launch kept: BENCHMARKS.md, thirty-third session), storing the float32 qkv rows
        (the tail reads them back from L2), heads of whole 16-row tiles (--no-qkv-rope-tail: the launch). The same
        arithmetic on the same values as qkv_rope_cache_f16: the same bits, so the program, whose other batches keep
        that launch, stays batch-invariant."""
        return (self.opt.qkv_rope_tail and kern == "gemv_ring3_nvfp4_nb1" and mode == 0
                and lin.name.endswith(".qkv") and self.spec.head_dim % 16 == 0)

    def pair_ok(self, down: _Lin, qkv: _Lin, nb: int, rope_in_attention: bool) -> bool:
        """--gemv-pair: one row's down GEMV and the next layer's qkv GEMV in one launch (templates/gemv_ring_pair.cu.j2
        gemv_ring_pair_nvfp4_nb1: qkv's weights stream into down's freed ring slots under its tail, a grid barrier
        between them), where each would run alone as the 8B shape's do: down on the unrolled one-tile-a-block streamed
        GEMV (gemv_ringxr_*, intermediate / 2048 stages a warp), qkv on ring3 with the rope tail (rope_tail_ok), two
        stages a warp a tile (hidden 4096) so that two tiles a block are one revolution of the ring, the norm between
        them as partial sums (ring_norm_ok), every qkv tile on a block of the grid of two an SM."""
        if not (self.opt.pair("down-qkv") and nb == 1 and not rope_in_attention and pair_shape(self.spec)
                and self.ring_norm_ok(down, qkv, True, nb)):
            return False
        kd, _, _ = self.gemv_launch("gemv_nvfp4_nb1", down, 1, down.n // 16)
        kq, _, _ = self.gemv_launch("gemv_nvfp4_nb1", qkv, 1, qkv.n // 16)
        bt = GR_STAGES // 2
        return (kd == "gemv_ringxr_nvfp4_nb1" and self.rope_tail_ok(kq, qkv, 0) and self.ring_stages(qkv, False) == 2
                and down.n // 16 <= GR_BLOCKS * self.sm_count and qkv.n // 16 <= bt * GR_BLOCKS * self.sm_count)

    def linear_pair(self, e: _Emitter, i: int, down: _Lin, qkv: _Lin, norm: str, rope_inputs: list,
                    fallback: tuple = ()) -> None:
        """Layer i's down (x += ab @ Wd^T, the next norm's planes in hb and partial sums in norm_part) and layer i + 1's
        qkv (qkv = hb @ Wq^T scaled by the norm, q and layer i + 1's KV pages by its rope tail) in one launch at one
        row (pair_ok): the two launches' arguments and bytes, and the grid barrier's count (pair_bar); fallback: the
        two launches, for a GPU that cannot hold the grid at once (runtime/program.py unfuse)."""
        s, h = self.spec, self.spec.hidden
        kern, _, smem = self.gemv_launch("gemv_nvfp4_nb1", down, 1, down.n // 16)
        kern = "gemv_ring_pair_nvfp4_nb1"
        self.kernel_smem[kern] = smem
        heads = s.n_heads + 2 * s.n_kv_heads
        j = i + 1
        reads = (down.reads() + [("ab", 2 * down.k * 2), ("x", h * 4), (norm, h * 4)] + qkv.reads()
                 + [("hb", 2 * h * 2), ("norm_part", h // 16 * 4), ("positions", 4), ("kv_slots", 4),
                    ("rope_count", heads * 4), ("pair_bar", 4)])
        writes = [("x", h * 4), ("hb", 2 * h * 2), ("norm_part", h // 16 * 4), ("qkv", qkv.n * 4), ("q", s.q_dim * 2),
                  (f"kv.{j}.k", s.kv_dim * 2), (f"kv.{j}.v", s.kv_dim * 2), ("rope_count", heads * 4), ("pair_bar", 4)]
        e.add(kern, (GR_BLOCKS * self.sm_count,), (256,),
              [ptr("ab"), *down.weight_args(), ptr("x"), i32(down.n), i32(down.k), ptr(norm), ptr("hb"),
               ptr("norm_part"), *qkv.weight_args(), ptr("qkv"), i32(qkv.n), i32(qkv.k), *rope_inputs, ptr("q"),
               ptr(f"kv.{j}.k"), ptr(f"kv.{j}.v"), ptr("rope_count"), ptr("pair_bar")],
              reads, writes, smem=smem, fallback=fallback)

    def pair_gated_ok(self, o: _Lin, gate_up: _Lin, nb: int) -> bool:
        """--gemv-pair: one row's o GEMV and gate_up in one launch (templates/gemv_ring_pair.cu.j2
        gemv_ring_pair_gated_nvfp4_nb1: gate_up's first stages issued before the grid-dependency wait, while the
        attention runs, the next ones during o, a grid barrier between them), where each would run alone as the 8B
        shape's do: o on the staged-activation streamed GEMV (gemv_ringx_*, a tile a block), gate_up on the unrolled
        one (gemv_ringxr_gated_*, a tile one revolution of the ring), the norm between them as partial sums."""
        if not (self.opt.pair("o-gate-up") and nb == 1 and pair_gated_shape(self.spec)
                and self.ring_norm_ok(o, gate_up, True, nb)):
            return False
        ko, _, _ = self.gemv_launch("gemv_nvfp4_nb1", o, 1, o.n // 16)
        kg, _, _ = self.gemv_launch("gemv_gated_nvfp4_nb1", gate_up, 1, gate_up.n // 32)
        return (ko == "gemv_ringx_nvfp4_nb1" and kg == "gemv_ringxr_gated_nvfp4_nb1"
                and self.ring_stages(o, False) == o.k // 2048 and o.n // 16 <= GR_BLOCKS * self.sm_count)

    def linear_pair_gated(self, e: _Emitter, o: _Lin, gate_up: _Lin, norm: str, ofmt: int,
                          fallback: tuple = ()) -> None:
        """o (x += attn @ Wo^T, the next norm's planes in hb and partial sums in norm_part) and gate_up (ab = act(gate) *
        up of hb @ Wg^T scaled by the norm, in activation format ofmt) in one launch at one row (pair_gated_ok): the
        two launches' arguments and bytes, and the grid barrier's count (pair_bar); fallback: the two launches."""
        h, m = self.spec.hidden, 1
        kern = "gemv_ring_pair_gated_nvfp4_nb1"
        smem = max(self.gemv_launch("gemv_nvfp4_nb1", o, 1, o.n // 16)[2],
                   self.gemv_launch("gemv_gated_nvfp4_nb1", gate_up, 1, gate_up.n // 32)[2])
        self.kernel_smem[kern] = smem
        reads = (o.reads() + [("attn", 2 * m * o.k * 2), ("x", m * h * 4), (norm, h * 4)] + gate_up.reads()
                 + [("hb", 2 * m * gate_up.k * 2), ("norm_part", m * h // 16 * 4), ("pair_bar", 4)])
        writes = [("x", m * h * 4), ("hb", 2 * m * h * 2), ("norm_part", m * h // 16 * 4),
                  ("ab", 2 * m * self.spec.intermediate * 2), ("pair_bar", 4)]
        e.add(kern, (GR_BLOCKS * self.sm_count,), (256,),
              [ptr("attn"), *o.weight_args(), ptr("x"), i32(o.n), i32(o.k), ptr(norm), ptr("hb"), ptr("norm_part"),
               *gate_up.weight_args(), ptr("ab"), i32(gate_up.n), i32(gate_up.k), i32(ofmt), ptr("pair_bar")],
              reads, writes, smem=smem, fallback=fallback)

    def ring_ok(self, lin: _Lin, nb: int, gated: bool = False) -> bool:
        """The decode GEMV of lin on gemv_ring_* (Hopper; NVFP4 whose K splits into whole ring stages a warp, so the
        stages need no guards and their scale bytes are 8-byte aligned; output rows whole 16-row tiles, so the
        copies need no clamp; up to GR_NB rows, and only where every GEMV batch of the program is: the streamed GEMV
        multiplies the activation's hi plane alone, the per-block one both planes, so a program mixing them would
        round one sequence's logits differently by its batch; so not where one row's norm is fused into a per-block
        GEMV's prologue, norm_fused: the Qwen3-0.6B shape's gate_up). gated: the gate_up GEMV (gemv_ring_gated_*: its 8
        warps split between the gate and the up rows, so each K range is a quarter, and its outputs are half the
        rows)."""
        return (nb in GR_NB and self.gemv_rows <= max(GR_NB) and self.ring_shape_ok(lin, gated)
                and not self.norm_fused(lin, True, 1))

    @staticmethod
    def ring_stages(lin: _Lin, gated: bool) -> float:
        """The ring stages of each warp's K range in a tile of lin (templates/gemv_ring.cu.j2 R; whole where
        ring_shape_ok): K over the warps splitting it (gated: half of them, templates/gemv.cu.j2 KW), 32 k a chunk,
        4 chunks a group, GR_UR groups a stage."""
        return lin.k / (32 * (GV_WARPS // 2 if gated else GV_WARPS) * 4 * GR_UR)

    def ring_shape_ok(self, lin: _Lin, gated: bool = False) -> bool:
        """ring_ok's conditions on the target and lin's shape alone."""
        return (self.target["compute_capability"][0] == 9 and lin.fmt == "nvfp4"
                and self.ring_stages(lin, gated).is_integer()  # every warp's K range whole stages
                and (lin.n // 2 if gated else lin.n) % 16 == 0)

    def gemv_launch(self, kern: str, lin: _Lin, nb: int, tiles: int) -> tuple[str, int, int]:
        """The decode GEMV `kern` (gemv_X) of lin over `tiles` 16-row tiles: (kernel, grid, dynamic shared memory);
        where ring_ok, gemv_ring_X on its persistent grid (GR_BLOCKS an SM at most), or gemv_ring3_X on a grid of
        one block a tile where that is no more than GR3_BLOCKS an SM (ungated only). At one row on the persistent
        grid, gemv_ringx_X / gemv_ringx3_X (four / three stages) where the staged activation fits beside the ring:
        a stage's activation read from shared memory instead of global loads queued behind the ring's copies
        (8B shape, H200: gate_up 65 -> 72%, down 52 -> 60% of the copy bandwidth, b1 +4.5%; BENCHMARKS.md,
        eighteenth session). qkv's one-tile-a-block ring3 stays without it (42% against 44%: at three blocks an SM
        the staging's registers spill; a cp.async staging, no registers, cost gate_up 4 points, its group wait
        also waiting for the weight stages issued before pdl_wait)."""
        gated = kern.startswith("gemv_gated_")
        if not self.ring_ok(lin, nb, gated=gated):
            return kern, tiles, 0
        # --gemv-ring-unroll: one-row gate_up's stage loop unrolled where a tile is one revolution of the four-stage
        # ring (templates/gemv_ring.cu.j2 RU: gemv_ringxr_gated_*; the same bits as gemv_ringx_gated_*), and down's
        # where a block has one tile (gemv_ringxr_*, RU rendered from the shape's intermediate size: K / 2048 stages,
        # 3 to 8)
        stages = self.ring_stages(lin, gated)
        if gated:
            rev = self.opt.gemv_ring_unroll and stages == GR_STAGES
        else:
            rev = (self.opt.gemv_ring_unroll and lin.k == self.spec.intermediate and stages.is_integer()
                   and 3 <= stages <= 8 and tiles <= GR_BLOCKS * self.sm_count)
        ringx = "ringxr" if rev else "ringx"
        ring3 = not gated and nb <= 4 and GR_BLOCKS * self.sm_count < tiles <= GR3_BLOCKS * self.sm_count
        if nb == 1 and not ring3:
            # one row on the persistent grid: each warp's K range of the activation staged in shared memory behind
            # the ring (gemv_ringx_*), four stages deep or, where that leaves no room, three (gemv_ringx3_*)
            xs = GV_WARPS * (lin.k // (GV_WARPS // 2 if gated else GV_WARPS) * 2 + 32)   # the hi plane (fp16)
            # the SM's shared memory (targets/: smem_per_sm_bytes) over the ring's blocks, 1 KB of it reserved a block
            per_block = self.target["smem_per_sm_bytes"] // GR_BLOCKS - 1024 - GR_STATIC_SMEM
            for rx, stages_smem in ((ringx, GR_SMEM), ("ringx3", GR3_SMEM)):
                if stages_smem + xs <= per_block and not (gated and rx == "ringx3"):
                    kern = f"gemv_{rx}_{kern[len('gemv_'):]}"
                    self.kernel_smem[kern] = max(self.kernel_smem.get(kern, 0), stages_smem + xs)
                    return kern, min(tiles, GR_BLOCKS * self.sm_count), stages_smem + xs
        if ring3:
            kern = "gemv_ring3_" + kern[len("gemv_"):]
            self.kernel_smem[kern] = GR3_SMEM
            return kern, tiles, GR3_SMEM
        kern = "gemv_ring_" + kern[len("gemv_"):]
        self.kernel_smem[kern] = GR_SMEM
        return kern, min(tiles, GR_BLOCKS * self.sm_count), GR_SMEM

    @staticmethod
    def ring_norm(kern: str, lin: _Lin, m: int, partial_norm: str | None,
                  scaled: bool) -> tuple[list[dict], list[tuple[str, int]], list[tuple[str, int]]]:
        """A decode GEMV's part in the norm as partial sums (ring_norm_ok), for m rows: a streamed GEMV's last four
        arguments (templates/gemv_ring.cu.j2 GEMV_NORM_PARAMS: the norm weight, the planes and the partial sums it
        writes where partial_norm names that weight, the partial sums it scales its rows by where scaled), and the
        bytes they add to its reads and writes; nothing for the other GEMVs."""
        if not kern.startswith("gemv_ring"):
            assert partial_norm is None and not scaled, kern
            return [], [], []
        args = [ptr(partial_norm), ptr("hb"), ptr("norm_part")] if partial_norm else [ptr(None)] * 3
        reads = [(partial_norm, lin.n * 4)] if partial_norm else []
        writes = [("hb", 2 * m * lin.n * 2), ("norm_part", m * lin.n // 16 * 4)] if partial_norm else []
        if scaled:
            reads.append(("norm_part", m * lin.k // 16 * 4))
        return args + [ptr("norm_part" if scaled else None)], reads, writes

    def ring_norm_ok(self, writer: _Lin, reader: _Lin, dec: bool, nb: int) -> bool:
        """The RMSNorm between the decode GEMV adding into x (o, down) and the one reading its norm (gate_up, the
        next layer's qkv) as partial sums (templates/gemv_ring.cu.j2 gemv_ring_body): both on the streamed GEMV (Hopper,
        NVFP4 x planes), the writer's rows and the reader's K the hidden size. The same at every GEMV batch size, so
        that they all round alike (batch invariance): every GEMV batch on the streamed GEMV (no more GEMV rows than
        GR_NB's largest) and the one-row reader's norm not fused in a per-block GEMV's prologue (small shapes:
        norm_fused, whose bits equal the norm launch's, not these). One norm launch fewer each: 71 of the 8B's 73 a
        step at 1-4 rows (BENCHMARKS.md, twenty-third session)."""
        h = self.spec.hidden
        gated = reader.name.endswith(".gate_up")
        return (dec and self.opt.norm_partials and writer.n == h and reader.k == h and h % 256 == 0
                and self.gemv_rows <= max(GR_NB) and nb in GR_NB
                and self.ring_ok(writer, 1) and self.ring_ok(reader, 1, gated=gated)
                and not self.norm_fused(reader, True, 1))

    def norm_fused(self, lin: _Lin, dec: bool, nb: int) -> bool:
        """Batch-1 decode of an NVFP4 projection of the normed residual: the GEMV computes the RMSNorm in its
        prologue (templates/gemv.cu.j2 *_norm_nb1, emitted for hidden sizes whose planes fit 32 KB), where its
        blocks fit one wave (two an SM): each block pays the prologue, so over several waves it costs more
        than the launch it saves (measured: SmolLM2 batch 1 +9%; the 8B shape, 1.5 and 3 waves, -5%). It comes
        before the streamed GEMV where both apply; the streamed GEMV itself has no fused norm: its 264 persistent
        blocks each computing it made the 8B's qkv 43% -> 25% of the copy bandwidth (BENCHMARKS.md, thirteenth
        session)."""
        h = self.spec.hidden
        cols = lin.n // 2 if lin.name.endswith(".gate_up") else lin.n
        fmts = ("nvfp4", "bf16") if self.opt.norm_prologue_bf16 else ("nvfp4",)   # bf16: its planes XF_BF16X2
        return (dec and nb == 1 and lin.name.endswith((".qkv", ".gate_up")) and lin.fmt in fmts and lin.k == h
                and 4 * h <= 32768
                and -(-cols // 16) <= 2 * self.sm_count)

    def gemv_norm(self, e: _Emitter, norm: str, lin: _Lin, out: str, mode: int, gated: bool) -> None:
        h = self.spec.hidden
        cols = lin.n // 2 if gated else lin.n
        e.add(f"gemv_{'gated_' if gated else ''}{lin.fmt}_norm_nb1", ((cols + 15) // 16,), (256,),
              [ptr("x"), ptr(norm), *lin.weight_args(), ptr(out), i32(lin.n), i32(lin.k), i32(1), i32(mode)],
              lin.reads() + [("x", h * 4), (norm, h * 4)],
              [(out, 2 * cols * 2 if gated else cols * 4)])
