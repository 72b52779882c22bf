"""Stage 4b: the launch program (runtime/program.py describes its form).

From the model spec, each tensor's stored format, the target (targets/<arch>/target.json) and the memory
plan, decide once every device buffer and, for every decode batch bucket, the prefill chunk and the logits
buckets, the exact sequence of kernel launches: which kernel, its grid and block, its shared memory, its
arguments, and the bytes it moves. The cuda executor only binds and replays what is written here; kernel
tests take their launches from here too, so a grid or an argument list exists in one place.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, replace

from impc.arena_layout import (FA_KV_SPLIT, FA_TILE_INTS, HOST_IO_WORDS, MAX_SEGMENTS, STEP_PACK_SKIP, WG_SMALL_CHUNK,
                               aligned, arena_entries, attn_partial_row, max_tiles, rope_counts, rope_variants, rows_for,
                               wgmma_weights)
from impc.errors import CompileError
from impc.launch_linear import (WG_MID_CHUNK, WQ_NB, LinearLaunches, _Emitter, _Lin, ev, i32, pair_gated_shape,
                                 pair_shape, ptr, rows_div, wq_shape)
from imp_runtime.activation_formats import GEMV_NB, XF_BF16, XF_F16, XF_F16W, gfmt, xfmt
from imp_runtime.nvfp4 import BLOCK
from imp_runtime.program import Buffer, Phase, Program, validate
from imp_runtime.spec import ModelSpec

ATTN_GRID_SPLITS = 16         # decode attention: at most this many blocks per (sequence, kv head)
LOGITS_BUCKETS = (1, 16)      # rows of logits one call computes (the last prompt token; all-token logits)
ROWS = {"sym": "rows"}


PAIR_KINDS = ("", "o-gate-up", "down-qkv")   # ProgramOptions.gemv_pair_only ("": both pairs)


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
    gpu_penalties: bool = True      # repetition / presence / frequency penalties applied on the GPU before sampling
                                    # (per-sequence token counts on the device); off: the host samples such rows
    prefill_attention: str = "wgmma"  # Hopper prefill attention: warpgroup MMA (wgmma, head dims that are multiples of
                                      # 64) or mma.sync (mma; always used elsewhere)
    rope_in_attention: bool | None = None  # decode phases: the attention computes q/k norm and RoPE of its rows and
                                           # appends the new key and value itself (attn_decode_rope_*), no qkv_rope
                                           # launch; None: by the shape (rope_in_attention below)
    norm_tail: bool = True            # Hopper decode on gemm_wq: the RMSNorm after o and down in their launch's tail
                                      # (launch_linear.py wq_norm_tail_ok), a block a row: a GPU needs more SMs than
                                      # rows
    norm_partials: bool = True        # Hopper decode on the streamed GEMV (1-8 rows): the same norm as partial sums in
                                      # the GEMVs' epilogues (launch_linear.py ring_norm_ok)
    prefill_qkv_epilogue: bool = False  # Hopper large prefill phases: q / k norm, RoPE and the KV append in the qkv
                                        # GEMM's epilogue (launch_linear.py qkv_epilogue_ok; measured no faster)
    prefill_gemm: str = "auto"        # Hopper prefill GEMMs in phases past 256 rows: auto (the persistent ping-pong
                                      # GEMM), tiles (the per-tile one) or cutlass (CUTLASS's, plain and residual GEMMs: cutlass.py)
    norm_prologue_bf16: bool = True   # one-row decode: the RMSNorm in the prologue of bf16 GEMVs too (launch_linear.py
                                      # norm_fused; SmolLM2 shape all bf16 b1 +6.4%, BENCHMARKS.md)
    gemv_ring_unroll: bool = True     # Hopper one-row decode: gate_up's and down's streamed GEMVs, their stage loops
                                      # unrolled over a tile (launch_linear.py gemv_launch; 8B shape b1 +0.6% and
                                      # +0.9%, BENCHMARKS.md)
    qkv_rope_tail: bool = True        # Hopper one-row decode where qkv runs gemv_ring3_*: q/k norm, RoPE and the KV
                                      # append in its launch's tail (launch_linear.py rope_tail_ok), no qkv_rope launch
    gemv_pair: bool = False           # Hopper one-row decode: o and gate_up, down and the next layer's qkv, each pair
                                      # in one launch, the second's weights streaming under the first (launch_linear.py
                                      # pair_ok, pair_gated_ok; off: measured 5.5-6.8% slower at one row on an H200)
    gemv_pair_only: str = ""          # with gemv_pair: "o-gate-up" or "down-qkv", that pair alone ("": both)
    attn_head_ready: bool = False     # Hopper one-row decode with qkv's rope tail: the decode attention's blocks of a
                                      # kv head start when the rope tails have stored its q, key and value (a count a
                                      # kv head) instead of waiting for the whole qkv launch (templates/attn_decode.cu.j2)

    def __post_init__(self) -> None:
        if self.gemv_pair_only not in PAIR_KINDS:
            raise ValueError(f"gemv_pair_only: one of {PAIR_KINDS}, not {self.gemv_pair_only!r}")
        if self.gemv_pair_only and not self.gemv_pair:
            raise ValueError("gemv_pair_only needs gemv_pair")
        if self.attn_head_ready and self.gemv_pair:
            # (the pair launch's rope tail counts no kv heads, nor would its unfused fallback's attention wait on them)
            raise ValueError("attn_head_ready (--attn-head-ready) and gemv_pair (--gemv-pair) do not go together: "
                             "the pair launch's rope tail counts no kv heads for the attention to wait on")

    def pair(self, kind: str) -> bool:
        """Whether the program fuses pair kind ("o-gate-up": o and gate_up, "down-qkv": down and the next layer's qkv)
        into one launch (templates/gemv_ring_pair.cu.j2), where the shape allows it."""
        return self.gemv_pair and self.gemv_pair_only in ("", kind)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fa_wg_geometry(head_dim: int, target: dict) -> dict | None:
    """The blocks of attn_prefill_wg (templates/attn_prefill_wgmma.cu.j2), Hopper's wgmma prefill attention, or
    None where it does not apply (not sm_90, or a head dim that is not a multiple of 64 up to 256): 2 warpgroups
    of 64 query rows, key tiles of 128 (64 above head dim 128: the O accumulators take twice the registers),
    the Q tile and two stages of K and V, 1024 bytes for the swizzle atoms' alignment."""
    if target["compute_capability"][0] != 9 or head_dim % 64 or head_dim > 256:
        return None
    qt, kt = 128, 128 if head_dim <= 128 else 64
    smem = (qt + 4 * kt) * head_dim * 2 + 1024
    if smem > target["smem_per_block_bytes"]:
        return None
    return {"emit": True, "threads": 256, "qt": qt, "kt": kt, "smem": smem}


def prefill_attention_wgmma(spec: ModelSpec, target: dict, options: ProgramOptions) -> dict | None:
    """The geometry of attn_prefill_wg where prefill attention runs on it (fa_wg_geometry, and asked for), else
    None: attn_prefill_f16 (mma.sync) runs it."""
    return fa_wg_geometry(spec.head_dim, target) if options.prefill_attention == "wgmma" else None


# --rope-in-attention's default: on for head dims up to ROPE_IN_ATTENTION_MAX_HEAD_DIM without q/k norm. Every block of
# a (sequence, kv head) repeats its group's q rope (and q norm) after its wait, while the launch it saves is ~1.5-2.6
# us whatever the shape; the repeated work grows with the attention's splits (the context) and rows. Measured on the
# H200: the SmolLM2 shape (head dim 64, no q/k norm) b1 +3.5%, b8 +2.2% (twenty-third session). The 8B shape (head dim
# 128, q/k norm) gains at short contexts and loses at long ones (thirtieth and thirty-first sessions: context 16 b1
# +1.3%, b8 +0.8%, b64 +1.2%; context 512 b1 +1.1%, b16 -1.5%, b32 +0.9%; context 2048 b1 -0.8%, b8 -5.6%), the
# 0.6B shape loses (b1 -9.5%, b8 -3.7%): off for them, --rope-in-attention chooses it.
ROPE_IN_ATTENTION_MAX_HEAD_DIM = 64


def rope_in_attention_default(spec: ModelSpec) -> bool:
    """--rope-in-attention's choice by the shape (above)."""
    return spec.head_dim <= ROPE_IN_ATTENTION_MAX_HEAD_DIM and not spec.qk_norm


def resolve_options(spec: ModelSpec, options: ProgramOptions) -> ProgramOptions:
    """options with the choices left to the shape (None) made."""
    if options.rope_in_attention is None:
        options = replace(options, rope_in_attention=rope_in_attention_default(spec))
    return options


def kernels_not_launched(spec: ModelSpec, target: dict, options: ProgramOptions) -> frozenset[str]:
    """Kernels no program of this shape, target and options launches, whatever formats the byte budget picks
    (emit leaves them out of the cubin; the program is validated against the cubin all the same)."""
    out = {"attn_prefill_f16"} if prefill_attention_wgmma(spec, target, options) else set()
    rope_in_attention = resolve_options(spec, options).rope_in_attention
    if not rope_in_attention:       # (templates/attn_decode.cu.j2 leaves both out on the first's name)
        out |= {"attn_decode_rope_f16"}
        if attn_decode_geometry(spec, target)["smem3"]:
            out.add("attn_decode_rope_f16_r3")
    if not options.prefill_qkv_epilogue and target["compute_capability"][0] == 9 and spec.head_dim in (64, 128):
        out.add("gemm_wgp_qkv_f16")     # (templates/gemm_wgmma.cu.j2: emitted with --prefill-qkv-epilogue only)
    if target["compute_capability"][0] == 9 and (rope_in_attention or not options.qkv_rope_tail):
        out.add("gemv_ring3_rope_nvfp4_nb1")    # (templates/gemv_ring.cu.j2: the qkv GEMV's rope tail, one row)
    if not (target["compute_capability"][0] == 9 and options.attn_head_ready and not rope_in_attention
            and options.qkv_rope_tail):     # (--attn-head-ready's: templates/attn_decode.cu.j2, gemv_ring.cu.j2)
        out.add("attn_decode_ready_f16")
        if attn_decode_geometry(spec, target)["smem3"]:
            out.add("attn_decode_ready_f16_r3")
        if target["compute_capability"][0] == 9:
            out.add("gemv_ring3_rope_ready_nvfp4_nb1")
    if target["compute_capability"][0] == 9:
        # (templates/gemv_ring_pair.cu.j2, by the shape: down and the next qkv, o and gate_up, at one row)
        out |= {k for k, ok in (("gemv_ring_pair_nvfp4_nb1", pair_shape(spec) and not options.pair("down-qkv")),
                                ("gemv_ring_pair_gated_nvfp4_nb1",
                                 pair_gated_shape(spec) and not options.pair("o-gate-up"))) if ok}
    if not options.norm_prologue_bf16:
        out |= {"gemv_bf16_norm_nb1", "gemv_gated_bf16_norm_nb1"}   # (templates/gemv.cu.j2: not with the option off)
    return frozenset(out)


def attn_decode_geometry(spec: ModelSpec, target: dict) -> dict:
    """The geometry attn_decode_f16 is rendered with (templates/attn_decode.cu.j2), and its blocks' shared memory:
    chunks of 4096 / head_dim keys (16..64), the warps splitting a 16-key unit's head dimension (kp), a ring stage
    a chunk's K and V rows padded by 8 elements, plus the partial scores; two stages (smem2), and on Hopper, where
    four blocks of three stages fit an SM, attn_decode_f16_r3's three (smem3; None where it is not emitted)."""
    head_dim, gqa_group = spec.head_dim, spec.n_heads // spec.n_kv_heads
    chunk = min(64, max(16, 4096 // head_dim // 16 * 16))
    units, warps, ksteps = chunk // 16, 4, head_dim // 16
    kp = warps // units if units < warps and warps % units == 0 and ksteps % (warps // units) == 0 else 1
    stage = 2 * chunk * (head_dim + 8) * 2
    scores = kp * gqa_group * (chunk + 8) * 4
    ring3 = target["compute_capability"][0] == 9 and 4 * (3 * stage + scores + 1024) <= 228 * 1024
    return {"chunk": chunk, "kp": kp, "smem2": 2 * stage + scores, "smem3": 3 * stage + scores if ring3 else None,
            "q_smem": gqa_group * head_dim * 2}     # attn_decode_rope_*: the group's q after the dynamic smem above


def fa_geometry(head_dim: int, smem_limit: int) -> tuple[int, int, int]:
    """(threads, query rows, dynamic shared memory) of a block of attn_prefill_f16 (templates/attn_prefill.cu.j2):
    4 warps of 2 row blocks of 16 (1 above head_dim 128), the Q tile and two double-buffered K and V tiles of
    64 keys (32 where that would not fit the target's shared memory)."""
    qt, ld = 4 * 16 * (2 if head_dim <= 128 else 1), head_dim + 8
    kt = 64 if (qt + 4 * 64) * ld * 2 <= smem_limit else 32
    return 128, qt, (qt * ld + 4 * kt * ld) * 2


class ProgramBuilder(LinearLaunches):
    def __init__(self, spec: ModelSpec, formats: dict[str, str], target: dict, plan: dict,
                 options: ProgramOptions, synthetic_seed: int | None = None):
        options = resolve_options(spec, options)
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
        fw = prefill_attention_wgmma(spec, target, options)
        if fw:
            self.fa_kernel, self.fa_threads, self.fa_qt, self.fa_smem = "attn_prefill_wg", fw["threads"], fw["qt"], fw["smem"]
        else:
            self.fa_kernel = "attn_prefill_f16"
            self.fa_threads, self.fa_qt, self.fa_smem = fa_geometry(spec.head_dim, target["smem_per_block_bytes"])
        self.wg_mode = t.get("prefill_weights", "none")
        if self.gemv_rows is None:
            self.gemv_rows = self.default_gemv_rows()
        self.ad = attn_decode_geometry(spec, target)
        self.kernel_smem = {self.fa_kernel: self.fa_smem, "attn_decode_f16": self.ad["smem2"]}
        if self.ad["smem3"]:
            self.kernel_smem["attn_decode_f16_r3"] = self.ad["smem3"]
        if options.rope_in_attention:
            self.kernel_smem["attn_decode_rope_f16"] = self.ad["smem2"] + self.ad["q_smem"]
            if self.ad["smem3"]:
                self.kernel_smem["attn_decode_rope_f16_r3"] = self.ad["smem3"] + self.ad["q_smem"]
        self.buffers: dict[str, Buffer] = {}
        self.cutlass_tables: dict[str, dict] = {}       # impc/cutlass.py params_table, by table_key

    # ------------------------------------------------------------------ arena

    def layout(self) -> None:
        offset = 0
        for name, kind, dtype, shape, nbytes, values in arena_entries(
                self.spec, self.formats, self.R, self.MB, self.max_seqs, self.max_pages, self.page, self.kv_pages,
                self.wg_mode, self.opt.gpu_penalties, self.opt.gemv_pair):
            self.buffers[name] = Buffer(name, offset, int(nbytes), dtype, tuple(int(x) for x in shape), kind, values)
            offset += aligned(nbytes)
        self.arena_bytes = offset
        self.rope = {v: f"rope.{j}" for j, v in enumerate(rope_variants(self.spec))}

    # ------------------------------------------------------------------ pieces of a forward pass

    def rmsnorm(self, e: _Emitter, x: str, w: str, out: str, rows, ofmt: int, x_off=0) -> None:
        h, m = self.spec.hidden, ev(rows, self.rows_max, self.MB)
        width = 4 if ofmt not in (XF_BF16, XF_F16) else 2
        e.add("rmsnorm_residual", (rows,), (256,), [ptr(x, x_off), ptr(None), ptr(w), ptr(out), i32(ofmt)],
              [(x, m * h * 4), (w, h * 4)], [(out, m * h * width)])

    def rmsnorm_add(self, e: _Emitter, t: str, w: str, rows) -> None:
        h, m = self.spec.hidden, ev(rows, self.rows_max, self.MB)
        e.add("rmsnorm_add", (rows,), (256,), [ptr(t), ptr(w), ptr("x")],
              [("t", m * h * 4), (w, h * 4), ("x", m * h * 4)], [("x", m * h * 4)])

    def embed(self, e: _Emitter, rows, host: bool = False) -> None:
        """x rows from the token ids; host (decode phases): the step's values first taken from their staging slot and
        written into the step arrays (arena_layout.py step_pack)."""
        s, m = self.spec, ev(rows, self.rows_max, self.MB)
        emb = self.lin("embed")
        row_bytes = s.hidden // 2 + s.hidden // BLOCK if emb.fmt == "nvfp4" else s.hidden * 2
        reads = [("tokens", m * 4)] + [(b, min(n, m * row_bytes)) for b, n in emb.reads()]
        kern = "embedding_gather_nvfp4" if emb.fmt == "nvfp4" else "embedding_gather"
        reads += [("token_src", m * 4), ("sampled", self.MB * 4)]     # (a row may feed any of the last step's)
        writes = [("x", m * s.hidden * 4)]
        if host:
            reads += [("host_io", 8 * HOST_IO_WORDS), ("step_pack", self.buffers["step_pack"].bytes)]
            writes += [("host_io", 8 * HOST_IO_WORDS)] + [
                (b.name, min(b.bytes, m * b.bytes // b.shape[0])) for b in self.buffers.values()
                if b.kind == "step" and b.name not in STEP_PACK_SKIP]
        io = [ptr("host_io" if host else None), ptr("step_pack")]
        e.add(kern, (rows,), (256,), [ptr("tokens"), ptr("token_src"), ptr("sampled"), *emb.weight_args(), ptr("x"), *io],
              reads, writes)

    def rope_inputs(self, i: int) -> list:
        """Layer i's arguments of qkv_rope_cache_f16 (and attn_decode_rope_*) after the qkv rows: bias, q and k norm
        weights (null where the model has none), the layer's inverse frequencies, positions, KV slots."""
        p = f"layers.{i}."
        opt = lambda name: ptr(p + name) if p + name in self.formats else ptr(None)  # noqa: E731
        return [opt("qkv_bias"), opt("q_norm"), opt("k_norm"), ptr(self.rope[self.spec.rope_for(i)]), ptr("positions"),
                ptr("kv_slots")]

    def layers(self, e: _Emitter, rows, attention, dec: bool, nb: int, split_k: bool,
               rope_in_attention: bool = False) -> None:
        """Every layer over `rows` rows of x; attention(e, i, window, ofmt, ready) fills attn from q (ready: the qkv
        launch counted each kv head in, --attn-head-ready; rope_in_attention: from the qkv rows, the q/k norm, RoPE
        and the KV append its own, without the qkv_rope launch)."""
        s, m = self.spec, ev(rows, self.rows_max, self.MB)
        def fmt(lin: _Lin) -> int:        # the activation format lin's kernel reads
            return XF_F16W if self.wq_ok(lin) else xfmt(lin.fmt) if dec else gfmt(lin.fmt)
        normed = False           # hb holds this layer's attention norm (the previous down launch's tail)
        scaled = False           # ... or x * w, its partial sums in norm_part (the previous down GEMV: ring_norm_ok)
        paired = False           # this layer's qkv (and its rope) ran in the previous down's launch (pair_ok)
        for i in range(s.n_layers):
            p = f"layers.{i}."
            qkv, o, gate_up, down = (self.lin(p + n) for n in ("qkv", "o", "gate_up", "down"))
            head_ready = False           # this layer's attention waits for the kv heads' counts (set below)
            fused = self.qkv_epilogue_ok(qkv, dec)     # q / k norm, RoPE and the KV append in the qkv GEMM
            if paired:
                fused, paired = True, False
            elif self.norm_fused(qkv, dec, nb):
                self.gemv_norm(e, p + "attn_norm", qkv, "qkv", 0, gated=False)
            else:
                if not (normed or scaled):
                    self.rmsnorm(e, "x", p + "attn_norm", "hb", rows, fmt(qkv))
                if fused:
                    self.linear_wgmma(e, "hb", qkv, "qkv", rows, 0, rope=(i, self.rope_inputs(i)))
                else:
                    # ... or in the qkv GEMV's tail (rope_tail_ok), which with --attn-head-ready counts each kv
                    # head's q, key and value in for the attention after it (attn_decode ready)
                    fused = self.linear(e, "hb", qkv, "qkv", rows, 0, dec, split_k, nb, scaled=scaled,
                                        rope=None if rope_in_attention else (i, self.rope_inputs(i)))
                    head_ready = fused and self.opt.attn_head_ready
            if not rope_in_attention and not fused:
                e.add("qkv_rope_cache_f16", (rows, -(-(s.n_heads + 2 * s.n_kv_heads) // 4)), (128,),
                      [ptr("qkv"), *self.rope_inputs(i), ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v")],
                      [("qkv", m * qkv.n * 4), ("positions", m * 4), ("kv_slots", m * 4)],
                      [("q", m * s.q_dim * 2), (f"kv.{i}.k", m * s.kv_dim * 2), (f"kv.{i}.v", m * s.kv_dim * 2)])
            window = s.sliding_window if s.kind(i) == "sliding" else 0
            attention(e, i, window, fmt(o), head_ready)
            gpaired = False          # o's launch did gate_up too (pair_gated_ok)

            def o_gemv():
                self.linear(e, "attn", o, "x", rows, 1, dec, split_k, nb, norm=p + "ffn_norm" if normed else None,
                            partial_norm=p + "ffn_norm" if scaled else None)

            def gate_up_gemv():          # the decode GEMV of gate_up (its norm a launch before unless scaled)
                if not scaled:
                    self.rmsnorm(e, "x", p + "ffn_norm", "hb", rows, fmt(gate_up))
                kern, grid, smem = self.gemv_launch(f"gemv_gated_{gate_up.fmt}_nb{nb}", gate_up, nb,
                                                    (gate_up.n // 2 + 15) // 16)
                norm_args, norm_reads, _ = self.ring_norm(kern, gate_up, m, None, scaled)
                e.add(kern, (grid,), (256,),
                      [ptr("hb"), *gate_up.weight_args(), ptr("ab"), i32(gate_up.n), i32(gate_up.k), i32(rows),
                       i32(xfmt(down.fmt)), *norm_args],
                      gate_up.reads() + [("hb", 2 * m * gate_up.k * 2)] + norm_reads,
                      [("ab", 2 * m * s.intermediate * 2)], smem=smem)
            if s.sandwich_norm:
                self.linear(e, "attn", o, "t", rows, 0, dec, split_k, nb)
                self.rmsnorm_add(e, "t", p + "post_attn_norm", rows)
                normed = scaled = False
            else:
                # the norm before gate_up in o's tail where both run gemm_wq (wq_norm_tail_ok), or as partial sums
                # where both run the ring GEMV (ring_norm_ok)
                normed = self.wq_norm_tail_ok(o, gate_up)
                scaled = self.ring_norm_ok(o, gate_up, dec, nb)
                # ... or with gate_up in its launch (--gemv-pair; its fallback: the two launches it does the work of)
                gpaired = dec and self.pair_gated_ok(o, gate_up, nb)
                if gpaired:
                    self.linear_pair_gated(e, o, gate_up, p + "ffn_norm", xfmt(down.fmt),
                                           fallback=e.take(lambda: (o_gemv(), gate_up_gemv())))
                else:
                    o_gemv()
            if gpaired:
                pass                     # (gate_up ran in o's launch)
            elif self.norm_fused(gate_up, dec, nb):
                self.gemv_norm(e, p + "ffn_norm", gate_up, "ab", xfmt(down.fmt), gated=True)
            elif dec:
                gate_up_gemv()
            elif self.wq_ok(gate_up):
                if not normed:
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
                normed = scaled = False
            else:
                # ... and the next layer's norm before qkv in down's tail
                nxt = self.lin(f"layers.{i + 1}.qkv") if i + 1 < s.n_layers else None
                normed = nxt is not None and self.wq_norm_tail_ok(down, nxt)
                scaled = nxt is not None and self.ring_norm_ok(down, nxt, dec, nb)
                # ... or with the next layer's qkv in its launch (--gemv-pair)
                paired = dec and nxt is not None and self.pair_ok(down, nxt, nb, rope_in_attention)

                def down_gemv():
                    self.linear(e, "ab", down, "x", rows, 1, dec, split_k, nb,
                                norm=f"layers.{i + 1}.attn_norm" if normed else None,
                                partial_norm=f"layers.{i + 1}.attn_norm" if scaled else None)

                def next_qkv_gemv():     # (what the next layer's turn launches unpaired: the GEMV and its rope tail)
                    tail = self.linear(e, "hb", nxt, "qkv", rows, 0, dec, split_k, nb, scaled=scaled,
                                       rope=(i + 1, self.rope_inputs(i + 1)))
                    assert scaled and tail, "pair_ok: the next qkv reads the norm's partial sums, with the rope tail"
                if paired:              # (its fallback: the two launches it does the work of)
                    self.linear_pair(e, i, down, nxt, f"layers.{i + 1}.attn_norm", self.rope_inputs(i + 1),
                                     fallback=e.take(lambda: (down_gemv(), next_qkv_gemv())))
                else:
                    down_gemv()

    def head(self, e: _Emitter, rows, dec: bool, nb: int, split_k: bool, x_off=0) -> None:
        s, m = self.spec, ev(rows, self.rows_max, self.MB)
        head = self.lin("embed" if s.tie_embeddings else "lm_head")
        if (head.fmt == "int8" and isinstance(rows, int) and not dec and rows <= GEMV_NB[-1] and x_off == 0
                and self.gemv_rows > 0):
            # a decode batch past the layers' GEMV rows: the INT8 head still on its GEMV (one pass over the codes;
            # the mma.sync GEMM expands them through shared memory for every 64 rows it does not have). Not with
            # --gemv-max-rows 0, where every decode batch runs the GEMMs: the head then too, so a row's logits do
            # not depend on the batch (the GEMV and the GEMM sum a row's products in different orders)
            dec, nb = True, next(x for x in GEMV_NB if x >= rows)
        self.rmsnorm(e, "x", "final_norm", "hb", rows, xfmt(head.fmt) if dec else gfmt(head.fmt), x_off)
        self.linear(e, "hb", head, "logits", rows, 0, dec, split_k, nb)
        if s.final_softcap:
            e.add("logits_softcap", ((s.vocab_size + 255) // 256, rows), (256,), [ptr("logits")],
                  [("logits", m * s.vocab_size * 4)], [("logits", m * s.vocab_size * 4)])

    # ------------------------------------------------------------------ phases

    def attn_splits(self, b: int) -> int:
        return max(1, min(ATTN_GRID_SPLITS, -(-2 * self.sm_count // (b * self.spec.n_kv_heads))))

    def attn_decode(self, e: _Emitter, i: int, window: int, ofmt: int, rows, splits: int, planes: bool,
                    rope: bool = False, ready: bool = False) -> None:
        """Decode attention of `rows` rows (one new token each: sequence seq_slot[r], seq_len[r] keys) from q rows
        0.. into attn rows 0..; one launch: the last block of each (sequence, kv head) merges its splits
        (templates/attn_decode.cu.j2). rope: from the qkv rows instead of q, the q/k norm, RoPE and the new key and
        value's append done in the kernel (attn_decode_rope_*, in place of qkv_rope_cache_f16). ready
        (--attn-head-ready, one row): each kv head's blocks wait for its count from qkv's rope tails (rope_count past
        the heads' tile counts) instead of the grid dependency."""
        s, b = self.spec, ev(rows, self.rows_max, self.MB)
        part = b * s.n_heads * splits * attn_partial_row(s.head_dim) * 4     # partials of `splits` splits
        counts = b * s.n_kv_heads * 4
        # one or two blocks a (sequence, kv head), each walking half the context or more: the three-stage ring
        # (32 rows: -15% attention at context 640; 8 rows, five blocks: +9%)
        ring3 = splits <= 2 and isinstance(rows, int) and self.ad["smem3"] is not None
        kernel, smem = ("attn_decode_f16_r3", self.ad["smem3"]) if ring3 else ("attn_decode_f16", self.ad["smem2"])
        assert not (ready and (rope or rows != 1)), "the kv heads' ready counts are one row's, from qkv's rope tail"
        common = [ptr("block_tables"), ptr("seq_slot"), ptr("seq_len"), ptr("partial"), ptr("attn_counts"), ptr("attn"),
                  i32(window), i32(self.max_pages), i32(ofmt)]
        reads = [("seq_slot", b * 4), ("seq_len", b * 4), ("partial", part), ("attn_counts", counts)]
        writes = [("partial", part), ("attn_counts", counts), ("attn", b * s.q_dim * (4 if planes else 2))]
        if rope:
            kernel, smem = kernel.replace("attn_decode_", "attn_decode_rope_"), smem + self.ad["q_smem"]
            args = [ptr("qkv"), *self.rope_inputs(i), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v"), *common]
            reads += [("qkv", b * (s.q_dim + 2 * s.kv_dim) * 4), ("positions", b * 4), ("kv_slots", b * 4)]
            writes += [(f"kv.{i}.k", b * s.kv_dim * 2), (f"kv.{i}.v", b * s.kv_dim * 2)]
        else:
            args = [ptr("q"), ptr(f"kv.{i}.k"), ptr(f"kv.{i}.v"), *common]
            reads += [("q", b * s.q_dim * 2)]
        if ready:       # attn_decode_ready_*: the kv heads' counts after the heads' tile counts
            kernel = kernel.replace("attn_decode_", "attn_decode_ready_")
            start, end = rope_counts(s)
            args.append(ptr("rope_count", start * 4))
            reads.append(("rope_count", end * 4))
            writes.append(("rope_count", end * 4))
            self.kernel_smem[kernel] = smem      # (only where launched: a shape whose qkv takes no rope tail has none)
        e.add(kernel, (rows, s.n_kv_heads, splits), (128,), args, reads, writes, smem=smem)

    def sample(self, e: _Emitter, rows, host: bool = False) -> None:
        """The GPU sampler over the rows' logits; with --gpu-penalties it first applies each row's penalties from its
        sequence's token counts and afterwards counts the drawn token (templates/sampler.cu.j2 sample_tokens). host
        (decode phases): the ids also into the step's mapped host slot, and the generation the step took made the device's
        last (host_io)."""
        b, v = ev(rows, self.rows_max, self.MB), self.spec.vocab_size
        reads, writes = [("logits", b * v * 4)], [("sampled", b * 4)]
        if host:
            reads.append(("host_io", 8 * HOST_IO_WORDS))
            writes.append(("host_io", 8 * HOST_IO_WORDS))
        if self.opt.gpu_penalties:
            seqs = min(b, self.max_seqs)    # (the tables' rows are sequence slots, whatever the rows)
            pen = [ptr("seq_slot"), ptr("repetition_penalty"), ptr("presence_penalty"), ptr("frequency_penalty"),
                   ptr("pen_counts"), ptr("pen_seen")]
            reads += [("pen_counts", seqs * v * 4), ("pen_seen", seqs * v // 8)]
            writes += [("logits", b * v * 4), ("pen_counts", b * 4)]
        else:
            pen = [ptr(None)] * 6
        e.add("sample_tokens", (rows,), (1024,),
              [ptr("logits"), ptr("temperature"), ptr("top_k"), ptr("top_p"), ptr("min_p"), ptr("seed"), ptr("step"),
               ptr("sampled"), *pen, ptr("host_io" if host else None)], reads, writes)

    def decode(self, b: int) -> Phase:
        dec = b <= self.gemv_rows
        # Batches past the GEMV's rows on Hopper, where the fp16 copies exist: the layer linears on the wgmma
        # GEMM, which streams the copies (3.6x the NVFP4 bytes) near the copy bandwidth; the mma.sync GEMM
        # expanding NVFP4 in registers is bound by that expansion instead (8B at 64 rows: 9.3 ms a step).
        self.rows_max, self.wg_layers = b, not dec and self.wg_mode == "copy"
        # ... and on gemm_wq, reading the NVFP4 weights as stored (a quarter of the copies' bytes), up to 64 rows
        self.wq = not dec and self.wq_rows(b)
        e = _Emitter(pdl=self.opt.pdl and self.target["compute_capability"][0] >= 9)
        nb = next((x for x in GEMV_NB if x >= b), 0)
        splits = self.attn_splits(b)
        self.embed(e, b, host=True)

        rope = self.opt.rope_in_attention

        def attention(e: _Emitter, i: int, window: int, ofmt: int, ready: bool) -> None:
            self.attn_decode(e, i, window, ofmt, b, splits, planes=dec, rope=rope, ready=ready)
            # the o projection after it without programmatic dependent launch where it runs the GEMV: with it, its
            # GEMV blocks (two an SM, up to half the register file each) sit waiting beside the attention's last,
            # merging blocks, and batches 8-16 ran 7-10% slower; without it batches 1-16 gain 1.6-3.5% on the
            # session before (BENCHMARKS, "Decode attention in one launch"). The NVFP4 decode GEMM past the GEMV's
            # rows keeps it: its weights stream in before its grid-dependency wait (BENCHMARKS, eleventh session).
            # So does one row's o (on the streamed GEMV its ring fills during the attention: b1 +2-3%, at 2-4 rows
            # -3%: BENCHMARKS, thirteenth session; on the per-block GEMV, the SmolLM2 shape, b1 +5.6%: twenty-third
            # session). On Hopper the per-block GEMV (shapes the streamed one does not take, the SmolLM2 shape) keeps
            # it at 2-16 rows too: +2.8-3.5% at 2, 4, 8 and 16 rows, where the 8B shape's streamed GEMV lost 1-3%
            # at 2-4 rows (twenty-fourth session).
            o = self.lin(f"layers.{i}.o")
            per_block = (self.target["compute_capability"][0] == 9 and dec and not self.wq_ok(o)
                         and not self.ring_ok(o, nb))
            e.no_pdl_next = b > 1 and (dec or not self.wq) and not per_block

        self.layers(e, b, attention, dec, nb, split_k=True, rope_in_attention=rope)
        self.head(e, b, dec, nb, split_k=True)
        self.sample(e, b, host=True)
        return Phase("decode", b, tuple(e.launches))

    def prefill_buckets(self) -> list[int]:
        """Row counts of the prefill phases: the chunk, and on Hopper split-K phases for one and two row tiles, and
        where the NVFP4 decode GEMM takes the layers, a phase of its rows (the largest NB) on it."""
        if self.wg_mode == "none":
            return [self.chunk]
        small = [min(WQ_NB[-1], self.chunk)] if self.wq_rows(WQ_NB[-1]) else []
        return sorted({*small, min(WG_SMALL_CHUNK, self.chunk), min(WG_MID_CHUNK, self.chunk), self.chunk})

    def wq_rows(self, rows: int) -> bool:
        """A phase of `rows` rows (a decode batch past the GEMV, a prefill chunk) runs its layer linears on gemm_wq:
        NVFP4 read as stored, a quarter of the bytes of the fp16 copies gemm_wg streams, which few rows are bound
        by (each linear still needs K a multiple of WQ_K: wq_ok)."""
        return (rows <= WQ_NB[-1] and self.wg_mode != "none" and self.opt.decode_gemm == "nvfp4"
                and self.target["compute_capability"][0] == 9 and wq_shape(self.spec))

    def prefill(self, chunk: int) -> Phase:
        """Prefill chunks, with the decode rows of other sequences riding in the same launches (a mixed step: the
        layer GEMMs read each weight once for both). Rows [0, dec) decode one token each: decode's attention, then
        the head and sampling over them at the end; rows [dec, rows) are the chunks: in the largest phase those of
        up to MAX_SEGMENTS sequences (the tile table says which rows), in the others one sequence's `prows` tokens
        at positions start.. of block-table row `slot`. A plain prefill has dec = 0: launches whose grid is then
        empty are skipped (runtime/cuda_program.py)."""
        s = self.spec
        self.rows_max, self.wg_layers, self.wq = chunk, self.wg_mode != "none", self.wq_rows(chunk)
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

        def attention(e: _Emitter, i: int, window: int, ofmt: int, ready: bool) -> None:
            assert not ready, "prefill phases take no qkv rope tail"
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
            e.add(self.fa_kernel, grid, (self.fa_threads,), args,
                  [("q", chunk * s.q_dim * 2)] + ([("fa_tiles", self.buffers["fa_tiles"].bytes)] if many else []),
                  [("attn", chunk * s.q_dim * 2)] + ([("fa_partial", part)] if split else []), smem=self.fa_smem)
            if split:
                e.add("attn_prefill_merge", (prows, s.n_heads, {"sym": "start", "ceil_div": 1 << 30}), (s.head_dim,),
                      [ptr("fa_partial"), i32(prows), i32(z), ptr("attn", after_dec), i32(ofmt)],
                      [("fa_partial", part)], [("attn", chunk * s.q_dim * 2)])

        self.layers(e, ROWS, attention, dec=False, nb=0, split_k=self.opt.prefill_split_k)
        self.wg_layers = False
        # the head and the sampler over the decode rows and, gathered after them, the last row of each chunk that
        # ends its prompt (`schunks` of them, srows = dec + schunks): its first token is sampled here with the
        # decode rows' tokens, and its logits need not come to the host
        h = s.hidden
        e.add("gather_rows_f32", ({"sym": "schunks", "ceil_div": 1 << 30},), (256,),
              [ptr("x"), ptr("chunk_last"), i32({"sym": "dec"}), i32({"sym": "schunks"})],
              [("x", chunk * h * 4), ("chunk_last", MAX_SEGMENTS * 4)], [("x", self.MB * h * 4)])
        srows = {"sym": "srows"}
        self.head(e, srows, dec=False, nb=0, split_k=False)
        self.sample(e, srows)
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
        for name in ("wg_flags", "norm_count", "rope_count", "pair_bar"):   # split-K turn flags, the norm tail's,
            # the rope tail's and the pair GEMV's barrier counts start at 0
            if name in self.buffers:
                n = self.buffers[name].shape[0]
                e.add("fill_f32", (1,), (256,), [ptr(name), {"u64": n}, {"f32": 0.0}], [], [(name, n * 4)])
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
            elif fmt == "int8":
                n, k = shape       # codes uniform over the bytes (rms 73.9); rows of rms 1/sqrt(k) as the bf16 head's
                e.add("fill_random_bytes", grid, block, [ptr(name + ".codes"), {"u64": n * k}, {"u64": tseed},
                                                         {"u32": 0xFF}, {"u32": 0}], [], [(name + ".codes", n * k)])
                e.add("fill_f32", grid, block, [ptr(name + ".rscale"), {"u64": n}, {"f32": 1.0 / (73.9 * math.sqrt(k))}],
                      [], [(name + ".rscale", n * 4)])
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
        if self.cutlass_tables:
            consts["cutlass"] = self.cutlass_tables
        symbols = {"rows": self.R, "start": self.max_context - 1, "slot": self.max_seqs - 1, "row0": self.R - 1,
                   "dec": self.max_batch, "prows": self.R, "qtiles": max_tiles(self.R),
                   "srows": self.max_batch, "schunks": MAX_SEGMENTS}
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
