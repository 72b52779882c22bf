"""The launch program (impc/launches.py -> runtime/program.py), without a GPU: its validation refuses a
broken program at compile time and at load with one line; `impc inspect --program` counts launches and
bytes that agree with a hand count from the model's dimensions; bundles do not depend on the output
folder's name; and a non-editable install of the package compiles (templates and targets are package data)."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from impc.compile import CompileOptions, compile_model
from imp_runtime.bundle import BundleError, load_bundle, sha256_file
from imp_runtime.program import ProgramError, dumps, loads, validate

ROOT = Path(__file__).resolve().parent.parent


def impc(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "impc.cli", *args], capture_output=True, text=True, timeout=900, **kw)


@pytest.fixture(scope="module")
def gpu_bundle_dir(checkpoints, tmp_path_factory):
    """A tiny qwen3 bundle with an sm_90a program (needs the nvcc wheels, as `make test` installs)."""
    from impc.emit import nvcc_path
    from impc.errors import CompileError
    try:
        nvcc_path()
    except CompileError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("prog") / "qwen3"
    compile_model(CompileOptions(model=str(checkpoints("qwen3")), out=out, targets="sm_90a", vram_gib=2,
                                 max_context=256, max_batch=16, calibrate=False))
    return out


def program_of(path: Path):
    return load_bundle(path).program("sm_90a")


def kernels_of(path: Path) -> set[str]:
    return set(load_bundle(path).manifest["kernels"]["functions"]["sm_90a"])


def broken(prog, how: str):
    """A copy of the program with one defect."""
    d = json.loads(dumps(prog))
    bufs = d["buffers"]
    ph = next(p for p in d["phases"] if p["phase"] == "decode")
    if how == "outside":
        bufs[-1]["offset"] = d["arena_bytes"]
    elif how == "overlap":
        bufs[1]["offset"] = bufs[0]["offset"]
    elif how == "kernel":
        ph["launches"][0]["kernel"] = "no_such_kernel"
    elif how == "buffer":
        ph["launches"][1]["args"][0] = {"ptr": "no_such_buffer"}
    elif how == "offset":
        ph["launches"][1]["args"][0] = {"ptr": "x", "offset": 1 << 40}
    elif how == "symbol":
        ph["launches"][1]["args"][-1] = {"i32": {"sym": "rows"}}
    elif how == "grid":
        ph["launches"][1]["grid"] = [0, 1, 1]
    elif how == "reads":
        ph["launches"][1]["reads"] = [["x", 1 << 40]]
    return d


DEFECTS = ["outside", "overlap", "kernel", "buffer", "offset", "symbol", "grid", "reads"]


@pytest.mark.parametrize("how", DEFECTS)
def test_validation_refuses_each_defect(gpu_bundle_dir, how):
    prog = program_of(gpu_bundle_dir)
    validate(prog, kernels_of(gpu_bundle_dir))                  # the compiled one passes
    with pytest.raises(ProgramError) as e:
        validate(loads(json.dumps(broken(prog, how))), kernels_of(gpu_bundle_dir))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("how", ["kernel", "offset", "truncated"])
def test_load_refuses_a_broken_program(gpu_bundle_dir, tmp_path, how):
    """A program that fails validation (its hash updated, so only validation can catch it) is a one-line
    error at load, from the library and from the CLI."""
    import shutil
    dst = tmp_path / "b"
    shutil.copytree(gpu_bundle_dir, dst)
    rel = "program/sm_90a.json"
    text = dumps(program_of(dst))
    (dst / rel).write_text(text[:len(text) // 2] if how == "truncated" else json.dumps(broken(program_of(dst), how)))
    m = json.loads((dst / "manifest.json").read_text())
    m["files"][rel] = sha256_file(dst / rel)
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="launch program refused"):
        load_bundle(dst)
    r = impc("inspect", str(dst), "--program")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "launch program refused" in r.stderr


def test_compile_refuses_a_program_that_fails_validation(checkpoints, tmp_path, monkeypatch, gpu_bundle_dir):
    from impc import launches
    from impc.errors import CompileError
    real = launches.ProgramBuilder.prefill

    def bad_prefill(self, chunk):
        ph = real(self, chunk)
        x = ph.launches[0]
        return replace(ph, launches=(replace(x, args=({"ptr": "nowhere"},) + x.args[1:]),) + ph.launches[1:])

    monkeypatch.setattr(launches.ProgramBuilder, "prefill", bad_prefill)
    out = tmp_path / "never"
    with pytest.raises(CompileError, match="failed validation.*nowhere"):
        compile_model(CompileOptions(model=str(checkpoints("qwen3")), out=out, targets="sm_90a", vram_gib=2,
                                     max_context=256, max_batch=16, calibrate=False))
    assert not out.exists()


def test_inspect_program_counts(gpu_bundle_dir):
    """Launch counts and weight bytes of a decode step, against a hand count from the dimensions."""
    b = load_bundle(gpu_bundle_dir)
    s = b.spec
    r = impc("inspect", str(gpu_bundle_dir), "--program", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert {(k["phase"], k["tokens"]) for k in d["buckets"]} == \
        {("decode", n) for n in (1, 2, 4, 8, 16)} | {("prefill", b.manifest["plan"]["targets"]["sm_90a"]["prefill_chunk"]),
                                                    ("prefill", 128)}   # Hopper: the split-K phase of one row tile
    dec1 = next(k for k in d["buckets"] if k["phase"] == "decode" and k["tokens"] == 1)
    # embed; per layer qkv (its RMSNorm fused at batch 1), rope+cache (unless the attention does it: the default
    # for head dims up to 64 without q/k norm), attention (its split merge fused), o, gate_up (+norm, +act), down; head norm, head, sample
    # (the GPU penalties, the default, inside the sampler's launch)
    opts = program_of(gpu_bundle_dir).options
    pen = 0
    assert opts["rope_in_attention"] == (s.head_dim <= 64 and not s.qk_norm
                                         or s.hidden * (s.q_dim + 2 * s.kv_dim) // 2 >= 8 << 20)
    per_layer = 5 if opts["rope_in_attention"] else 6
    assert len(dec1["launches"]) == 1 + per_layer * s.n_layers + 3 + pen
    assert all(set(x) == {"kernel", "grid", "block", "smem", "reads", "writes"} for x in dec1["launches"])
    # the GEMVs read each layer's NVFP4 weights once: codes K/2 + scales K/16 bytes per row, 4 for tscale
    lin = sum(n * k // 2 + n * k // 16 + 4 for n, k in s.linear_shapes().values()) * s.n_layers
    gemv_reads = sum(x["reads"] for x in dec1["launches"] if x["kernel"].startswith("gemv_nvfp4") or
                     x["kernel"].startswith("gemv_gated_nvfp4"))
    # o and down read x planes (2 x fp16 per k); qkv and gate_up the float32 residual row and the norm weight
    acts = sum(4 * k if name in ("o", "down") else 8 * s.hidden for name, (_, k) in s.linear_shapes().items()) * s.n_layers
    resid = s.hidden * 4 * 2 * s.n_layers                                           # o and down add into x
    assert gemv_reads == lin + acts + resid
    text = impc("inspect", str(gpu_bundle_dir), "--program").stdout
    assert f"decode 1: {len(dec1['launches'])} launches" in text


def test_bundle_does_not_depend_on_the_output_folder(checkpoints, tmp_path, gpu_bundle_dir):
    ck = str(checkpoints("qwen3"))
    a, b = tmp_path / "one", tmp_path / "elsewhere" / "two"
    for out in (a, b):
        compile_model(CompileOptions(model=ck, out=out, targets="sm_90a", vram_gib=2, max_context=256,
                                     max_batch=16, calibrate=False))
    fa = {str(p.relative_to(a)): p.read_bytes() for p in a.rglob("*") if p.is_file()}
    fb = {str(p.relative_to(b)): p.read_bytes() for p in b.rglob("*") if p.is_file()}
    assert fa.keys() == fb.keys() and "program/sm_90a.json" in fa
    assert fa == fb
    assert json.loads(fa["manifest.json"])["name"] == Path(ck).name


@pytest.mark.slow
def test_non_editable_install_compiles(tmp_path, gpu_bundle_dir):
    """`pip install .` (not editable) gives an impc whose templates and targets come with the package: it
    compiles SmolLM2 for sm_90a from a folder with no source tree in sight."""
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (site / "impc" / "templates" / "gemv.cu.j2").is_file() and (site / "impc" / "targets" / "sm_90a" / "target.json").is_file()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    code = ("import sys, impc; assert impc.__file__.startswith(sys.argv[1]), impc.__file__; "
            "from impc.cli import main; sys.exit(main(sys.argv[2:]))")
    out = tmp_path / "smol"
    r = subprocess.run([sys.executable, "-c", code, str(site), "compile", "smollm2", "-o", str(out), "--target", "sm_90a",
                        "-q", "--no-calib"], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_bundle(out).program("sm_90a").phases


def test_inspect_a_synthetic_bundle(tmp_path):
    """`impc inspect` of a synthetic bundle (weights made on the GPU: no quantization error measured, no checkpoint
    hash) prints its summary and program, no traceback."""
    from impc.emit import nvcc_path
    from impc.errors import CompileError
    try:
        nvcc_path()
    except CompileError as e:
        pytest.skip(str(e))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
                               "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                               "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                               "tie_word_embeddings": True, "hidden_act": "silu"}))
    out = tmp_path / "syn"
    r = impc("compile", "--synthetic", str(cfg), "-o", str(out), "--target", "sm_90a", "--vram", "2", "-q")
    assert r.returncode == 0, r.stderr
    for args in ((), ("--program",)):
        r = impc("inspect", str(out), *args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "gemm_wq16" in r.stdout          # every layer K a multiple of 256: decode past the GEMV on the NVFP4 GEMM
    # ... and prefill chunks of up to 64 rows on it too: a phase of its own whose layer linears all run gemm_wq64 and
    # whose attention writes the order that GEMM reads (XF_F16W); the 128-row phase keeps the fp16-copy GEMM
    from imp_runtime.activation_formats import XF_F16W
    phases = {(p["phase"], p["tokens"]): p["launches"]
              for p in json.loads((out / "program" / "sm_90a.json").read_text())["phases"]}
    small, tile = phases[("prefill", 64)], phases[("prefill", 128)]
    assert [x["kernel"] for x in small].count("gemm_wq64") == 4 * 2 and not any(x["kernel"] == "gemm_wg" for x in small)
    attn = [x for x in small if x["kernel"].startswith("attn_prefill_") and x["kernel"] != "attn_prefill_merge"]
    assert len(attn) == 2 and all(x["args"][8] == {"i32": XF_F16W} for x in attn)
    assert not any(x["kernel"].startswith("gemm_wq") for x in tile)
    # the cubin leaves out what no program of this shape launches, as a checkpoint's compile does: the qkv GEMM with
    # the q / k norm + RoPE epilogue (--prefill-qkv-epilogue off) is in no program here, and not in the cubin
    from impc.cubin import kernel_symbols
    launched = {x["kernel"] for ph in phases.values() for x in ph}
    defined = kernel_symbols((out / "kernels" / "sm_90a.cubin").read_bytes())
    assert "gemm_wgp_qkv_f16" not in launched and "gemm_wgp_qkv_f16" not in defined
    assert launched <= defined


def test_host_step_cost_script_runs(gpu_bundle_dir):
    """scripts/host_step_cost.py (the serving loop's host time against a simulated GPU) runs on a bundle with a GPU
    program, and its steps/s stay under the simulated device's own bound (1000 / gpu_ms, and the steps already
    queued when the window opens): it broke once unnoticed
    when the executor gained a field its simulated device did not have."""
    import re
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_step_cost.py"), str(gpu_bundle_dir), "--rows", "4",
                        "--gpu-ms", "2", "--steps", "30"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rates = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(serial|pipelined|ahead)\s*: ([\d.]+) steps/s", r.stdout, re.M)}
    assert set(rates) == {"serial", "pipelined", "ahead"}, r.stdout
    # (the window opens with up to two steps already queued on the simulated device when steps overlap: 32 steps'
    # landings can fall in 30 steps' device time)
    assert all(0 < v <= 1000 / 2 * 32 / 30 for v in rates.values()), rates


def test_serve_host_cost_script_runs(gpu_bundle_dir):
    """scripts/serve_host_cost.py (the served host cost over HTTP on a simulated GPU) serves its streaming clients
    with no errors and under the simulated device's rate (clients x 1000 / gpu_ms tokens/s), and its --prefix mode
    times each request's first token."""
    import re
    script = str(ROOT / "scripts" / "serve_host_cost.py")
    r = subprocess.run([sys.executable, script, str(gpu_bundle_dir), "--clients", "4", "--gpu-ms", "5", "--seconds", "5",
                        "--port", "8797"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r": (\d+) output tok/s \((\d+)% of the (\d+) the device allows\), (\d+) errors", r.stdout)
    assert m, r.stdout
    rate, ceiling, errors = int(m.group(1)), int(m.group(3)), int(m.group(4))
    assert errors == 0 and ceiling == 4 * 1000 // 5 and 0 < rate <= ceiling * 1.05, r.stdout
    r = subprocess.run([sys.executable, script, str(gpu_bundle_dir), "--prefix", "64", "--prompt-len", "8",
                        "--requests", "3", "--port", "8798"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    times = re.search(r"first ([\d.]+) ms, then ([\d.]+), ([\d.]+) ms", r.stdout)
    assert times and all(float(x) > 0 for x in times.groups()), r.stdout


def test_a_steps_head_takes_sampled_chunks_first():
    """Which prompt-ending chunks' last rows a mixed step's head takes after its decode rows (the cuda executor's
    host side): every chunk sampled in the step, and the chunks asking for logits when rows are left for all of them
    (else each gets a logits call of its own, which must find its row of x intact: so a step that samples chunks
    and has no rows for all those asking for logits is refused); too many sampled chunks for the logits rows, or
    sampling on a bundle whose prefill does not sample, is a one-line error."""
    from imp_runtime.executor import PrefillChunk
    from imp_runtime.executor_cuda import CudaExecutor
    ex = object.__new__(CudaExecutor)        # the host logic only: no device
    ex.samples_chunks, ex.logit_rows = True, 8

    def chunk(sample=False, want=False):
        return PrefillChunk(0, [1], 0, want_logits=want, sample=sample)
    mixed = [chunk(want=True), chunk(sample=True), chunk(), chunk(want=True), chunk(sample=True), chunk(want=True)]
    assert ex._head_rows(2, mixed) == [True, True, False, True, True, True]
    assert ex._head_rows(3, mixed) == [True, True, False, True, True, True]
    with pytest.raises(ValueError, match="rows for 2 of its 3 chunks asking for logits"):
        ex._head_rows(4, mixed)
    with pytest.raises(ValueError, match="samples at most 8 rows"):
        ex._head_rows(7, mixed)
    wants = [chunk(want=True)] * 3
    assert ex._head_rows(5, wants) == [True] * 3
    assert ex._head_rows(6, wants) == [False] * 3                  # a logits call each
    ex.samples_chunks = False
    assert ex._head_rows(0, [chunk(want=True)]) == [False]
    with pytest.raises(ValueError, match="does not sample"):
        ex._head_rows(0, [chunk(sample=True)])


def test_large_prefill_phase_runs_one_gemm_a_linear_at_every_row_count():
    """The Qwen3-8B shape's largest prefill phase runs each layer linear on one GEMM at every row count: the persistent
    ping-pong GEMM (auto) or the per-tile one (--prefill-gemm tiles), whose grid follows the step's rows. No nvcc: the
    program is built without a cubin."""
    from imp_runtime.program import evaluate
    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec, t = SHAPES["qwen3-8b"], load_target("sm_90a")
    formats = default_formats(spec)
    plan = plan_memory(spec, formats, [t], None, 4096, 64)
    for opt, kern in (("auto", "gemm_wgp_f16"), ("tiles", "gemm_wg256_f16")):
        prog = build_program(spec, formats, t, plan, ProgramOptions(prefill_gemm=opt), None)
        chunk = prog.constants["prefill_chunk"]
        assert chunk > 512
        gemms = [x for x in prog.phase("prefill", chunk).launches
                 if x.kernel.startswith("gemm_wg") and any(b.startswith("layers.") for b, _ in x.reads)]
        assert {x.kernel for x in gemms} == {kern}
        for rows in (1, 257, 512, 513, chunk):
            env = dict(prog.symbols, rows=rows, dec=0, prows=rows, srows=0, schunks=0)
            ran = [x for x in gemms if all(evaluate(g, env) for g in x.grid)]
            # one launch for each layer's qkv, o, gate_up and down
            assert len(ran) == 4 * spec.n_layers
            if opt == "auto":       # a block an SM (the GEMM walks the step's tiles)
                assert all(evaluate(x.grid[0], env) == t["sm_count"] for x in ran)


def test_symbol_ranges_gate_a_value_and_the_version_says_so():
    """A symbol expression with a range is 0 outside it (its launch skipped), its plain value inside; validation sees
    every alternative (gate=False). Programs that may hold ranges are version 2: this runtime reads 1 and 2, and an
    unknown version is a one-line error rather than a program run with its alternatives all launched."""
    from imp_runtime.program import ProgramError, evaluate, from_dict
    v = {"sym": "rows", "ceil_div": 128, "range": [513, 2048]}
    assert [evaluate(v, {"rows": r}) for r in (1, 512, 513, 2048, 2049)] == [0, 0, 5, 16, 0]
    assert evaluate(v, {"rows": 100}, gate=False) == 1
    assert evaluate({"sym": "rows", "mul": 0, "add": 132, "range": [1, 512]}, {"rows": 300}) == 132
    with pytest.raises(ProgramError, match="program version 3"):
        from_dict({"version": 3})


def test_streamed_gemv_where_whole_stages():
    """Hopper's decode GEMVs of up to 8 rows take the streamed kernel (templates/gemv_ring.cu.j2 gemv_ring_*) where every
    warp's K range is whole ring stages: 32 k a chunk x 4 chunks a group x 2 groups a stage, over 8 warps (gate_up:
    4), so K % 2048 (gate_up: 1024). Its persistent grid is at most two blocks an SM, its shared memory 4 stages x
    8 warps x 2 groups x (2 rows x 32 lanes x 16 bytes + 8 x 2 x 8 scale bytes) = 73,728 bytes; an ungated GEMV of
    more tiles than two blocks an SM but no more than three (qkv: 384 tiles, 132 SMs) takes gemv_ring3_*, a block a
    tile, three stages: 55,296 bytes. At one row the others stage the activation's hi plane in shared memory (gemv_ringx_*)."""
    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec = SHAPES["qwen3-8b"]                     # hidden 4096, intermediate 12288, q 4096 + k, v 1024 each
    formats = default_formats(spec)
    for target, streamed in (("sm_90a", True), ("sm_120a", False)):
        t = load_target(target)
        prog = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64),
                             ProgramOptions(gemv_pair=False), None)   # (the pairs: test_gemv_pair_program)
        assert prog.options["gemv_max_rows"] == 4 or not streamed      # (Hopper's default for hidden 4096)
        for b in (1, 2, 4, 8):
            if b == 8:
                # eight rows (--gemv-max-rows 8; the default where hidden < 4096): two n8 groups of the MMA, qkv too
                # on the persistent grid, two blocks an SM (ring3's registers are for one group)
                prog = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64),
                                     ProgramOptions(gemv_max_rows=8, gemv_pair=False), None)
            layer0 = [x for x in prog.phase("decode", b).launches if x.kernel.startswith("gemv_")][:4]
            if not streamed:
                assert not any("ring" in x.kernel for x in layer0)
                continue
            nb = f"nb{b}"
            if b == 8:
                assert [x.grid[0] for x in layer0] == [264, 256, 264, 256]
                assert [x.kernel for x in layer0] == ["gemv_ring_nvfp4_nb8", "gemv_ring_nvfp4_nb8",
                                                      "gemv_ring_gated_nvfp4_nb8", "gemv_ring_nvfp4_nb8"]
                assert [x.smem for x in layer0] == [73728] * 4
                continue
            # qkv 6144 rows = 384 tiles, o 256, gate_up 12288 outputs = 768, down 256; 132 SMs
            assert [x.grid[0] for x in layer0] == [384, 256, 264, 256]
            if b == 1:
                # one row: o, gate_up and down with each warp's K range of the activation's hi plane staged behind
                # the ring, 8 warps x (2 bytes x K range + 32 bytes of padding): o 8 x 1056, gate_up (K range
                # 4096 / 4) 8 x 2080, down (12288 / 8) 8 x 3104, all three beside a four-stage ring (with both
                # planes, down's 49,664 bytes left room for three stages only: two blocks an SM of 227 KB)
                # (gate_up's stage loop unrolled over the ring: --gemv-ring-unroll, the default; below)
                # (qkv with qkv_rope's work in its tail: --qkv-rope-tail, the default; test_qkv_rope_tail)
                assert [x.kernel for x in layer0] == ["gemv_ring3_rope_nvfp4_nb1", "gemv_ringx_nvfp4_nb1",
                                                      "gemv_ringxr_gated_nvfp4_nb1", "gemv_ringxr_nvfp4_nb1"]
                assert [x.smem for x in layer0] == [55296, 73728 + 8448, 73728 + 16640, 73728 + 24832]
                continue
            assert [x.kernel for x in layer0] == [f"gemv_ring3_nvfp4_{nb}", f"gemv_ring_nvfp4_{nb}",
                                                  f"gemv_ring_gated_nvfp4_{nb}", f"gemv_ring_nvfp4_{nb}"]
            assert [x.smem for x in layer0] == [55296, 73728, 73728, 73728]
        if streamed:
            assert prog.kernel_smem["gemv_ring_nvfp4_nb8"] == 73728
            assert prog.kernel_smem["gemv_ringxr_gated_nvfp4_nb1"] == 73728 + 16640
    # --gemv-ring-unroll: the one-row gate_up (K range 1024 a warp: 4 stages, one revolution of the ring) on
    # gemv_ringxr_gated_*, and down (K range 1536: 6 stages, 256 tiles on 256 blocks, one each) on gemv_ringxr_*, the
    # same grid, shared memory and arguments; every other launch of every phase (o on gemv_ringx_* too) unchanged
    t = load_target("sm_90a")
    plan = plan_memory(spec, formats, [t], None, 4096, 64)
    base = build_program(spec, formats, t, plan, ProgramOptions(gemv_ring_unroll=False, gemv_pair=False), None)
    unrolled = build_program(spec, formats, t, plan, ProgramOptions(gemv_pair=False), None)
    changed = 0
    for pa, pb in zip(base.phases, unrolled.phases):
        assert (pa.phase, pa.tokens, len(pa.launches)) == (pb.phase, pb.tokens, len(pb.launches))
        for xa, xb in zip(pa.launches, pb.launches):
            down = xa.kernel == "gemv_ringx_nvfp4_nb1" and xa.args[1]["ptr"].endswith(".down.codes")
            if xa.kernel == "gemv_ringx_gated_nvfp4_nb1" or down:
                assert xb.kernel == ("gemv_ringxr_nvfp4_nb1" if down else "gemv_ringxr_gated_nvfp4_nb1")
                assert (xa.grid, xa.block, xa.smem, xa.args, xa.pdl) == (xb.grid, xb.block, xb.smem, xb.args, xb.pdl)
                assert not down or xa.grid[0] == 256
                changed += 1
            else:
                assert xa == xb
    assert changed == 2 * spec.n_layers            # gate_up and down a layer, in the one-row decode phase only
    assert unrolled.kernel_smem["gemv_ringxr_gated_nvfp4_nb1"] == 73728 + 16640
    # SmolLM2's shape (hidden 576, intermediate 1536): K of 576 and 1536 is whole stages nowhere, so the per-block GEMV
    from imp_runtime.spec import ModelSpec
    small = ModelSpec(family="llama", vocab_size=49152, hidden=576, n_layers=2, n_heads=9, n_kv_heads=3, head_dim=64,
                      intermediate=1536, norm_eps=1e-5, rope_theta=1e5, max_position=2048)
    t = load_target("sm_90a")
    f = default_formats(small)
    prog = build_program(small, f, t, plan_memory(small, f, [t], None, 2048, 64), ProgramOptions(), None)
    assert not any("ring" in x.kernel for ph in prog.phases for x in ph.launches)
    # Output rows not whole 16-row tiles (the stages copy without a clamp): an NVFP4 head of 49,153 rows on the
    # per-block GEMV, of 49,152 rows streamed
    for vocab, kern in ((49152, "gemv_ringx_nvfp4_nb1"), (49153, "gemv_nvfp4_nb1")):
        spec = ModelSpec(family="llama", vocab_size=vocab, hidden=4096, n_layers=2, n_heads=32, n_kv_heads=8,
                         head_dim=128, intermediate=12288, norm_eps=1e-5, rope_theta=1e5, max_position=2048)
        f = default_formats(spec)
        assert f["lm_head"] == "nvfp4"
        prog = build_program(spec, f, t, plan_memory(spec, f, [t], None, 2048, 64), ProgramOptions(), None)
        assert [x.kernel for x in prog.phase("decode", 1).launches if x.kernel.startswith("gemv_")][-1] == kern


def test_rope_in_attention_program():
    """--rope-in-attention: every decode bucket launches no qkv_rope_cache_f16; each layer's decode attention is
    attn_decode_rope_* reading the qkv rows, the layer's bias / norm weights / inverse frequencies, positions and
    KV slots, and writing the layer's K and V pools, with the group's q (4 heads x 128 x 2 bytes) on top of the
    plain kernel's shared memory, and launched under programmatic dependent launch like the plain one (it copies the
    cached keys before its grid-dependency wait). Prefill phases keep qkv_rope_cache_f16 (their decode rows too). Not
    the default for this shape (head dim 128 with q/k norm: rope_in_attention_default); without it the plain
    kernels, and the rope kernels left out of the cubin."""
    from impc.launches import ProgramOptions, attn_decode_geometry, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec = SHAPES["qwen3-8b"]
    formats = default_formats(spec)
    t = load_target("sm_90a")
    plan = plan_memory(spec, formats, [t], None, 4096, 64)
    ad = attn_decode_geometry(spec, t)
    on = build_program(spec, formats, t, plan, ProgramOptions(rope_in_attention=True), None)
    # (off: the qkv_rope launch, not its work in the qkv GEMV's tail, test_qkv_rope_tail_program)
    off = build_program(spec, formats, t, plan, ProgramOptions(rope_in_attention=False, qkv_rope_tail=False), None)
    assert on.options["rope_in_attention"] and not off.options["rope_in_attention"]
    assert not build_program(spec, formats, t, plan, ProgramOptions(), None).options["rope_in_attention"]
    for prog, fused in ((on, True), (off, False)):
        for ph in prog.phases:
            kernels = [x.kernel for x in ph.launches]
            attn = [x for x in ph.launches if x.kernel.startswith("attn_decode")]
            if ph.phase == "decode":
                assert len(attn) == spec.n_layers
                assert ("qkv_rope_cache_f16" in kernels) != fused
                assert all(x.kernel.startswith("attn_decode_rope_f16") == fused for x in attn)
                assert all(x.pdl for x in attn)
                if fused:
                    x = attn[3]
                    # templates/attn_decode.cu.j2 AD_ROPE_PARAMS
                    assert [a.get("ptr") for a in x.args[:10]] == [
                        "qkv", None, "layers.3.q_norm", "layers.3.k_norm", "rope.0", "positions", "kv_slots", "kv.3.k",
                        "kv.3.v", "block_tables"]
                    assert {"qkv", "positions", "kv_slots"} <= {b for b, _ in x.reads}
                    assert {"kv.3.k", "kv.3.v", "attn"} <= {b for b, _ in x.writes}
                    assert x.smem == (ad["smem3"] if x.kernel.endswith("_r3") else ad["smem2"]) + 4 * 128 * 2
            elif ph.phase == "prefill":
                assert kernels.count("qkv_rope_cache_f16") == spec.n_layers
                assert not any(k.startswith("attn_decode_rope") for k in kernels)
    assert on.kernel_smem["attn_decode_rope_f16"] == ad["smem2"] + 4 * 128 * 2
    omit = kernels_not_launched(spec, t, ProgramOptions(rope_in_attention=True, gemv_pair=False))
    assert omit == {"attn_prefill_f16"} | (
        {"gemm_wgp_qkv_f16"} if spec.head_dim in (64, 128) else set()) | {      # (--prefill-qkv-epilogue's kernel)
        "gemv_ring3_rope_nvfp4_nb1"} | {                                        # (the rope tail's, below)
        "gemv_ring_pair_nvfp4_nb1", "gemv_ring_pair_gated_nvfp4_nb1"} | {         # (--gemv-pair's)
        "gemv_ring3_rope_ready_nvfp4_nb1", "attn_decode_ready_f16", "attn_decode_ready_f16_r3"}   # (--attn-head-ready's)
    assert {"attn_decode_rope_f16", "attn_decode_rope_f16_r3"} <= kernels_not_launched(
        spec, t, ProgramOptions(rope_in_attention=False))


def test_attn_head_ready_program():
    """--attn-head-ready (off by default): at one decode row of the 8B shape, each layer's qkv launch is
    gemv_ring3_rope_ready_nvfp4_nb1 (the same arguments as gemv_ring3_rope_nvfp4_nb1's; its kv heads' counts in
    rope_count past the heads' tile counts, which has room for them) and the attention after it attn_decode_ready_*
    with those counts (rope_count + the heads' counts) as one more argument, both reading and writing those bytes;
    every other launch and phase is the default program's. The default cubin leaves both kernels out; rejected with
    --gemv-pair (whose pair launch counts no kv heads)."""
    from impc.launches import ProgramOptions, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec = SHAPES["qwen3-8b"]
    formats = default_formats(spec)
    t = load_target("sm_90a")
    plan = plan_memory(spec, formats, [t], None, 4096, 64)
    base = build_program(spec, formats, t, plan, ProgramOptions(gemv_pair=False), None)
    on = build_program(spec, formats, t, plan, ProgramOptions(gemv_pair=False, attn_head_ready=True), None)
    heads = spec.n_heads + 2 * spec.n_kv_heads
    counts = ("rope_count", (heads + spec.n_kv_heads) * 4)
    assert on.buffers["rope_count"].bytes >= counts[1]
    for pa, pb in zip(on.phases, base.phases, strict=True):
        assert (pa.phase, pa.tokens) == (pb.phase, pb.tokens)
        for xa, xb in zip(pa.launches, pb.launches, strict=True):
            if not (pa.phase == "decode" and pa.tokens == 1):
                assert xa == xb
            elif xb.kernel == "gemv_ring3_rope_nvfp4_nb1":
                assert xa.kernel == "gemv_ring3_rope_ready_nvfp4_nb1" and xa.args == xb.args
                assert counts in xa.reads and counts in xa.writes
                assert (xa.grid, xa.block, xa.smem, xa.pdl) == (xb.grid, xb.block, xb.smem, xb.pdl)
            elif xb.kernel.startswith("attn_decode_"):
                assert xa.kernel == xb.kernel.replace("attn_decode_", "attn_decode_ready_")
                assert xa.args == (*xb.args, {"ptr": "rope_count", "offset": heads * 4})
                assert (xa.grid, xa.block, xa.smem, xa.pdl) == (xb.grid, xb.block, xb.smem, xb.pdl)
                assert counts in xa.reads and counts in xa.writes
            else:
                assert xa == xb
    kinds = [x.kernel for x in on.phase("decode", 1).launches]
    assert kinds.count("gemv_ring3_rope_ready_nvfp4_nb1") == spec.n_layers
    assert sum(k.startswith("attn_decode_ready_") for k in kinds) == spec.n_layers
    ready_kernels = {"gemv_ring3_rope_ready_nvfp4_nb1", "attn_decode_ready_f16", "attn_decode_ready_f16_r3"}
    assert ready_kernels <= kernels_not_launched(spec, t, ProgramOptions())
    assert not ready_kernels & kernels_not_launched(spec, t, ProgramOptions(attn_head_ready=True))
    # where no qkv takes the rope tail (the attention's own rope: tiny-llama's shape) the option launches nothing of
    # its own, and nothing the cubin leaves out is launched or given shared memory (the program's validation)
    for name in ("qwen3-8b", "tiny-llama"):
        sp = SHAPES[name]
        f = default_formats(sp)
        opts = ProgramOptions(gemv_pair=False, attn_head_ready=True)
        prog = build_program(sp, f, t, plan_memory(sp, f, [t], None, min(4096, sp.max_position), 64), opts, None)
        omit = kernels_not_launched(sp, t, opts)
        assert not omit & {x.kernel for ph in prog.phases for x in ph.launches} and not omit & set(prog.kernel_smem)
        if name == "tiny-llama":
            assert ready_kernels <= omit
    with pytest.raises(ValueError, match="gemv_pair"):
        ProgramOptions(gemv_pair=True, attn_head_ready=True)
    # ... and at the command line, an error naming both flags, no traceback, nothing written
    out = ROOT / "build" / "no-such-output-head-ready"
    r = impc("compile", "--synthetic", str(ROOT / "examples" / "qwen3-8b.json"), "-o", str(out), "--target", "sm_90a",
             "--attn-head-ready", "--gemv-pair")
    assert r.returncode != 0 and "--attn-head-ready" in r.stderr and "--gemv-pair" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_qkv_rope_tail_program():
    """--qkv-rope-tail (the default): where the qkv projection runs gemv_ring3_* at one row (the 8B shape), its
    launch is gemv_ring3_rope_* taking qkv_rope_cache_f16's arguments after the qkv rows (bias, q / k norm weights,
    inverse frequencies, positions, KV slots, then q and the layer's K and V pools) and the heads' tile counts, before
    the norm's four, and no qkv_rope launch follows: 5 launches a layer. Everything else as without the option;
    2 and 4 rows (gemv_ring3_*: slower so), 8 (--gemv-max-rows 8: gemv_ring_*, a persistent grid), the GEMM's
    batches, prefill, shapes whose qkv is not on ring3 (the 0.6B shape) and --rope-in-attention keep their launches. The counts start at 0 (the init phase)."""
    import dataclasses

    from impc.launches import ProgramOptions, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec = SHAPES["qwen3-8b"]
    formats = default_formats(spec)
    t = load_target("sm_90a")
    plan = plan_memory(spec, formats, [t], None, 4096, 64)
    on = build_program(spec, formats, t, plan, ProgramOptions(gemv_max_rows=8, gemv_pair=False), None)
    off = build_program(spec, formats, t, plan, ProgramOptions(gemv_max_rows=8, qkv_rope_tail=False, gemv_pair=False),
                        None)
    heads = spec.n_heads + 2 * spec.n_kv_heads
    assert on.buffers["rope_count"].bytes == (heads + spec.n_kv_heads) * 4     # (the kv heads': --attn-head-ready)
    assert any(x.kernel == "fill_f32" and x.args[0]["ptr"] == "rope_count" for x in on.phase("init", 0).launches)
    for pa, pb in zip(on.phases, off.phases):
        assert (pa.phase, pa.tokens) == (pb.phase, pb.tokens)
        tail = pa.phase == "decode" and pa.tokens == 1
        ka, kb = [x.kernel for x in pa.launches], [x.kernel for x in pb.launches]
        if not tail:
            assert pa.launches == pb.launches
            continue
        assert "qkv_rope_cache_f16" not in ka and kb.count("qkv_rope_cache_f16") == spec.n_layers
        assert len(ka) == len(kb) - spec.n_layers
        rest = [x for x in pb.launches if x.kernel != "qkv_rope_cache_f16"]
        assert len(rest) == len(pa.launches)
        layer = 0
        for xa, xb in zip(pa.launches, rest):
            if xb.kernel.startswith("gemv_ring3_nvfp4_"):
                assert xa.kernel == xb.kernel.replace("gemv_ring3_", "gemv_ring3_rope_")
                assert (xa.grid, xa.block, xa.smem, xa.pdl) == (xb.grid, xb.block, xb.smem, xb.pdl)
                assert xa.args[:9] == xb.args[:9] and xa.args[-4:] == xb.args[-4:]
                p = f"layers.{layer}."
                assert [a.get("ptr") for a in xa.args[9:-4]] == [
                    None, p + "q_norm", p + "k_norm", "rope.0", "positions", "kv_slots", "q", f"kv.{layer}.k",
                    f"kv.{layer}.v", "rope_count"]
                assert {f"kv.{layer}.k", f"kv.{layer}.v", "q", "rope_count"} <= {b for b, _ in xa.writes}
                layer += 1
            else:
                assert xa == xb
        assert layer == spec.n_layers
    assert len(on.phase("decode", 1).launches) == len(off.phase("decode", 1).launches) - spec.n_layers
    assert "gemv_ring3_rope_nvfp4_nb1" not in kernels_not_launched(spec, t, ProgramOptions())
    assert "gemv_ring3_rope_nvfp4_nb1" in kernels_not_launched(spec, t, ProgramOptions(qkv_rope_tail=False))
    # ... not with --rope-in-attention (the attention does that work), nor where qkv is not on ring3
    ria = build_program(spec, formats, t, plan, ProgramOptions(rope_in_attention=True), None)
    assert not any("rope_nvfp4" in x.kernel for ph in ria.phases for x in ph.launches)
    # the Qwen3-0.6B shape: qkv 16 + 2 x 8 heads of 128 = 256 tiles, on the persistent grid (two blocks an SM)
    small = dataclasses.replace(spec, hidden=1024, n_layers=2, n_heads=16, intermediate=3072)
    f = default_formats(small)
    prog = build_program(small, f, t, plan_memory(small, f, [t], None, 4096, 64), ProgramOptions(), None)
    assert not any("rope_nvfp4" in x.kernel for ph in prog.phases for x in ph.launches)
    assert sum(x.kernel == "qkv_rope_cache_f16" for x in prog.phase("decode", 1).launches) == 2


def test_rope_in_attention_default_by_shape():
    """--rope-in-attention left to the shape: on for head dims up to 64 without q/k norm (the SmolLM2 shape measured
    faster with it), off for the Qwen3 shapes (head dim 128, q/k norm: the 0.6B slower with it, the 8B slower at
    long contexts), and an explicit choice kept either way."""
    from dataclasses import replace as dc_replace

    from impc.launches import ProgramOptions, resolve_options
    from tests.test_templates_compile import SHAPES
    q8 = SHAPES["qwen3-8b"]
    small = dc_replace(q8, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, qk_norm=False)
    q06 = dc_replace(q8, hidden=1024, n_heads=16, n_kv_heads=8)                    # the 0.6B shape's attention
    assert resolve_options(small, ProgramOptions()).rope_in_attention is True
    assert resolve_options(q8, ProgramOptions()).rope_in_attention is False
    assert resolve_options(q8, ProgramOptions(rope_in_attention=True)).rope_in_attention is True
    assert resolve_options(q06, ProgramOptions()).rope_in_attention is False
    assert resolve_options(dc_replace(small, qk_norm=True), ProgramOptions()).rope_in_attention is False
    assert resolve_options(dc_replace(small, head_dim=128), ProgramOptions()).rope_in_attention is False
    assert resolve_options(small, ProgramOptions(rope_in_attention=False)).rope_in_attention is False
    assert resolve_options(q8, ProgramOptions(rope_in_attention=False)).rope_in_attention is False
    assert resolve_options(q06, ProgramOptions(rope_in_attention=True)).rope_in_attention is True


def test_norm_in_the_decode_gemm_tail_program():
    """Decode batches on the NVFP4 decode GEMM (Hopper, past the GEMV's rows): the RMSNorm before gate_up runs in the
    tail of the o launch, the next layer's before qkv in the down launch's (templates/gemm_wgmma_nvfp4.cu.j2
    wq_norm_tail), each with that norm's weight, into hb, and the blocks' counts; only layer 0's norm (after the
    embedding) and the final one stay launches. The GEMV's batches (1-4 rows on the streamed GEMV) carry the same
    norms as partial sums (templates/gemv_ring.cu.j2 gemv_ring_body: o and down write x * w into hb and their tiles' sums
    of squares into norm_part with that norm's weight; gate_up and the next layer's qkv read norm_part). A shape whose
    o / down grid has fewer blocks than the batch has rows keeps the norm launches past the GEMV (each norming block
    takes one row): at hidden 1024, o runs 16 tiles of 64 rows in one K split (16 blocks), down (K 3072) in three
    (48 blocks)."""
    from imp_runtime.spec import ModelSpec
    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    t = load_target("sm_90a")
    spec = SHAPES["qwen3-8b"]
    f = default_formats(spec)
    prog = build_program(spec, f, t, plan_memory(spec, f, [t], None, 4096, 64), ProgramOptions(gemv_pair=False), None)
    gemv_rows = prog.options["gemv_max_rows"]
    for ph in prog.phases:
        if ph.phase != "decode":
            continue
        norms = [x for x in ph.launches if x.kernel == "rmsnorm_residual"]
        wq = [x for x in ph.launches if x.kernel.startswith("gemm_wq") and x.args[9] == {"i32": 1}]
        assert [x.args[2]["ptr"] for x in norms] == ["layers.0.attn_norm", "final_norm"]
        if ph.tokens <= gemv_rows:
            assert not wq
            ring = [x for x in ph.launches if x.kernel.startswith("gemv_ring") and x.args[1]["ptr"].startswith("layers.")]
            assert len(ring) == 4 * spec.n_layers
            writers, readers = ring[1::2], ring[0::2]       # o, down; qkv, gate_up
            want = [w for i in range(spec.n_layers) for w in (f"layers.{i}.ffn_norm", f"layers.{i + 1}.attn_norm")]
            assert [x.args[-4].get("ptr") for x in writers] == want[:-1] + [None]
            assert all(x.args[-3:-1] == ({"ptr": "hb"}, {"ptr": "norm_part"}) for x in writers[:-1])
            assert all(x.args[-1] == {"ptr": None} for x in writers)
            assert [x.args[-1].get("ptr") for x in readers] == [None] + ["norm_part"] * (2 * spec.n_layers - 1)
            assert all(x.args[-4:-1] == ({"ptr": None},) * 3 for x in readers)
            assert ("norm_part", ph.tokens * spec.hidden // 16 * 4) in writers[0].writes
            continue
        want = [w for i in range(spec.n_layers) for w in (f"layers.{i}.ffn_norm", f"layers.{i + 1}.attn_norm")][:-1]
        assert [x.args[14].get("ptr") for x in wq] == want + [None]
        assert all(x.args[15:] == ({"ptr": "hb"}, {"ptr": "norm_count"}) for x in wq[:-1])
        assert all(x.grid[0] >= ph.tokens for x in wq)
        assert ("hb", ph.tokens * spec.hidden * 2) in wq[0].writes
    # a GPU must hold a block more than the rows the tail norms (the runtime refuses to load the bundle where it
    # cannot: runtime/executor_cuda.py); --no-norm-tail keeps those norms launches of their own, --no-norm-partials
    # the streamed GEMVs' (each flag one mechanism: only the tail needs the SMs)
    from imp_runtime.executor_cuda import norm_tail_rows
    assert norm_tail_rows(prog) == 64
    def norms(opts: ProgramOptions, rows: int) -> int:
        p = build_program(spec, f, t, plan_memory(spec, f, [t], None, 4096, 64), opts, None)
        return sum(x.kernel == "rmsnorm_residual" for x in p.phase("decode", rows).launches)
    off = build_program(spec, f, t, plan_memory(spec, f, [t], None, 4096, 64), ProgramOptions(norm_tail=False), None)
    assert norm_tail_rows(off) == 0 and off.options["norm_tail"] is False
    every = 2 * spec.n_layers + 1
    assert (norms(ProgramOptions(norm_tail=False), 8), norms(ProgramOptions(norm_tail=False), 1)) == (every, 2)
    assert (norms(ProgramOptions(norm_partials=False), 8), norms(ProgramOptions(norm_partials=False), 1)) == (2, every)
    assert norms(ProgramOptions(norm_tail=False, norm_partials=False), 4) == every
    narrow = ModelSpec(family="qwen3", vocab_size=32000, hidden=1024, n_layers=2, n_heads=16, n_kv_heads=8,
                       head_dim=64, intermediate=3072, norm_eps=1e-6, rope_theta=1e6, max_position=4096, qk_norm=True)
    f = default_formats(narrow)
    prog = build_program(narrow, f, t, plan_memory(narrow, f, [t], None, 4096, 64), ProgramOptions(), None)
    counts = {ph.tokens: sum(x.kernel == "rmsnorm_residual" for x in ph.launches)
              for ph in prog.phases if ph.phase == "decode"}
    assert (counts[16], counts[32], counts[64]) == (2, 4, 5), counts      # 32 rows: layer 0's down norms layer 1


def decode_shape_programs():
    """(spec, is the small shape, sm_90a program) of the Qwen3-8B shape and a SmolLM2-like small shape (hidden 576,
    head dim 64, no q/k norm), default options, planned for 4,096 tokens of context and 64 rows."""
    from dataclasses import replace as dc_replace

    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    t = load_target("sm_90a")
    q8 = SHAPES["qwen3-8b"]
    small = dc_replace(q8, hidden=576, intermediate=1536, n_heads=9, n_kv_heads=3, head_dim=64, qk_norm=False,
                       n_layers=4, vocab_size=49152)
    for spec in (q8, small):
        formats = default_formats(spec)
        plan = plan_memory(spec, formats, [t], None, 4096, 64)
        # (without --gemv-pair's one-row launches, whatever the default: test_gemv_pair_program has those)
        yield spec, spec is small, build_program(spec, formats, t, plan, ProgramOptions(gemv_pair=False), None)


def test_o_after_decode_attention_pdl():
    """The o projection after the decode attention: under programmatic dependent launch at one row (the streamed GEMV
    fills its ring during the attention; the per-block GEMV of small shapes starts beside it: measured faster for
    both), not on the streamed GEMV at 2..4 rows (its blocks waited beside the attention's merging blocks: measured
    slower), on the per-block GEMV of small shapes at every GEMV row count (measured faster at 2-16 rows), and again
    on the NVFP4 decode GEMM past them (its weights stream in before its wait; the fp16-copy GEMM of shapes it does
    not take has no grid-dependency wait)."""
    for spec, small, prog in decode_shape_programs():
        gemv_rows = prog.options["gemv_max_rows"]
        for ph in prog.phases:
            if ph.phase != "decode":
                continue
            ls = ph.launches
            after = [ls[i + 1] for i, x in enumerate(ls) if x.kernel.startswith("attn_decode")]
            assert len(after) == spec.n_layers
            assert all(x.kernel.startswith(("gemv_", "gemm_")) for x in after), {x.kernel for x in after}
            streamed = after[0].kernel.startswith("gemv_ring")
            want = (ph.tokens == 1 or (ph.tokens > gemv_rows and after[0].kernel.startswith("gemm_wq"))
                    or (ph.tokens <= gemv_rows and after[0].kernel.startswith("gemv_") and not streamed))
            if small:                   # the per-block GEMV at every GEMV row count: the new rule applies somewhere
                assert ph.tokens > gemv_rows or not streamed
            assert all(x.pdl == want for x in after), (spec.hidden, ph.tokens, after[0].kernel)


def test_decode_gemv_residual_read_before_the_wait():
    """The per-block decode GEMVs that add into the residual stream x (o after the attention, down after the gated
    gate_up) read x before their grid-dependency wait (mode 2, templates/gemv.cu.j2 GV_ADD_EARLY), which is correct
    only where the launch just before writes nothing of their output (every earlier writer has completed when a
    dependent starts): both shapes, every decode phase the GEMV takes; no mode-2 launch anywhere right after a writer
    of its output, and none on the streamed GEMV (gemv_ring*, which reads its residual after the wait)."""
    for spec, small, prog in decode_shape_programs():
        early = 0
        for ph in prog.phases:
            ls = ph.launches
            for i, x in enumerate(ls):
                if not x.kernel.startswith("gemv_") or "gated" in x.kernel:
                    continue
                out = x.writes[0][0]
                j = next(j for j, a in enumerate(x.args) if a == {"ptr": out})
                mode = x.args[j + 4]["i32"]
                adds_x = out == "x" and mode != 0
                if mode == 2:
                    early += 1
                    assert i > 0 and out not in {b for b, _ in ls[i - 1].writes}, (ph.phase, ph.tokens, x.kernel)
                    assert not x.kernel.startswith("gemv_ring"), x.kernel
                if ph.phase == "decode" and adds_x and i > 0 and not x.kernel.startswith("gemv_ring") and \
                        ls[i - 1].kernel.startswith(("attn_decode", "gemv_gated", "gemv_ring")):
                    assert mode == 2, (spec.hidden, ph.tokens, ls[i - 1].kernel, x.kernel)
        if small:              # o and down of every layer in every decode phase (the 8B's take the streamed GEMV or GEMM)
            gemv_rows = prog.options["gemv_max_rows"]
            assert early == 2 * spec.n_layers * sum(ph.phase == "decode" and ph.tokens <= gemv_rows
                                                    for ph in prog.phases), early



@pytest.mark.parametrize("shape", ["qwen3-8b", "llama-3.1-8b"])
def test_gemv_pair_program(shape):
    """--gemv-pair (off by default): at one decode row of the 8B shapes (Qwen3's; Llama-3.1's: down 7 stages a warp, no
    q / k norm), each layer's o and gate_up are one launch,
    gemv_ring_pair_gated_nvfp4_nb1, and each layer's down and the next layer's qkv another, gemv_ring_pair_nvfp4_nb1
    (templates/gemv_ring_pair.cu.j2): the first GEMV's arguments (its activation, weights, x, N, K, the next norm's
    weight, planes and partial sums), then the second's (weights, out, N, K; gate_up's activation format; qkv's rope
    tail inputs, q, the next layer's KV pools and the heads' counts) exactly as the launches they replace take them,
    and the grid barrier's count; a grid of two blocks an SM with the larger of the two launches' shared memory; three
    launches a layer (the first qkv and the last down stay alone), the same bytes read and written. Every other phase
    is unchanged, and so is the default program (no barrier buffer, the kernels left out of the cubin). Not with
    --rope-in-attention for qkv, nor on shapes whose GEMVs are not those kernels (the 0.6B shape)."""
    import dataclasses

    from impc.launches import ProgramOptions, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from runtime.executor_cuda import barrier_grid, barrier_launches
    from tests.test_templates_compile import SHAPES, default_formats
    spec = SHAPES[shape]
    formats = default_formats(spec)
    t = load_target("sm_90a")
    n = spec.n_layers
    base = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64),
                         ProgramOptions(gemv_pair=False), None)
    on = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64, gemv_pair=True),
                       ProgramOptions(gemv_pair=True), None)
    assert "pair_bar" not in base.buffers and on.buffers["pair_bar"].bytes == 4
    assert any(x.kernel == "fill_f32" and x.args[0]["ptr"] == "pair_bar" for x in on.phase("init", 0).launches)
    assert barrier_grid(base) == 0 and barrier_grid(on) == 2 * t["sm_count"]
    kinds = ("gemv_ring_pair_nvfp4_nb1", "gemv_ring_pair_gated_nvfp4_nb1")
    assert sorted(x.kernel for x in barrier_launches(on)) == sorted(kinds) and not barrier_launches(base)
    for pa, pb in zip(on.phases, base.phases):
        assert (pa.phase, pa.tokens) == (pb.phase, pb.tokens)
        if not (pa.phase == "decode" and pa.tokens == 1):
            assert [x for x in pa.launches if x.args[0] != {"ptr": "pair_bar"}] == list(pb.launches)
            continue
        pairs = [x for x in pa.launches if x.kernel == kinds[0]]
        gpairs = [x for x in pa.launches if x.kernel == kinds[1]]
        assert len(pairs) == n - 1 and len(gpairs) == n and len(pa.launches) == len(pb.launches) - (2 * n - 1)
        downs = [x for x in pb.launches if x.kernel == "gemv_ringxr_nvfp4_nb1"]
        qkvs = [x for x in pb.launches if x.kernel == "gemv_ring3_rope_nvfp4_nb1"]
        os_ = [x for x in pb.launches if x.kernel == "gemv_ringx_nvfp4_nb1" and buf_names(x)[1].endswith(".o.codes")]
        gus = [x for x in pb.launches if x.kernel == "gemv_ringxr_gated_nvfp4_nb1"]
        assert len(downs) == len(qkvs) == len(os_) == len(gus) == n
        for i, (x, d, q) in enumerate(zip(pairs, downs, qkvs[1:])):
            assert buf_names(d)[1] == f"layers.{i}.down.codes" and buf_names(q)[1] == f"layers.{i + 1}.qkv.codes"
            assert x.args[:7] == d.args[:7] and x.args[7:10] == d.args[-4:-1]       # down: the add and the norm's parts
            assert d.args[-1] == {"ptr": None} and q.args[-1] == {"ptr": "norm_part"} and q.args[0] == {"ptr": "hb"}
            assert x.args[10:16] == q.args[1:7] and x.args[16:26] == q.args[9:19]    # qkv: the rope tail's inputs
            assert x.args[26] == {"ptr": "pair_bar"} and len(x.args) == 27
            assert (x.grid, x.block, x.smem, x.pdl) == ((2 * t["sm_count"], 1, 1), d.block, max(d.smem, q.smem), True)
            assert set(d.writes) | set(q.writes) | {("pair_bar", 4)} == set(x.writes)
            assert set(d.reads) | set(q.reads) | {("pair_bar", 4)} == set(x.reads)
        for i, (x, o, g) in enumerate(zip(gpairs, os_, gus)):
            assert buf_names(o)[1] == f"layers.{i}.o.codes" and buf_names(g)[1] == f"layers.{i}.gate_up.codes"
            assert x.args[:7] == o.args[:7] and x.args[7:10] == o.args[-4:-1]       # o: the add and the norm's parts
            assert o.args[-1] == {"ptr": None} and g.args[-1] == {"ptr": "norm_part"} and g.args[0] == {"ptr": "hb"}
            assert x.args[10:17] == g.args[1:7] + g.args[8:9]                       # gate_up: ... its output format
            assert x.args[17] == {"ptr": "pair_bar"} and len(x.args) == 18
            assert (x.grid, x.block, x.smem, x.pdl) == ((2 * t["sm_count"], 1, 1), o.block, max(o.smem, g.smem), o.pdl)
            assert set(o.writes) | set(g.writes) | {("pair_bar", 4)} == set(x.writes)
            assert set(o.reads) | set(g.reads) | {("pair_bar", 4)} == set(x.reads)
        # the rest of the step as without the option: the first qkv and the last down alone
        paired = downs[:-1] + qkvs[1:] + os_ + gus
        assert [x for x in pa.launches if x.kernel not in kinds] == [x for x in pb.launches if x not in paired]
        # each pair carries the two launches it replaces as its fallback (a GPU that cannot hold its grid at once)
        assert all(x.fallback == (d, q) for x, d, q in zip(pairs, downs, qkvs[1:]))
        assert all(x.fallback == (o, g) for x, o, g in zip(gpairs, os_, gus))
    # the runtime's way out on such a GPU (runtime/program.py unfuse): every phase the default program's, and the
    # fallbacks' kernels allowed their shared memory; the fallbacks survive the bundle's JSON and are validated
    from runtime.program import ProgramError, dumps, loads, unfuse, validate
    un = unfuse(on, set(kinds))
    assert [(ph.phase, ph.tokens, [x for x in ph.launches if x.args[0] != {"ptr": "pair_bar"}]) for ph in un.phases] \
        == [(ph.phase, ph.tokens, list(ph.launches)) for ph in base.phases]
    assert {k: un.kernel_smem[k] for k in base.kernel_smem} == base.kernel_smem
    assert unfuse(loads(dumps(on)), set(kinds)).phases[1:] == loads(dumps(base)).phases[1:]   # (past init's fill)
    assert "fallback" not in dumps(base)
    with pytest.raises(ProgramError, match="no fallback"):
        unfuse(base, {"gemv_ringx_nvfp4_nb1"})
    # the executor's choice by how many blocks of a launch the GPU holds at once (the occupancy API times its SMs)
    from runtime.executor_cuda import resident_program
    grid = 2 * t["sm_count"]
    same, short = resident_program(on, lambda x: grid)
    assert same is on and short == []
    assert resident_program(on, lambda x: 0)[1] == sorted(kinds)   # (how the executor asks under MPS)
    fewer, short = resident_program(on, lambda x: 2 * 114)          # a part of 114 SMs, two blocks each
    assert short == sorted(kinds) and dumps(fewer) == dumps(un)      # (the runtime's module: compared as JSON)
    one, short = resident_program(on, lambda x: grid if x.kernel == kinds[1] else grid - 1)
    assert short == [kinds[0]]
    assert [x.kernel for x in one.phase("decode", 1).launches].count(kinds[1]) == n
    assert kinds[0] not in {x.kernel for x in one.phase("decode", 1).launches}
    ph = on.phase("decode", 1)
    j, x = next((j, x) for j, x in enumerate(ph.launches) if x.kernel == kinds[0])
    bad = dataclasses.replace(x, fallback=(dataclasses.replace(x.fallback[0], kernel="no_such_kernel"), x.fallback[1]))
    broken = dataclasses.replace(on, phases=[dataclasses.replace(ph, launches=ph.launches[:j] + (bad,)
                                                                 + ph.launches[j + 1:]) if p is ph else p
                                             for p in on.phases])
    kernels = {y.kernel for p in on.phases for z in p.launches for y in (z, *z.fallback)} | set(on.kernel_smem)
    validate(on, kernels)
    with pytest.raises(ProgramError, match="fallback launch 0"):
        validate(broken, kernels)
    for k in kinds:
        assert k in kernels_not_launched(spec, t, ProgramOptions(gemv_pair=False))
        assert k not in kernels_not_launched(spec, t, ProgramOptions(gemv_pair=True))
    # with --rope-in-attention, o and gate_up only (no rope-tail qkv); the 0.6B shape neither (its GEMVs differ)
    ria = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64, gemv_pair=True),
                        ProgramOptions(gemv_pair=True, rope_in_attention=True), None)
    assert {x.kernel for ph in ria.phases for x in ph.launches} & set(kinds) == {kinds[1]}
    small = dataclasses.replace(spec, hidden=1024, n_layers=2, n_heads=16, intermediate=3072)
    f = default_formats(small)
    prog = build_program(small, f, t, plan_memory(small, f, [t], None, 4096, 64, gemv_pair=True),
                         ProgramOptions(gemv_pair=True), None)
    assert not any("pair" in x.kernel for ph in prog.phases for x in ph.launches)
    assert not set(kinds) & kernels_not_launched(small, t, ProgramOptions())


@pytest.mark.parametrize("only", ["o-gate-up", "down-qkv"])
def test_gemv_pair_only_one_kind(only):
    """--gemv-pair-only KIND: that pair's launches as --gemv-pair makes them (the same launches, fallbacks included),
    the other pair's two GEMVs as the default program has them, and the other pair's kernel left out of the cubin."""
    from impc.launches import ProgramOptions, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec = SHAPES["qwen3-8b"]
    formats = default_formats(spec)
    t = load_target("sm_90a")
    kind = {"o-gate-up": "gemv_ring_pair_gated_nvfp4_nb1", "down-qkv": "gemv_ring_pair_nvfp4_nb1"}
    other = kind["down-qkv" if only == "o-gate-up" else "o-gate-up"]
    plan = plan_memory(spec, formats, [t], None, 4096, 64, gemv_pair=True)
    both = build_program(spec, formats, t, plan, ProgramOptions(gemv_pair=True), None)
    one = build_program(spec, formats, t, plan, ProgramOptions(gemv_pair=True, gemv_pair_only=only), None)
    base = build_program(spec, formats, t, plan_memory(spec, formats, [t], None, 4096, 64),
                         ProgramOptions(gemv_pair=False), None)
    ph1, phb, ph0 = one.phase("decode", 1), both.phase("decode", 1), base.phase("decode", 1)
    assert [x for x in ph1.launches if x.kernel == kind[only]] == [x for x in phb.launches if x.kernel == kind[only]]
    assert not any(x.kernel == other for x in ph1.launches)
    # unfusing the pair gives the default step back (the barrier's init aside)
    from runtime.program import unfuse
    assert list(unfuse(one, {kind[only]}).phase("decode", 1).launches) == list(ph0.launches)
    omitted = kernels_not_launched(spec, t, ProgramOptions(gemv_pair=True, gemv_pair_only=only))
    assert other in omitted and kind[only] not in omitted
    with pytest.raises(ValueError, match="gemv_pair_only"):
        ProgramOptions(gemv_pair=True, gemv_pair_only="both")
    with pytest.raises(ValueError, match="needs gemv_pair"):
        ProgramOptions(gemv_pair=False, gemv_pair_only=only)


def buf_names(x) -> list:
    return [a.get("ptr") for a in x.args]

def test_prefill_qkv_epilogue_program():
    """--prefill-qkv-epilogue (off by default): the Qwen3-8B shape's large prefill phase runs each layer's qkv on
    gemm_wgp_qkv_f16, which writes q and that layer's KV pages itself (its arguments name them, after the norm
    weights, the RoPE table, positions and slots qkv_rope_cache_f16 takes), and no qkv_rope launch is left there;
    the smaller prefill phases and decode keep the launch; heads of 256 (a tile of 128 columns is no whole head) keep
    it everywhere; without the option the kernel is left out of the cubin."""
    from impc.launches import ProgramOptions, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    t = load_target("sm_90a")
    spec = SHAPES["qwen3-8b"]
    f = default_formats(spec)
    plan = plan_memory(spec, f, [t], None, 4096, 64)
    base = build_program(spec, f, t, plan, ProgramOptions(), None)
    prog = build_program(spec, f, t, plan, ProgramOptions(prefill_qkv_epilogue=True), None)
    chunk = prog.constants["prefill_chunk"]
    for ph, ph0 in zip(prog.phases, base.phases):
        kinds = [x.kernel for x in ph.launches]
        if ph.phase == "prefill" and ph.tokens == chunk:
            fused = [x for x in ph.launches if x.kernel == "gemm_wgp_qkv_f16"]
            assert len(fused) == spec.n_layers and "qkv_rope_cache_f16" not in kinds
            for i, x in enumerate(fused):
                names = [a.get("ptr") for a in x.args if isinstance(a, dict) and "ptr" in a]
                assert names == [f"layers.{i}.qkv.tscale", None, f"layers.{i}.q_norm", f"layers.{i}.k_norm", "rope.0",
                                 "positions", "kv_slots", "q", f"kv.{i}.k", f"kv.{i}.v"], names
                assert (f"kv.{i}.k", chunk * spec.kv_dim * 2) in x.writes and not any(b == "qkv" for b, _ in x.writes)
                assert x.grid[0] == min(-(-(spec.q_dim + 2 * spec.kv_dim) // 128) * -(-chunk // 128), t["sm_count"])
            assert len(ph.launches) == len(ph0.launches) - spec.n_layers     # one launch a layer fewer
        else:
            assert kinds == [x.kernel for x in ph0.launches], (ph.phase, ph.tokens)
    assert "gemm_wgp_qkv_f16" in kernels_not_launched(spec, t, ProgramOptions())
    assert "gemm_wgp_qkv_f16" not in kernels_not_launched(spec, t, ProgramOptions(prefill_qkv_epilogue=True))
    wide = SHAPES["gemma3-hd256"]
    fw = default_formats(wide)
    p256 = build_program(wide, fw, t, plan_memory(wide, fw, [t], None, 4096, 64),
                         ProgramOptions(prefill_qkv_epilogue=True), None)
    assert not any(x.kernel == "gemm_wgp_qkv_f16" for ph in p256.phases for x in ph.launches)


def test_boundary_cost_kernels_build(tmp_path):
    """scripts/boundary_cost.py --build (the dependency-cost microbenchmark the GPU runs) compiles its two kernels for
    sm_90a with the compiler wheels; their launch signatures are what the script binds (checked on the GPU)."""
    from impc.cubin import kernel_symbols
    out = tmp_path / "bc.cubin"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "boundary_cost.py"), "--build", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert {"chain_step", "persistent_steps", "persistent_steps_rel", "flag_steps"} <= kernel_symbols(out.read_bytes())


def test_norm_prologue_bf16_option():
    """--norm-prologue-bf16 (the default): at one decode row the GEMVs of bf16 weights that read a normed residual (the byte
    budget's bf16 qkv / gate_up) compute the RMSNorm in their prologue as the NVFP4 ones do: each such projection's
    norm launch is gone, its GEMV reads the float32 residual x and the norm weight; two rows and more are unchanged,
    and without the option the kernels are not even in the cubin (kernels_not_launched)."""
    from impc.launches import ProgramOptions, build_program, kernels_not_launched
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec, t = SHAPES["tiny-llama"], load_target("sm_90a")
    formats = default_formats(spec)
    bf16 = {"layers.1.gate_up", "layers.2.qkv"}                 # as a byte budget may keep them
    formats.update({n: "bf16" for n in bf16})
    plan = plan_memory(spec, formats, [t], None, 512, 64)
    progs = {on: build_program(spec, formats, t, plan, ProgramOptions(norm_prologue_bf16=on), None) for on in (False, True)}
    one = {on: progs[on].phase("decode", 1).launches for on in progs}
    norms = {on: sum(x.kernel == "rmsnorm_residual" for x in one[on]) for on in one}
    assert norms[False] - norms[True] == len(bf16)
    fused = [x for x in one[True] if x.kernel in ("gemv_bf16_norm_nb1", "gemv_gated_bf16_norm_nb1")]
    assert sorted(x.kernel for x in fused) == ["gemv_bf16_norm_nb1", "gemv_gated_bf16_norm_nb1"]
    for x in fused:
        lin = "layers.1.gate_up" if "gated" in x.kernel else "layers.2.qkv"
        norm = "layers.1.ffn_norm" if "gated" in x.kernel else "layers.2.attn_norm"
        assert list(x.args[:3]) == [{"ptr": "x"}, {"ptr": norm}, {"ptr": lin}]
        assert {"x", norm, lin} <= {b for b, _ in x.reads}
    assert not any(x.kernel.endswith("_norm_nb1") and "bf16" in x.kernel for x in one[False])
    two = {on: [x.kernel for x in progs[on].phase("decode", 2).launches] for on in progs}
    assert two[True] == two[False]
    assert {"gemv_bf16_norm_nb1", "gemv_gated_bf16_norm_nb1"} <= kernels_not_launched(
        spec, t, ProgramOptions(norm_prologue_bf16=False))
    assert not {"gemv_bf16_norm_nb1", "gemv_gated_bf16_norm_nb1"} & kernels_not_launched(spec, t, ProgramOptions())


def test_decode_step_values_staged_not_copied():
    """Decode phases take their step values from a staging slot, not a copy of the step region before the graph: their
    first launch (the embedding) gets host_io and the step_pack table, whose (word offset, words a row) pairs are, in
    the arena's order, those of every step array but prefill's (fa_tiles, chunk_last), offsets counted from tokens
    (the first); their sampler gets host_io (it writes the ids into the mapped host slot). Prefill phases read the
    copied step region: null host_io in both kernels."""
    from impc.arena_layout import STEP_PACK_SKIP
    for _, _, p in decode_shape_programs():
        step = sorted((b for b in p.buffers.values() if b.kind == "step"), key=lambda b: b.offset)
        assert step[0].name == "tokens" and step[1].name == "token_src"
        pack = [int(v) for v in p.buffers["step_pack"].values]
        pairs = [(pack[1 + 2 * a], pack[2 + 2 * a]) for a in range(pack[0])]
        want = [((b.offset - step[0].offset) // 4, 2 if b.dtype == "u64" else 1)
                for b in step if b.name not in STEP_PACK_SKIP]
        assert pairs == want and len(pairs) == len(step) - len(STEP_PACK_SKIP)
        assert all((b.offset - step[0].offset) % 4 == 0 for b in step)
        for ph in p.phases:
            if ph.phase not in ("decode", "prefill"):
                continue
            emb = ph.launches[0]
            assert emb.kernel.startswith("embedding_gather")
            samplers = [x for x in ph.launches if x.kernel == "sample_tokens"]
            io = {"ptr": "host_io"} if ph.phase == "decode" else {"ptr": None}
            assert emb.args[-2:] == (io, {"ptr": "step_pack"}), (ph.phase, ph.tokens)
            assert samplers and all(x.args[-1] == io for x in samplers), (ph.phase, ph.tokens)


def test_pack_step_is_each_arrays_first_rows_in_table_order():
    """runtime/program.py pack_step (the executor's staged decode values) against a hand-made region: each step array
    filled with values that name it and its row, packed rows are the arrays' first rows in step_pack order after the
    generation's 16 bytes, and nothing of a row past `rows` or of prefill's arrays (fa_tiles, chunk_last) is packed."""
    import numpy as np

    from imp_runtime.program import pack_step
    _, _, p = next(decode_shape_programs())
    lo, nbytes = p.step_region()
    region = np.zeros(nbytes, np.uint8)
    words = region.view(np.uint32)
    step = sorted((b for b in p.buffers.values() if b.kind == "step"), key=lambda b: b.offset)
    for k, b in enumerate(step):
        at = (b.offset - lo) // 4
        n = b.bytes // 4
        words[at:at + n] = (k + 1) * 100000 + np.arange(n)      # array k+1, word j
    rows = 5
    out = np.full(16 + nbytes, 0xEE, np.uint8)
    used = pack_step(region, p.step_pack(), rows, 0x1234567, out)
    packed = out[16:used].view(np.uint32)
    want = []
    for k, b in enumerate(step):
        if b.name in ("fa_tiles", "chunk_last"):
            continue
        per_row = 2 if b.dtype == "u64" else 1
        want += [(k + 1) * 100000 + j for j in range(rows * per_row)]
    assert out[:16].view(np.uint32).tolist() == [0x1234567, 0, 0, 0]
    assert packed.tolist() == want and used == 16 + 4 * len(want)
    assert (out[used:] == 0xEE).all()


def test_each_linear_on_one_gemv_family_at_every_gemv_row_count():
    """Batch invariance within the GEMV's rows needs each layer linear on one GEMV family at every row count: the
    streamed GEMV (gemv_ring*) multiplies the activation's hi plane alone, the per-block one (gemv_*_nvfp4*) both
    planes, so one sequence's logits would round differently by its batch if a linear took one family at one row and
    the other at two (the Qwen3-0.6B shape's gate_up did: its one-row norm fused into the per-block GEMV's prologue,
    its 2-4 rows streamed). Shapes: the 8B (4 GEMV rows by default, and 8), the 0.6B (8: its gate_up per-block, its o
    streamed) and a 1.7B-like hidden 2048 (8 rows, every linear streamed)."""
    from dataclasses import replace as dc_replace

    from impc.launches import ProgramOptions, build_program
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    t = load_target("sm_90a")
    q8 = SHAPES["qwen3-8b"]
    q06 = dc_replace(q8, hidden=1024, n_heads=16, n_kv_heads=8, intermediate=3072, n_layers=2)
    q17 = dc_replace(q8, hidden=2048, n_heads=16, n_kv_heads=8, intermediate=6144, n_layers=2)
    seen = {}
    for spec, rows in ((q8, None), (q8, 8), (q06, None), (q17, None)):
        f = default_formats(spec)
        prog = build_program(spec, f, t, plan_memory(spec, f, [t], None, 4096, 64), ProgramOptions(gemv_max_rows=rows),
                             None)
        gemv = prog.options["gemv_max_rows"]
        family: dict[str, set[str]] = {}
        for ph in prog.phases:
            if ph.phase != "decode" or ph.tokens > gemv:
                continue
            for x in ph.launches:
                w = next((a["ptr"] for a in x.args if isinstance(a, dict) and str(a.get("ptr")).endswith(".codes")), "")
                if x.kernel.startswith("gemv_") and w.startswith("layers."):
                    family.setdefault(w, set()).add("streamed" if x.kernel.startswith("gemv_ring") else "per-block")
        assert family and all(len(v) == 1 for v in family.values()), \
            {k: v for k, v in family.items() if len(v) > 1}
        seen[(spec.hidden, gemv)] = {k.split(".")[2]: v.pop() for k, v in family.items() if k.startswith("layers.0.")}
    # (the families themselves: the 8B streamed throughout; where a projection of the normed residual fits one wave of
    # per-block GEMVs its one-row norm is fused into their prologue and it stays per-block at every row count, the
    # 0.6B's qkv and gate_up and the 1.7B-like qkv; the 0.6B's down per-block: K 3072 is not whole stages)
    assert seen[(4096, 4)] == seen[(4096, 8)] == {n: "streamed" for n in ("qkv", "o", "gate_up", "down")}
    assert seen[(2048, 8)] == {"qkv": "per-block", "o": "streamed", "gate_up": "streamed", "down": "streamed"}
    assert seen[(1024, 8)] == {"qkv": "per-block", "o": "streamed", "gate_up": "per-block", "down": "per-block"}
