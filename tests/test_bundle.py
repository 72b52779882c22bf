"""Bundles: byte-identical rebuilds, clear one-line errors for damaged bundles, refusal before
writing when the model cannot fit, and the CLI never showing a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from impc.errors import CompileError
from impc.compile import CompileOptions, compile_model
from imp_runtime.bundle import BundleError, load_bundle


def impc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "impc.cli", *args], capture_output=True, text=True, timeout=600)


def tree_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_two_builds_are_byte_identical(checkpoints, tmp_path):
    ck = checkpoints("qwen3")
    a, b = tmp_path / "a" / "bundle", tmp_path / "b" / "bundle"   # the folder name is the model name
    compile_model(CompileOptions(model=str(ck), out=a, targets="none"))
    compile_model(CompileOptions(model=str(ck), out=b, targets="none"))
    ta, tb = tree_bytes(a), tree_bytes(b)
    assert ta.keys() == tb.keys() and {"manifest.json", "weights.safetensors", "tokenizer.json"} <= ta.keys()
    assert all(ta[k] == tb[k] for k in ta)


@pytest.fixture
def bundle_copy(bundles, tmp_path):
    import shutil
    dst = tmp_path / "bundle"
    shutil.copytree(bundles("llama", "nvfp4"), dst)
    return dst


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete", "manifest", "version"])
def test_damaged_bundle_is_a_one_line_error(bundle_copy, damage):
    weights = bundle_copy / "weights.safetensors"
    manifest = bundle_copy / "manifest.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "corrupt":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "delete":
        (bundle_copy / "tokenizer.json").unlink()
    elif damage == "manifest":
        manifest.write_text(manifest.read_text()[:200])
    elif damage == "version":
        m = json.loads(manifest.read_text())
        m["format_version"] = 999
        manifest.write_text(json.dumps(m))
    with pytest.raises(BundleError):
        load_bundle(bundle_copy)
    r = impc("run", str(bundle_copy), "--prompt", "hi", "--max-tokens", "2")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0]
    expected = {"truncate": "weights.safetensors", "corrupt": "weights.safetensors", "delete": "tokenizer.json",
                "manifest": "manifest.json", "version": "manifest.json"}[damage]
    assert expected in lines[0]


def test_model_too_large_is_refused_before_writing(checkpoints, tmp_path):
    out = tmp_path / "never"
    # A 0.001 GiB GPU cannot hold the 1 GiB runtime reserve, whatever the model.
    with pytest.raises(CompileError, match="does not fit sm_90a"):
        compile_model(CompileOptions(model=str(checkpoints("llama")), out=out, targets="sm_90a", vram_gib=0.001))
    assert not out.exists()
    r = impc("compile", str(checkpoints("llama")), "-o", str(out), "--target", "sm_90a", "--vram", "0.001")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "does not fit" in r.stderr
    assert not out.exists()


def test_plan_forecast_matches_hand_computation(checkpoints, tmp_path):
    """KV bytes per token = 2 (k, v) * layers * kv_heads * head_dim * 2 bytes, computed by hand."""
    out = tmp_path / "b"
    m = compile_model(CompileOptions(model=str(checkpoints("qwen3")), out=out, targets="none", max_context=256))
    assert m["plan"]["kv_bytes_per_token"] == 2 * 3 * 2 * 32 * 2
    assert m["plan"]["max_context"] == 256


@pytest.mark.parametrize("args,needle", [
    (["compile", "/nonexistent/model.gguf", "-o", "OUT"], "no such file"),
    (["compile", "UNSUPPORTED", "-o", "OUT"], "unsupported architecture"),
    (["compile", "CKPT", "-o", "OUT", "--target", "sm_999"], "unknown target"),
    (["compile", "CKPT", "-o", "NOTBUNDLE"], "not an imp bundle"),
    (["run", "/nonexistent/bundle", "--prompt", "x"], "not a bundle directory"),
])
def test_cli_errors_are_clear(args, needle, checkpoints, tmp_path):
    ck = checkpoints("llama")
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (unsupported / "config.json").write_text(json.dumps(cfg))
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (unsupported / f).write_bytes((ck / f).read_bytes())
    notbundle = tmp_path / "notbundle"
    notbundle.mkdir()
    (notbundle / "precious.txt").write_text("keep me")
    subst = {"OUT": str(tmp_path / "out"), "CKPT": str(ck), "UNSUPPORTED": str(unsupported), "NOTBUNDLE": str(notbundle)}
    r = impc(*[subst.get(a, a) for a in args])
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in r.stderr
    assert (notbundle / "precious.txt").read_text() == "keep me"


def test_help_for_every_command():
    for cmd in ("compile", "run", "inspect"):
        r = impc(cmd, "--help")
        assert r.returncode == 0 and "usage: impc " + cmd in r.stdout


def test_inspect_reports_quantization_and_plan(bundles):
    path = bundles("llama", "nvfp4", budget="1")      # all linears in NVFP4 (the default budget widens some)
    r = impc("inspect", str(path))
    assert r.returncode == 0, r.stderr
    m = json.loads((path / "manifest.json").read_text())
    n_nvfp4 = sum(1 for e in m["quantization"]["tensors"].values() if e["format"] == "nvfp4")
    assert n_nvfp4 == 3 * 4          # 3 layers x (qkv, o, gate_up, down)
    assert f"{n_nvfp4} nvfp4" in r.stdout and "KV pages" not in r.stdout   # cpu-only: no GPU plan
    assert "weights.safetensors" in r.stdout


@pytest.mark.slow
def test_cubins_rebuild_byte_identical_from_a_cold_cache(checkpoints, tmp_path, monkeypatch):
    """Emit with nvcc twice, each time with an empty kernel cache: the cubins (and bundles) match."""
    ck = checkpoints("llama")
    trees = []
    for run in ("one", "two"):
        monkeypatch.setenv("IMP_CACHE_DIR", str(tmp_path / f"cache-{run}"))
        out = tmp_path / run / "bundle"
        compile_model(CompileOptions(model=str(ck), out=out, targets="sm_90a,sm_120a"))
        trees.append(tree_bytes(out))
        assert (tmp_path / f"cache-{run}").exists() and any((tmp_path / f"cache-{run}").iterdir())
    assert {"kernels/sm_90a.cubin", "kernels/sm_120a.cubin"} <= trees[0].keys()
    assert trees[0] == trees[1]


def test_sharded_checkpoint_gives_the_same_weights(checkpoints, bundles, tmp_path):
    """A checkpoint saved in several safetensors shards (with an index) compiles to the same tensors."""
    import shutil

    import torch
    import transformers as tf

    src = checkpoints("qwen2")
    sharded = tmp_path / "sharded"
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    out = tmp_path / "b"
    compile_model(CompileOptions(model=str(sharded), out=out, quant="bf16", targets="none"))
    import numpy as np
    a, b = load_bundle(out).float_weights(), load_bundle(bundles("qwen2", "bf16")).float_weights()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_default_prefill_chunk_halves_where_it_does_not_fit():
    """The target's prefill chunk is a default: on a GPU too small for its prefill scratch and one max-context
    sequence, the plan takes the largest halving of it (down to 512) that fits, as the same plan asked for that chunk
    explicitly does; a chunk the user asks for is never changed: it does not fit, and the error names the option."""
    from impc.plan import MIN_DEFAULT_CHUNK, plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec, t = SHAPES["qwen3-8b"], load_target("sm_90a")
    f = default_formats(spec)

    def fits(chunk, vram):
        try:
            plan_memory(spec, f, [t], vram, 32768, 64, prefill_chunk=chunk)
            return True
        except CompileError:
            return False
    candidates = []
    c = t["prefill_chunk"]
    while c >= MIN_DEFAULT_CHUNK:
        candidates.append(c)
        c //= 2
    # the smallest VRAM (0.25 GiB steps) where the largest chunk does not fit but a smaller one does
    vram = next(v / 4 for v in range(40, 800) if fits(candidates[-1], v / 4))
    while fits(candidates[0], vram) or not fits(candidates[-1], vram):
        vram += 0.25
    want = next(c for c in candidates if fits(c, vram))
    assert want < t["prefill_chunk"]
    assert plan_memory(spec, f, [t], vram, 32768, 64)["targets"]["sm_90a"]["prefill_chunk"] == want
    with pytest.raises(CompileError, match="--prefill-chunk"):
        plan_memory(spec, f, [t], vram, 32768, 64, prefill_chunk=t["prefill_chunk"])


def test_prefill_chunk_option(checkpoints, tmp_path):
    """--prefill-chunk N: the most prompt tokens one prefill call takes, planned for each target (the program's
    largest prefill phase) and for a cpu-only bundle; a prompt prefilled in chunks of 16 gives the logits of the
    same prompt in one call (the chunks attend to the KV the earlier ones cached). 0 is a one-line error."""
    import numpy as np
    from imp_runtime.executor_cpu import CpuExecutor
    from imp_runtime.kv_blocks import SoloSequence
    from impc.plan import plan_memory
    from impc.targets import load_target
    from tests.test_templates_compile import SHAPES, default_formats
    spec, t = SHAPES["qwen3-8b"], load_target("sm_90a")
    f = default_formats(spec)
    assert plan_memory(spec, f, [t], None, 8192, 64)["targets"]["sm_90a"]["prefill_chunk"] == t["prefill_chunk"]
    assert plan_memory(spec, f, [t], None, 8192, 64, prefill_chunk=4096)["targets"]["sm_90a"]["prefill_chunk"] == 4096
    assert plan_memory(spec, f, [t], None, 1000, 64, prefill_chunk=4096)["targets"]["sm_90a"]["prefill_chunk"] == 1000
    logits = {}
    for chunk in (None, 16):
        out = tmp_path / f"c{chunk}"
        compile_model(CompileOptions(model=str(checkpoints("qwen3")), out=out, targets="none", max_context=256,
                                     prefill_chunk=chunk))
        ex = CpuExecutor(load_bundle(out))
        assert ex.prefill_chunk == (16 if chunk else 256)
        tokens = np.random.default_rng(5).integers(4, ex.spec.vocab_size, 50).tolist()
        logits[chunk] = SoloSequence(ex).prefill(tokens, all_logits=True)
    np.testing.assert_allclose(logits[16], logits[None], rtol=1e-4, atol=1e-4)
    r = impc("compile", str(checkpoints("qwen3")), "-o", str(tmp_path / "bad"), "--target", "none", "--prefill-chunk", "0")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--prefill-chunk must be at least 1" in r.stderr
