"""Calibrated NVFP4 and the byte budget: the compiler's own forward against the cpu executor, the
calibration data, calibration beating plain rounding, the budget never exceeded, and byte-identical
rebuilds with calibration on."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impc.budget import Budget, candidates, choose_formats, parse_budget
from impc.calibrate import calibration_set
from impc.cli_eval import BundleModel, compare
from impc.compile import CompileOptions, compile_model, tensor_formats
from impc.errors import CompileError
from impc.forward import embed, layer_forward, layer_weights, log_probs, log_softmax_rows
from impc.plan import tensor_bytes, weights_bytes
from imp_runtime.bundle import load_bundle
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import SoloSequence
from tests.conftest import VOCAB

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


def random_words(path: Path, n: int, seed: int) -> Path:
    """Text for the tiny models' word-level tokenizer (w4 .. w383), in runs so that it has structure."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(4, VOCAB, rng.integers(3, 9)) for _ in range(40)]
    words: list[str] = []
    while len(words) < n:
        words += [f"w{i}" for i in phrases[rng.integers(len(phrases))]]
    path.write_text(" ".join(words[:n]))
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    return {"calib": random_words(root / "calib.txt", 3000, seed=1), "eval": random_words(root / "eval.txt", 1200, seed=2)}


def tiny_tokens(path: Path) -> list[int]:
    return [int(w[1:]) for w in path.read_text().split()]


# ------------------------------------------------------------------ the compiler's forward

@pytest.mark.parametrize("family", FAMILIES)
def test_compiler_forward_matches_cpu_executor(family, bundles):
    """impc/forward.py (layer by layer over chunks) against the cpu executor on the same bundle."""
    b = load_bundle(bundles(family, "bf16"))
    w = b.float_weights()
    chunks = np.random.default_rng(3).integers(4, VOCAB, (2, 40))
    x = embed(b.spec, w["embed"], chunks)
    for i in range(b.spec.n_layers):
        x = layer_forward(b.spec, i, layer_weights(w, i), x)
    got = log_probs(b.spec, w, x)
    ex = CpuExecutor(b)
    ref = np.concatenate([log_softmax_rows(SoloSequence(ex).prefill(c.tolist(), all_logits=True)) for c in chunks])
    assert np.max(np.abs(got - ref)) < 1e-4



@pytest.mark.parametrize("window", [0, 37, 1000])
def test_blocked_causal_attention_equals_the_kernel_reference(window):
    """forward.causal_attention (query blocks, keys cut to what each block may see) against the cpu
    executor's attention, with GQA, a ragged last block and a window shorter than a block."""
    from imp_runtime.executor_cpu import attention
    from impc.forward import QUERY_BLOCK, causal_attention

    rng = np.random.default_rng(7)
    t = 2 * QUERY_BLOCK + 22
    q, k, v = (rng.standard_normal((t, h, 32), dtype=np.float32) * 2 for h in (6, 2, 2))
    want = attention(q, k, v, np.arange(t), 0.17, window)
    np.testing.assert_allclose(causal_attention(q, k, v, 0.17, window), want, rtol=0, atol=2e-5)


def test_in_place_silu_is_the_reference_bit_for_bit():
    from imp_runtime.executor_cpu import gated_act
    from impc.forward import gated_activation

    x = np.random.default_rng(8).standard_normal((33, 2 * 48), dtype=np.float32) * 6
    for act in ("silu", "gelu_tanh"):
        assert np.array_equal(gated_activation(x, act), gated_act(x, act))

# ------------------------------------------------------------------ calibration data

def test_calibration_set_tokenizes_prose_then_rendered_chats(checkpoints, tmp_path):
    from impc.checkpoint import load_checkpoint

    ck = load_checkpoint(str(checkpoints("llama")))
    info = {**ck.special_tokens, "eos_token_ids": ck.eos_token_ids, "add_bos": ck.add_bos}
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([[{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]] * 8))
    cs = calibration_set(ck.tokenizer_json, info, ck.chat_template, str(chats), chunk_tokens=4)
    # the tiny template renders "user: w5 w6\nassistant: w7\n"; "user:", "assistant:" are unknown words (id 3)
    assert cs.chunks.shape == (10, 4) and cs.source == "chats.json"            # 8 x 5 tokens
    assert cs.chunks.reshape(-1).tolist()[:6] == [3, 5, 6, 3, 7, 3]
    prose = random_words(tmp_path / "p.txt", 100, seed=4)
    cs = calibration_set(ck.tokenizer_json, info, ck.chat_template, str(prose), chunk_tokens=32)
    assert cs.chunks.shape == (3, 32) and cs.chunks.reshape(-1).tolist() == tiny_tokens(prose)[:96]


def test_builtin_calibration_data_is_prose_and_chats(checkpoints):
    from impc.calibrate import BUILTIN_CHATS, BUILTIN_TEXT

    chats = json.loads(BUILTIN_CHATS.read_text())
    assert len(BUILTIN_TEXT.read_text().split()) > 2000 and len(chats) >= 20
    assert all(m["role"] in ("system", "user", "assistant") for c in chats for m in c)


@pytest.mark.parametrize("content, message", [
    ("not json", "list of conversations"), ('[{"role": "user"}]', "list of conversations")])
def test_bad_calibration_file_is_one_clear_error(tmp_path, content, message):
    f = tmp_path / "c.json"
    f.write_text(content)
    with pytest.raises(CompileError, match=message):
        calibration_set("", {}, None, str(f))
    with pytest.raises(CompileError, match="cannot read"):
        calibration_set("", {}, None, str(tmp_path / "missing.txt"))


# ------------------------------------------------------------------ calibration helps

def test_calibration_beats_rounding_on_text_it_did_not_see(checkpoints, texts, tmp_path):
    """Pure NVFP4 (budget 1): GPTQ on the calibration text gives a lower KL to the bf16 bundle than
    rounding to nearest, measured on different text."""
    ck = str(checkpoints("llama"))
    out = {}
    for name, kw in {"bf16": dict(quant="bf16"), "rtn": dict(calibrate=False),
                     "gptq": dict(calib=str(texts["calib"]), budget="1")}.items():
        out[name] = tmp_path / name
        compile_model(CompileOptions(model=ck, out=out[name], targets="none", **kw))
    ids = tiny_tokens(texts["eval"])
    ref = BundleModel(load_bundle(out["bf16"]))
    rtn = compare(BundleModel(load_bundle(out["rtn"])), ref, ids, 200)
    gptq = compare(BundleModel(load_bundle(out["gptq"])), ref, ids, 200)
    assert gptq.kl < 0.8 * rtn.kl, (gptq, rtn)
    m = json.loads((out["gptq"] / "manifest.json").read_text())["quantization"]
    assert m["calibration"]["source"] == "calib.txt" and m["calibration"]["budget"]["widened"] == []
    assert all(e["format"] == "nvfp4" and 0 < e["out_err"] < 0.2
               for n, e in m["tensors"].items() if n.startswith("layers.") and "norm" not in n)


# ------------------------------------------------------------------ GPTQ's pieces

def test_e2m1_codes_equal_round_to_nearest_even():
    """The table rounding GPTQ uses against quantize.round_e2m1 (searchsorted on the decision points)
    and against hand-written codes at every tie and around it, and far past the table's end (saturation),
    as codes and as the scale search's magnitudes."""
    from impc.gptq import e2m1_magnitude_values_of_quarters
    from imp_runtime.nvfp4 import E2M1_VALUES
    from impc.gptq import e2m1_codes
    from impc.quantize import round_e2m1

    # ties: .25 -> 0 (code 0), .75 -> 1 (2), 1.25 -> 1 (2), 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0])
    assert e2m1_codes(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 0]
    assert e2m1_codes(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14, 15, 15, 0]
    rng = np.random.default_rng(0)
    x = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 9), rng.standard_normal(20000) * 3,
                        rng.integers(-60, 60, 2000) / 8.0, rng.integers(-100, 100, 2000) / 4.0,
                        [5.25, 5.5, 1e6, 1e300, np.inf, 1e-300]])
    x = np.concatenate([x, -x])
    assert np.array_equal(e2m1_codes(x), round_e2m1(x))
    a = np.abs(x)
    assert np.array_equal(e2m1_magnitude_values_of_quarters(a * 4), E2M1_VALUES[round_e2m1(a)])


def test_gptq_over_several_lazy_blocks_matches_float64_reference_and_reports_its_error():
    """K spanning three lazy blocks (the earlier blocks' feedback as one product, within a block one
    column at a time): the same values as the paper's update written in float64 (tests/test_quantize.py's
    reference); and, with padding and a dead channel too, the weighted error it reports is tr(D H D^T)
    of its result."""
    from impc.gptq import DAMP, LAZY_BLOCK, gptq_nvfp4_with_error
    from tests.test_quantize import correlated_inputs, reference_gptq

    rng = np.random.default_rng(11)
    n, k = 10, 2 * LAZY_BLOCK + 48
    x = correlated_inputs(rng, 600, k)
    h = x.T @ x
    w = rng.standard_normal((n, k))
    res = gptq_nvfp4_with_error(w, h, act_order=True, scale_search=False)
    order = sorted(range(k), key=lambda j: (-h[j, j], j))
    np.testing.assert_allclose(res.tensor.dequantize(), reference_gptq(w, h, DAMP, order), rtol=2e-7, atol=0)
    for kk, dead in ((k, None), (k - 9, 7)):            # k - 9: padded to a multiple of 16
        xx = x[:, :kk].copy()
        if dead is not None:
            xx[:, dead] = 0.0
        hh, ww = xx.T @ xx, w[:, :kk]
        res = gptq_nvfp4_with_error(ww, hh)
        d = ww - res.tensor.dequantize()
        assert res.weighted_error == pytest.approx(float(np.trace(d @ hh @ d.T)), rel=1e-6)



def test_hessian_factor_of_an_order_is_that_of_the_permuted_matrix_and_gptq_leaves_its_inputs():
    """hessian_factor(h, order) gathers the reversed order itself: bit for bit the factor of H with its
    rows and columns permuted beforehand (dead channel included), and H is only read; nor does GPTQ
    change the W and H it is given."""
    from impc.gptq import gptq_nvfp4_with_error, hessian_factor
    from tests.test_quantize import correlated_inputs

    rng = np.random.default_rng(12)
    x = correlated_inputs(rng, 300, 48)
    x[:, 3] = 0.0
    h = x.T @ x
    order = np.argsort(-np.diag(h), kind="stable")
    h0 = h.copy()
    a = hessian_factor(h, order=order)
    assert np.array_equal(h, h0)
    b = hessian_factor(h[np.ix_(order, order)].copy())
    assert a.damping == b.damping and np.array_equal(a.dead, b.dead) and a.dead.sum() == 1
    assert a.feedback.tobytes() == b.feedback.tobytes() and a.r_diag.tobytes() == b.r_diag.tobytes()
    assert a.feedback.flags.c_contiguous
    w = rng.standard_normal((7, 48))
    w0 = w.copy()
    gptq_nvfp4_with_error(w, h)
    assert np.array_equal(w, w0) and np.array_equal(h, h0)

# ------------------------------------------------------------------ the byte budget

def tiny_spec():
    from impc.families import family_for
    from tests.conftest import tiny_config

    cfg = tiny_config("llama").to_dict()
    return family_for(cfg).spec(cfg)


@settings(max_examples=60, deadline=None)
@given(sens=st.lists(st.floats(0, 1, allow_nan=False), min_size=12, max_size=12),
       factor=st.floats(1.0, 3.0))
def test_budget_is_never_exceeded(sens, factor):
    spec = tiny_spec()
    formats = tensor_formats(spec, CompileOptions(model="x", out=Path("x")))
    cands = candidates(formats)
    choice = choose_formats(spec, formats, Budget(factor=factor), dict(zip(cands, sens)))
    assert choice.weights_bytes == weights_bytes(spec, choice.formats) <= choice.budget_bytes
    # the factor applies to the weights with the head counted bf16 (the INT8 head's saved bytes go to the body)
    assert formats["lm_head"] == "int8"
    assert choice.budget_bytes == int(factor * weights_bytes(spec, {**formats, "lm_head": "bf16"}))
    assert set(choice.widened) == {t for t, f in choice.formats.items() if f != formats[t]}
    # nothing left out fits in what remains while being worth more per byte than something taken
    shapes = spec.tensor_shapes()
    extra = {t: tensor_bytes(shapes[t], "bf16") - tensor_bytes(shapes[t], "nvfp4") for t in cands}
    left = choice.budget_bytes - choice.weights_bytes
    for t, s in zip(cands, sens):
        if t not in choice.widened and s > 0 and extra[t] <= left:
            pytest.fail(f"{t} fits in the {left} bytes left but was not widened")


def test_budget_picks_the_most_sensitive_per_byte_by_hand():
    spec = tiny_spec()
    formats = tensor_formats(spec, CompileOptions(model="x", out=Path("x"), head_format="bf16"))
    base = weights_bytes(spec, formats)
    # tiny llama: qkv [128, 64] costs 128*64*2 - (128*32 + 128*4 + 4) = 11772 bytes more in bf16,
    # down [64, 160] 64*160*2 - (64*80 + 64*10 + 4) = 14716
    sens = {"layers.0.qkv": 0.010, "layers.1.down": 0.012, "layers.2.o": 0.0}
    choice = choose_formats(spec, formats, Budget(gib=(base + 11772 + 14716) / 2**30), sens)
    assert choice.widened == ["layers.0.qkv", "layers.1.down"]      # 0.010/11772 > 0.012/14716
    choice = choose_formats(spec, formats, Budget(gib=(base + 14716) / 2**30), sens)
    assert choice.widened == ["layers.0.qkv"]                        # the best ratio first; down no longer fits
    choice = choose_formats(spec, formats, Budget(gib=(base + 11771) / 2**30), sens)
    assert choice.widened == []                                      # one byte short of anything
    assert choose_formats(spec, formats, Budget(factor=1.0), sens).widened == []
    # the default INT8 head [384, 64] is budgeted as bf16: 384*64*2 - (384*64 + 4*384) = 23040 bytes it saves go to
    # the body at factor 1.0: qkv (11772) fits, then down (14716) no longer does
    formats = tensor_formats(spec, CompileOptions(model="x", out=Path("x")))
    assert formats["lm_head"] == "int8"
    assert choose_formats(spec, formats, Budget(factor=1.0), sens).widened == ["layers.0.qkv"]


@pytest.mark.parametrize("text, want", [("1.3", Budget(factor=1.3)), ("2x", Budget(factor=2.0)),
                                        ("0.25GiB", Budget(gib=0.25)), ("1g", Budget(gib=1.0))])
def test_parse_budget(text, want):
    assert parse_budget(text) == want


@pytest.mark.parametrize("text", ["0.9", "abc", "", "-1"])
def test_parse_budget_refuses(text):
    with pytest.raises(CompileError, match="--budget"):
        parse_budget(text)


@pytest.fixture(scope="module")
def budget_bundle(checkpoints, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "bundle"
    compile_model(CompileOptions(model=str(checkpoints("llama")), out=out, targets="none", calib=str(texts["calib"]),
                                 budget="1.15"))
    return out


def test_budget_bundle_stores_its_choice_within_the_budget(budget_bundle, checkpoints):
    from safetensors.numpy import load_file

    m = json.loads((budget_bundle / "manifest.json").read_text())
    rec = m["quantization"]["calibration"]["budget"]
    formats = {n: e["format"] for n, e in m["quantization"]["tensors"].items()}
    widened = [n for n, f in formats.items() if f == "bf16" and n.startswith("layers.")]
    assert widened and sorted(widened) == sorted(rec["widened"])
    stored = sum(a.nbytes for a in load_file(budget_bundle / "weights.safetensors").values())
    # the bytes actually stored are what the plan counted, and within 1.15x the all-NVFP4 bytes
    assert stored == m["plan"]["weights_bytes"] == rec["weights_bytes"] <= rec["budget_bytes"]
    # 1.15x the all-NVFP4 bytes with the head counted bf16 (the INT8 head's saved bytes go to the body)
    n, k = m["quantization"]["tensors"]["lm_head"]["shape"]
    assert m["quantization"]["tensors"]["lm_head"]["format"] == "int8"
    assert rec["budget_bytes"] == int(1.15 * (rec["base_bytes"] + 2 * n * k - (n * k + 4 * n)))
    # a widened tensor holds the checkpoint's values rounded to bf16 (torch's rounding)
    import torch
    from safetensors.torch import load_file as load_torch

    ck = load_torch(Path(checkpoints("llama")) / "model.safetensors")
    layer, name = widened[0].split(".")[1], widened[0].split(".")[2]
    hf = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
          "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}[name]
    want = torch.cat([ck[f"model.layers.{layer}.{h}.weight"] for h in hf]).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(load_bundle(budget_bundle).float_weights()[widened[0]], want)
    # the most sensitive tensor per extra byte is among the widened
    tensors = m["quantization"]["tensors"]
    assert all("kl_alone" in tensors[n] for n in widened)


def test_budget_sensitivities_are_each_tensors_kl_alone(budget_bundle, bundles, checkpoints, texts):
    """The KLs the budget measured (on worker threads, alongside GPTQ), recomputed from scratch in
    float64: the bf16 bundle with only that tensor replaced by the calibrated bundle's stored NVFP4
    values, over the same calibration tokens."""
    from impc.budget import sensitivity_chunks
    from impc.checkpoint import load_checkpoint
    from impc.forward import mean_kl

    m = json.loads((budget_bundle / "manifest.json").read_text())["quantization"]["tensors"]
    ck = load_checkpoint(str(checkpoints("llama")))
    info = {**ck.special_tokens, "eos_token_ids": ck.eos_token_ids, "add_bos": ck.add_bos}
    chunks = sensitivity_chunks(calibration_set(ck.tokenizer_json, info, ck.chat_template, str(texts["calib"])).chunks)
    ref = load_bundle(bundles("llama", "bf16"))
    ref_w, got_w = ref.float_weights(), load_bundle(budget_bundle).float_weights()

    def run(w):
        x = embed(ref.spec, w["embed"], chunks)
        for i in range(ref.spec.n_layers):
            x = layer_forward(ref.spec, i, layer_weights(w, i), x)
        return log_probs(ref.spec, w, x)

    ref_logp = run(ref_w)
    kept = [n for n, e in m.items() if e["format"] == "nvfp4" and "kl_alone" in e]
    assert len(kept) >= 4
    for name in kept[:2] + kept[-2:]:                  # first and last layers
        kl = mean_kl(ref_logp, run({**ref_w, name: got_w[name]}))
        assert m[name]["kl_alone"] == pytest.approx(kl, rel=2e-3, abs=2e-6), name


def test_budget_bundle_runs_on_cpu_executor_like_transformers(budget_bundle, checkpoints):
    """Mixed nvfp4/bf16 linears: the cpu executor against transformers on the bundle's values."""
    from tests.test_families import dequantized_state_dict, hf_logits, hf_model, imp_logits, rel_err, tokens_for

    model = hf_model(checkpoints("llama"), dequantized_state_dict(budget_bundle, "llama"))
    tokens = tokens_for(model.config.vocab_size, seed=5)
    assert rel_err(imp_logits(budget_bundle, tokens), hf_logits(model, tokens)) <= 1e-3


def test_calibrated_rebuild_is_byte_identical(budget_bundle, checkpoints, texts, tmp_path):
    again = tmp_path / "bundle"      # the folder name is the model name
    compile_model(CompileOptions(model=str(checkpoints("llama")), out=again, targets="none", calib=str(texts["calib"]),
                                 budget="1.15"))
    files = sorted(p.relative_to(budget_bundle) for p in budget_bundle.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for f in files:
        assert (budget_bundle / f).read_bytes() == (again / f).read_bytes(), f


def test_cli_budget_and_calib_errors_are_one_line(checkpoints, tmp_path):
    for args, message in [(["--budget", "0.5"], "--budget"), (["--calib", str(tmp_path / "none.txt")], "--calib")]:
        r = subprocess.run([sys.executable, "-m", "impc.cli", "compile", str(checkpoints("llama")), "-o",
                            str(tmp_path / "b"), "--target", "none", "-q", *args], capture_output=True, text=True)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
