"""scripts/sass_loop.py's SASS reading: a hand-written listing with two nested loops, the
HMMA inside the inner one, counted by hand."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import sass_loop  # noqa: E402

LISTING = """
	code for sm_90a
		Function : k_one
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                                     /* 0x0000000000007919 */
        /*0020*/                   LDS.128 R4, [R0] ;                                     /* 0x0000000000047984 */
        /*0030*/                   LOP3.LUT R8, R4, 0xf, RZ, 0xc0, !PT ;                  /* 0x0000000f04087812 */
        /*0040*/                   PRMT R9, R8, 0x1404, RZ ;                              /* 0x0000140408097816 */
        /*0050*/                   HMMA.16816.F32 R12, R8, R10, R12 ;                     /* 0x0000000a080c723c */
        /*0060*/              @!P0 LOP3.LUT R8, R5, 0xf, RZ, 0xc0, !PT ;                  /* 0x0000000f05088812 */
        /*0070*/                   HMMA.16816.F32 R12, R8, R10, R12 ;                     /* 0x0000000a080c723c */
        /*0080*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;                      /* 0x000000ff0000720c */
        /*0090*/               @P0 BRA 0x20 ;                                             /* 0xfffffff800000947 */
        /*00a0*/                   IADD3 R0, R0, 0x1, RZ ;                                /* 0x0000000100007810 */
        /*00b0*/               @P1 BRA 0x10 ;                                             /* 0xfffffff800000947 */
        /*00c0*/                   EXIT ;                                                 /* 0x000000000000794d */
		Function : k_two
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                 /* 0x00000a0000017a02 */
        /*0010*/                   EXIT ;                                                 /* 0x000000000000794d */
"""


def test_opcodes_drop_predicates_and_modifiers():
    assert sass_loop.opcode("@!P0 LOP3.LUT R8, R5, 0xf, RZ, 0xc0, !PT") == "LOP3"
    assert sass_loop.opcode("HMMA.16816.F32 R12, R8, R10, R12") == "HMMA"


def test_inner_loop_is_the_shortest_span_around_the_op():
    first = sass_loop.instructions(LISTING.split("Function : k_two")[0])
    assert len(first) == 13
    body = sass_loop.inner_loop(first, "HMMA")
    # 0x20 .. the branch at 0x90 (the outer loop's back branch at 0xb0 to 0x10 is longer)
    assert [a for a, _ in body] == [0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90]
    ops = [sass_loop.opcode(t) for _, t in body]
    assert ops.count("LOP3") == 2 and ops.count("HMMA") == 2 and ops.count("PRMT") == 1
    with pytest.raises(ValueError):
        sass_loop.inner_loop(first, "HGMMA")


def test_functions_compare_without_addresses_or_encodings():
    f = sass_loop.functions(LISTING)
    assert set(f) == {"k_one", "k_two"}
    moved = LISTING.replace("/*0000*/", "/*1000*/").replace("0x00000a0000017a02", "0x1234567812345678")
    assert sass_loop.functions(moved) == f
    changed = LISTING.replace("PRMT R9, R8, 0x1404, RZ", "PRMT R9, R8, 0x3424, RZ")
    g = sass_loop.functions(changed)
    assert g["k_two"] == f["k_two"] and g["k_one"] != f["k_one"]


WAIT_LISTING = """
		Function : k_wait
        /*0000*/                   LDG.E.128.STRONG.GPU R4, desc[UR4][R2.64] ;            /* 0x0000000000047981 */
        /*0010*/                   LDG.E.CONSTANT R8, desc[UR4][R6.64] ;                  /* 0x0000000000087981 */
        /*0020*/                   ACQBULK ;                                              /* 0x00000000000079b8 */
        /*0030*/              @!P0 LDG.E.STRONG.GPU R9, desc[UR4][R2.64+0x10] ;           /* 0x0000000000097981 */
        /*0040*/                   LDG.E.128.CONSTANT R12, desc[UR4][R10.64] ;            /* 0x00000000000c7981 */
        /*0050*/                   LDS.128 R16, [R0] ;                                    /* 0x0000000000107984 */
        /*0060*/                   EXIT ;                                                 /* 0x000000000000794d */
"""


def test_wait_split_counts_loads_on_each_side_of_the_wait():
    before, after = sass_loop.wait_split(sass_loop.instructions(WAIT_LISTING))
    assert len(before) == 2 and len(after) == 2                 # (the LDS is not a global load)
    assert [sass_loop.strong(t) for t in before] == [True, False]
    assert [sass_loop.strong(t) for t in after] == [True, False]
    none_before, all_after = sass_loop.wait_split(sass_loop.instructions(WAIT_LISTING.replace("ACQBULK", "NOP")))
    assert none_before == [] and len(all_after) == 4


def test_early_loads_stay_ahead_of_the_wait(checkpoints, tmp_path):
    """The loads the kernels issue before pdl_wait (templates/prelude.cuh.j2 ld_early_*: strong, which ptxas does not
    move past griddepcontrol.wait as it did the read-only ones) are ahead of the wait in the compiled SASS, and none
    after it, in the kernels that take them only there: the gated GEMV with the norm in its prologue (per lane four
    chunks of two 16-byte code loads and two scale loads, the tensor scale, the norm weights: 17 + ceil(HIDDEN / 256)),
    the norm (its weights), the sampler (its seven per-row parameters) and the q/k norm + RoPE kernel (the token's
    position and slot, and per lane pair of its head two bias values, two norm weights and one inverse frequency:
    prelude rope_consts). Counted from the templates' source."""
    import json

    from impc.compile import CompileOptions, compile_model
    from impc.emit import nvcc_path
    from impc.errors import CompileError
    try:
        nvcc_path()
        sass_loop.cuobjdump()
    except (CompileError, SystemExit) as e:
        pytest.skip(str(e))
    out = tmp_path / "qwen3"
    compile_model(CompileOptions(model=str(checkpoints("qwen3")), out=out, targets="sm_90a", vram_gib=2,
                                 max_context=256, max_batch=16, calibrate=False))
    model = json.loads((out / "manifest.json").read_text())["model"]
    hidden, rope_pairs = model["hidden"], -(-model["head_dim"] // 64)
    assert model["qk_norm"]
    cubin = str(out / "kernels" / "sm_90a.cubin")
    try:
        listing = sass_loop.sass(cubin, "rmsnorm_residual")
    except SystemExit as e:          # cuobjdump without its nvdisasm
        pytest.skip(str(e))
    per_thread = -(-hidden // 256)
    for kernel, want in (("gemv_gated_nvfp4_norm_nb1", 17 + per_thread), ("rmsnorm_residual", per_thread),
                         ("sample_tokens", 7), ("qkv_rope_cache_f16", 2 + 5 * rope_pairs)):
        before, after = sass_loop.wait_split(sass_loop.instructions(
            listing if kernel == "rmsnorm_residual" else sass_loop.sass(cubin, kernel)))
        assert sum(map(sass_loop.strong, before)) == want, (kernel, before)
        assert not any(map(sass_loop.strong, after)), (kernel, after)


def test_cubin_pairs_match_two_trees_by_relative_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root, names in ((a, ["x/kernels/sm_90a.cubin", "y/kernels/sm_90a.cubin", "y/kernels/sm_80.cubin"]),
                        (b, ["x/kernels/sm_90a.cubin", "y/kernels/sm_90a.cubin", "z/kernels/sm_90a.cubin"])):
        for n in names:
            (root / n).parent.mkdir(parents=True, exist_ok=True)
            (root / n).write_bytes(b"")
    (a / "x" / "manifest.json").write_text("{}")
    both, one = sass_loop.cubin_pairs(a, b)
    assert both == ["x/kernels/sm_90a.cubin", "y/kernels/sm_90a.cubin"]
    assert one == ["y/kernels/sm_80.cubin", "z/kernels/sm_90a.cubin"]


@pytest.mark.parametrize("shape", ["qwen3-8b", "llama-3.1-8b"])
def test_one_row_streamed_gemvs_load_their_scale_ahead_of_their_copies(shape, tmp_path):
    """The 8B shapes' one-row streamed GEMVs (and --gemv-pair's), as compiled (sm_90a): each issues a strong load (its tensor scale,
    templates/gemv_ring.cu.j2) before its first weight copy and its grid-dependency wait, and no strong load between
    the two. As a plain load, ptxas had
    moved o's past the wait (its first use ahead of the stage loop: a DRAM round trip after the wait) and the others'
    among or behind their copies (BENCHMARKS.md, thirty-eighth session). Needs nvcc and cuobjdump (the project's
    wheels)."""
    import shutil
    try:
        from tests.test_templates_compile import SHAPES, _nvcc, default_formats
    except ImportError:
        from test_templates_compile import SHAPES, _nvcc, default_formats

    from impc.cubin import kernel_symbols
    from impc.emit import compile_cubin, render
    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    nv, ver = _nvcc()
    try:
        sass_loop.cuobjdump()
    except SystemExit:
        pytest.skip("cuobjdump not found")
    if not shutil.which("nvdisasm") and not any(Path(sass_loop.cuobjdump()).parent.glob("nvdisasm*")):
        pytest.skip("nvdisasm not found")
    t, spec = load_target("sm_90a"), SHAPES[shape]
    cubin, _ = compile_cubin(render(spec, t, {}), t, nv, ver)
    formats = default_formats(spec)
    symbols = kernel_symbols(cubin)
    prog = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64), ProgramOptions(), symbols)
    ring = sorted({x.kernel for x in prog.phase("decode", 1).launches if x.kernel.startswith("gemv_ring")})
    assert len(ring) == 4, ring                  # qkv (with the rope tail), o, gate_up, down
    pair = ["gemv_ring_pair_nvfp4_nb1", "gemv_ring_pair_gated_nvfp4_nb1"]    # --gemv-pair's (the same loads)
    assert set(pair) <= symbols
    ring += pair
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    for k in ring:
        ins = sass_loop.instructions(sass_loop.sass(str(path), k))
        f = sass_loop.first_positions(ins)
        assert None not in f.values(), (k, f)
        assert f["strong"] < f["copy"] and f["strong"] < f["wait"], (k, f)
        # and every strong load before the wait ahead of the copies: qkv's rope-tail constants too (thirty-seventh
        # session: issued after the copies, they queued behind them and warp 0 passed its wait late)
        late = [t for i, (_, t) in enumerate(ins) if f["copy"] < i < f["wait"]
                and sass_loop.opcode(t) == "LDG" and sass_loop.strong(t)]
        assert not late, (k, late)
