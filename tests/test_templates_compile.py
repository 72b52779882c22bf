"""CI (no GPU): every template renders and compiles for every target, for several model shapes; the
cubin's symbol table holds exactly the kernels listed here, and the launch program built for the shape
passes validation against that cubin (every kernel it launches present, every reference in bounds)."""
from __future__ import annotations

import pytest

from imp_runtime.spec import ModelSpec, RopeScaling

EXPECTED = ["embedding_gather", "embedding_gather_nvfp4", "gather_rows_f32", "rmsnorm_residual", "rmsnorm_add",
            "gemm_bf16", "logits_softcap", "sample_tokens", "fill_random_bytes", "fill_f32", "fill_random_bf16",
            "act_gated_x", "qkv_rope_cache_f16", "attn_decode_f16", "attn_prefill_f16", "attn_prefill_merge", "gemm_nvfp4_f16",
            "attn_decode_rope_f16",                                 # --rope-in-attention
            "attn_decode_ready_f16",                                # --attn-head-ready
            *[f"gemv_{g}{f}_nb{n}" for g in ("", "gated_") for f in ("nvfp4", "bf16") for n in (1, 2, 4, 8, 16)],
            "gemv_nvfp4_norm_nb1", "gemv_gated_nvfp4_norm_nb1",     # batch 1 with RMSNorm fused (hidden <= 8192)
            "gemv_bf16_norm_nb1", "gemv_gated_bf16_norm_nb1",       # ... bf16 weights too
            *[f"gemv_int8_nb{n}" for n in (1, 2, 4, 8, 16)], "gemm_int8_f16"]   # --head-format int8
# Hopper only (templates/gemm_wgmma.cu.j2): the TMA + wgmma prefill GEMM and the NVFP4 expansion it reads
EXPECTED_SM90 = ["dequant_nvfp4_f16", *[f"gemm_wg{n}_{t}" for n in (64, 128, 256) for t in ("f16", "bf16")],
                 "gemm_wgp_f16", "gemm_wgp_bf16", "attn_decode_f16_r3", "attn_decode_rope_f16_r3",
                 *[f"gemm_wq{n}" for n in (16, 32, 64)],
                 *[f"gemv_ring_{g}nvfp4_nb{n}" for g in ("", "gated_") for n in (1, 2, 4, 8)],
                 *[f"gemv_ring3_nvfp4_nb{n}" for n in (1, 2, 4)],     # the streamed GEMV
                 "gemv_ring3_rope_nvfp4_nb1",                           # ... with qkv_rope's work in its tail
                 "gemv_ring3_rope_ready_nvfp4_nb1", "attn_decode_ready_f16_r3",   # (--attn-head-ready)
                 "gemv_ringx_nvfp4_nb1", "gemv_ringx_gated_nvfp4_nb1", "gemv_ringx3_nvfp4_nb1",   # ... its staged x
                 "gemv_ringxr_gated_nvfp4_nb1"]      # ... its stage loop unrolled (one row's gate_up by default)

SHAPES = {
    "tiny-llama": ModelSpec(family="llama", vocab_size=384, hidden=64, n_layers=3, n_heads=4, n_kv_heads=2,
                            head_dim=16, intermediate=160, norm_eps=1e-5, rope_theta=5e4, max_position=512,
                            rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position=64)),
    "gemma3-hd256": ModelSpec(family="gemma3", vocab_size=32000, hidden=1152, n_layers=2, n_heads=4, n_kv_heads=1,
                              head_dim=256, intermediate=6912, norm_eps=1e-6, rope_theta=1e6, max_position=32768,
                              qk_norm=True, sandwich_norm=True, activation="gelu_tanh", embed_scale=33.9,
                              attn_scale=0.0625, sliding_window=512, layer_kinds=("sliding", "full"),
                              rope_theta_local=1e4, final_softcap=30.0),
    "qwen3-8b": ModelSpec(family="qwen3", vocab_size=151936, hidden=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                          head_dim=128, intermediate=12288, norm_eps=1e-6, rope_theta=1e6, max_position=40960,
                          qk_norm=True),
    # Llama-3.1-8B's layers: down's K 14,336 (the one-row unrolled down and --gemv-pair's first GEMV at 7 stages a warp)
    "llama-3.1-8b": ModelSpec(family="llama", vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              head_dim=128, intermediate=14336, norm_eps=1e-5, rope_theta=5e5, max_position=131072,
                              rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position=8192)),
}


def default_formats(spec: ModelSpec) -> dict[str, str]:
    """NVFP4 layer and head matrices, a bf16 embedding, float32 norms: the formats a default compile gives."""
    return {n: ("nvfp4" if len(s) == 2 and n != "embed" else "bf16" if len(s) == 2 else "f32")
            for n, s in spec.tensor_shapes().items()}


def _nvcc():
    from impc.errors import CompileError
    from impc.emit import nvcc_path, nvcc_version
    try:
        nv = nvcc_path()
    except CompileError as e:
        pytest.skip(str(e))
    return nv, nvcc_version(nv)


@pytest.mark.parametrize("target", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_templates_compile(shape, target):
    from impc.cubin import kernel_symbols
    from impc.emit import compile_cubin, render
    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    nv, ver = _nvcc()
    t = load_target(target)
    spec = SHAPES[shape]
    src = render(spec, t, {})
    cubin, _cached = compile_cubin(src, t, nv, ver)
    symbols = kernel_symbols(cubin)
    from impc.launch_linear import SMALL_HEAD_K, wq_shape
    sm90 = {k for k in EXPECTED_SM90 if wq_shape(spec) or not k.startswith("gemm_wq")}
    if spec.head_dim % 64 == 0:         # the wgmma prefill attention (templates/attn_prefill_wgmma.cu.j2)
        sm90.add("attn_prefill_wg")
    qkv_epilogue = {"gemm_wgp_qkv_f16"} if spec.head_dim in (64, 128) and target == "sm_90a" else set()
    sm90 |= qkv_epilogue                # (the qkv GEMM with q / k norm, RoPE and the KV append: heads of 64 / 128)
    bf16w = {"gemv_bf16w_nb1"} if spec.hidden <= SMALL_HEAD_K else set()   # a bf16 head of small K at one row
    if spec.intermediate % 2048 == 0 and 3 <= spec.intermediate // 2048 <= 8:
        sm90.add("gemv_ringxr_nvfp4_nb1")   # one-row down's loop unrolled over its tile's stages (the 8B shape's)
    from impc.launch_linear import pair_gated_shape, pair_shape
    pair = ({"gemv_ring_pair_nvfp4_nb1"} if pair_shape(spec) else set()) | (
        {"gemv_ring_pair_gated_nvfp4_nb1"} if pair_gated_shape(spec) else set())
    pair = pair if target == "sm_90a" else set()
    sm90 |= pair                            # two one-row GEMVs in one launch (--gemv-pair)
    assert symbols == set(EXPECTED) | bf16w | (sm90 if target == "sm_90a" else set())
    formats = default_formats(spec)
    plan = plan_memory(spec, formats, [t], None, min(4096, spec.max_position), 64)
    prog = build_program(spec, formats, t, plan, ProgramOptions(), symbols)
    launched = {x.kernel for ph in prog.phases for x in ph.launches}
    assert launched <= symbols
    # a bf16 qkv and gate_up (as a byte budget may keep them: their norm in the GEMV's prologue): validates too
    mixed = {**formats, "layers.0.qkv": "bf16", "layers.0.gate_up": "bf16"}
    build_program(spec, mixed, t, plan_memory(spec, mixed, [t], None, min(4096, spec.max_position), 64),
                  ProgramOptions(), symbols)
    # what a compile leaves out of the cubin (impc/emit.py omit) is never launched, and its template drops it
    from impc.launches import kernels_not_launched
    omit = kernels_not_launched(spec, t, ProgramOptions())
    assert not launched & omit
    from impc.launches import resolve_options
    rope = {"attn_decode_rope_f16"} | ({"attn_decode_rope_f16_r3"} if target == "sm_90a" else set())
    if resolve_options(spec, ProgramOptions()).rope_in_attention:      # (the default for tiny-llama's shape)
        assert rope <= launched | {"attn_decode_rope_f16_r3"}
        rope = {"gemv_ring3_rope_nvfp4_nb1"} if target == "sm_90a" else set()   # (the qkv GEMV's rope tail)
    unpaired = set() if ProgramOptions().gemv_pair else pair        # (--gemv-pair's kernels left out without it)
    ready = {"attn_decode_ready_f16"} | (          # (--attn-head-ready's kernels left out without it)
        {"attn_decode_ready_f16_r3", "gemv_ring3_rope_ready_nvfp4_nb1"} if target == "sm_90a" else set())
    assert omit == ({"attn_prefill_f16"} if "attn_prefill_wg" in launched else set()) | rope | qkv_epilogue | unpaired \
        | ready
    pruned = render(spec, t, {}, omit)
    assert all(f"\n{k}(" not in pruned and f"\n{k}(" in src for k in omit)
    # Hopper prefill runs its layer GEMMs on wgmma (from fp16 copies expanded at load), nothing else does (the
    # output head of a mixed step's decode rows, at the phase's end, reads the head as stored)
    prefill = {x.kernel for x in prog.phase("prefill", prog.constants["prefill_chunk"]).launches
               if any(b.startswith("layers.") for b, _ in x.reads)}
    attn = {x.kernel for x in prog.phase("prefill", prog.constants["prefill_chunk"]).launches
            if x.kernel.startswith("attn_prefill_") and x.kernel != "attn_prefill_merge"}
    assert attn == {"attn_prefill_wg" if target == "sm_90a" and spec.head_dim % 64 == 0 else "attn_prefill_f16"}
    if target == "sm_90a":
        assert any(k.startswith("gemm_wg") for k in prefill) and "gemm_nvfp4_f16" not in prefill
        assert "dequant_nvfp4_f16" in {x.kernel for x in prog.phase("init", 0).launches}
        # decode batches past the GEMV read NVFP4 as stored where K allows (a multiple of 256), never the copies
        for ph in prog.phases:
            if ph.phase == "decode" and ph.tokens > prog.options["gemv_max_rows"]:
                lin = {x.kernel for x in ph.launches if any(b.startswith("layers.") and b.endswith(".codes")
                                                              for b, _ in x.reads)}
                wide = all(shp[1] % 256 == 0 for n, shp in spec.tensor_shapes().items() if n.startswith("layers.")
                           and len(shp) == 2 and formats[n] == "nvfp4")
                if wide:
                    assert lin == {f"gemm_wq{next(n for n in (16, 32, 64) if n >= ph.tokens)}"}, lin
                    assert not any(b.endswith(".f16") for x in ph.launches for b, _ in x.reads)
    else:
        assert not any(k.startswith(("gemm_wg", "gemm_wq")) for k in launched)


def test_prefill_attention_option():
    """--prefill-attention: on Hopper the wgmma kernel for head dims that are multiples of 64 (up to 256), with its
    own block geometry (2 warpgroups, 128 query rows) in the launches and the program's query tile; `mma` (and any
    other head dim or target) the mma.sync kernel. The runtime cuts the tile table by the program's query tile."""
    from impc.launches import ProgramOptions, build_program, fa_geometry, fa_wg_geometry
    from impc.plan import plan_memory
    from impc.targets import load_target
    h, b = load_target("sm_90a"), load_target("sm_120a")
    assert fa_wg_geometry(128, b) is None and fa_wg_geometry(80, h) is None and fa_wg_geometry(320, h) is None
    assert fa_wg_geometry(64, h)["kt"] == 128 and fa_wg_geometry(256, h)["kt"] == 64
    spec = SHAPES["qwen3-8b"]
    formats = default_formats(spec)
    plan = plan_memory(spec, formats, [h], None, 4096, 64)
    for option, kernel in (("wgmma", "attn_prefill_wg"), ("mma", "attn_prefill_f16")):
        prog = build_program(spec, formats, h, plan, ProgramOptions(prefill_attention=option), None)
        threads, qt, smem = ((256, 128, fa_wg_geometry(spec.head_dim, h)["smem"]) if option == "wgmma" else
                             fa_geometry(spec.head_dim, h["smem_per_block_bytes"]))
        attn = [x for ph in prog.phases if ph.phase == "prefill" for x in ph.launches if x.kernel.startswith("attn_prefill_")
                and x.kernel != "attn_prefill_merge"]
        assert attn and {x.kernel for x in attn} == {kernel}
        assert all(x.block[0] == threads and x.smem == smem for x in attn)
        assert prog.constants["fa_query_tile"] == qt and prog.kernel_smem[kernel] == smem
        assert prog.options["prefill_attention"] == option
        from impc.launches import kernels_not_launched
        assert kernels_not_launched(spec, h, ProgramOptions(prefill_attention=option, rope_in_attention=False,
                                                            gemv_pair=False)) == (
            {"attn_prefill_f16"} if option == "wgmma" else set()) | {"attn_decode_rope_f16", "attn_decode_rope_f16_r3"} | (
            {"gemm_wgp_qkv_f16"} if spec.head_dim in (64, 128) else set()) | {
            "gemv_ring_pair_nvfp4_nb1", "gemv_ring_pair_gated_nvfp4_nb1"} | {   # (--gemv-pair's)
            "attn_decode_ready_f16", "attn_decode_ready_f16_r3", "gemv_ring3_rope_ready_nvfp4_nb1"}   # (--attn-head-ready's)


def test_gpu_penalties_program():
    """--gpu-penalties (the default): each sampling launch (every decode bucket, every prefill phase's decode rows)
    (sample_tokens: every decode bucket, every prefill phase's decode rows) gets the penalty arguments: the rows'
    sequence slots and penalty values and the per-slot state tables, planned into the arena (and counted by the plan);
    without it (--no-gpu-penalties), the tables do not exist and those six arguments are null."""
    from impc.arena_layout import penalty_tables
    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    spec, t = SHAPES["tiny-llama"], load_target("sm_90a")
    formats = default_formats(spec)
    names = ("pen_counts", "pen_seen", "repetition_penalty", "presence_penalty", "frequency_penalty")
    plain = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 512, 64, gpu_penalties=False),
                          ProgramOptions(gpu_penalties=False), None)
    assert not any(n in plain.buffers for n in names)
    samplers = [x for ph in plain.phases for x in ph.launches if x.kernel == "sample_tokens"]
    assert samplers and all(x.args[8:14] == ({"ptr": None},) * 6 for x in samplers)
    plan = plan_memory(spec, formats, [t], None, 512, 64)
    prog = build_program(spec, formats, t, plan, ProgramOptions(), None)
    assert all(n in prog.buffers for n in names)
    tables = penalty_tables(spec, prog.constants["max_seqs"])
    assert prog.buffers["pen_counts"].bytes == tables["pen_counts"][2] == prog.constants["max_seqs"] * spec.vocab_size * 4
    # the plan counted them: the KV pool shrinks by at least their bytes
    assert plan["targets"]["sm_90a"]["kv_pages"] < plain.constants["kv_pages"]
    for ph in prog.phases:
        ks = [x.kernel for x in ph.launches]
        if "sample_tokens" not in ks:
            continue
        x = ph.launches[ks.index("sample_tokens")]
        assert [a["ptr"] for a in x.args[8:14]] == ["seq_slot", *names[2:], "pen_counts", "pen_seen"], (ph.phase, ph.tokens)
        assert {"pen_counts", "pen_seen"} <= {b for b, _ in x.reads} and "pen_counts" in {b for b, _ in x.writes}
