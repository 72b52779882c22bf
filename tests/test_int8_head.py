"""The INT8 output head (`--head-format int8`, runtime/int8.py): the quantizer against hand-worked values
and a plain-Python float64 definition; a compiled bundle's stored arrays, plan bytes and arena entries; the
cpu executor's logits against transformers' final hidden states times the stored head; the refusals."""
from __future__ import annotations

import numpy as np
import pytest

from impc.compile import CompileOptions, compile_model
from impc.errors import CompileError
from impc.quantize import quantize_int8_rows
from imp_runtime.bundle import load_bundle
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import SoloSequence

PROMPT_LEN, DECODE_STEPS = 24, 4


def reference_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The contract element by element in Python floats (float64): rscale = float32(amax / 127), code =
    round(w / rscale) (Python's round: half to even), clipped to +-127; a zero row gets 0 and 0."""
    codes = np.zeros(w.shape, np.int64)
    rscale = np.zeros(w.shape[0], np.float32)
    for n, row in enumerate(np.asarray(w, np.float32).tolist()):
        amax = max(abs(v) for v in row)
        s = np.float32(amax / 127.0)
        rscale[n] = s
        if float(s) == 0.0:
            continue
        for k, v in enumerate(row):
            codes[n, k] = max(-127, min(127, round(v / float(s))))
    return codes, rscale


# ------------------------------------------------------------------ the quantizer


def test_hand_worked_rows():
    w = np.array([[127.0, 2.5, -3.5, 0.5],          # amax 127: scale 1; 2.5 -> 2, -3.5 -> -4, 0.5 -> 0 (even)
                  [0.0, 0.0, 0.0, 0.0],             # a zero row: scale 0, codes 0
                  [-63.5, -1.25, 0.75, 0.2]],       # amax 63.5: scale 0.5; -2.5 -> -2, 1.5 -> 2, 0.4 -> 0
                 np.float32)
    q = quantize_int8_rows(w)
    assert q.codes.dtype == np.int8 and q.codes.shape == (3, 4)
    assert q.rscale.dtype == np.float32 and q.rscale.shape == (3,)
    assert q.codes.tolist() == [[127, 2, -4, 0], [0, 0, 0, 0], [-127, -2, 2, 0]]
    assert q.rscale.tolist() == [1.0, 0.0, 0.5]
    deq = q.dequantize()
    assert deq.dtype == np.float32
    assert deq.tolist() == [[127.0, 2.0, -4.0, 0.0], [0.0] * 4, [-63.5, -1.0, 1.0, 0.0]]


def test_random_against_python_definition():
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((40, 96)) * rng.uniform(1e-3, 3, (40, 1))).astype(np.float32)
    w[3] = 0.0                                                  # a zero row
    w[5, 10] = -50.0                                            # an outlier: most of its row rounds to 0
    # rows whose scale is a power of two (amax 127 * 2^-3): every (j + 1/2) * 2^-3 is an exact tie
    for r in (7, 8):
        w[r] = (rng.integers(-127, 127, 96) + 0.5) * 0.125
        w[r, 0] = 127 * 0.125 * (1 if r == 7 else -1)
    codes, rscale = reference_int8(w)
    q = quantize_int8_rows(w)
    assert np.array_equal(q.rscale, rscale)                     # bit for bit
    assert np.array_equal(q.codes.astype(np.int64), codes)
    assert np.sum(np.abs(w[7:9] / 0.125 % 1) == 0.5) > 100      # the ties were ties
    # a few rows at a time gives the same answer
    q2 = quantize_int8_rows(w, rows_at_once=7)
    assert np.array_equal(q2.codes, q.codes) and np.array_equal(q2.rscale, q.rscale)
    # de-quantized: the float32 product, within half a step of W
    deq = q.dequantize()
    assert np.array_equal(deq, codes.astype(np.float32) * rscale[:, None])
    assert np.all(np.abs(deq.astype(np.float64) - w) <= rscale[:, None].astype(np.float64) * (0.5 + 1e-6))


# ------------------------------------------------------------------ a compiled bundle


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory, checkpoints):
    """The untied tiny llama: --quant bf16 (the reference) and --quant bf16 --head-format int8 (through the CLI)."""
    from impc.cli import main
    root = tmp_path_factory.mktemp("int8head")
    ck = checkpoints("llama")
    ref, q8 = root / "bf16", root / "int8"
    compile_model(CompileOptions(model=str(ck), out=ref, quant="bf16", targets="none", max_context=256))
    assert main(["compile", str(ck), "-o", str(q8), "--quant", "bf16", "--head-format", "int8", "--target", "none",
                 "--max-context", "256", "-q"]) == 0
    return ck, load_bundle(ref), load_bundle(q8)


def test_bundle_stores_the_head_in_int8(llama_pair):
    _, ref, b = llama_pair
    n, k = b.spec.vocab_size, b.spec.hidden
    assert b.manifest["quantization"]["lm_head"] == "int8"
    assert b.manifest["build"]["options"]["head_format"] == "int8"
    assert b.manifest["build"]["options"]["quant_head"] is False
    entry = b.tensors["lm_head"]
    assert entry["format"] == "int8" and entry["shape"] == [n, k]
    # every other tensor as --quant bf16 stores it
    assert {t: e["format"] for t, e in b.tensors.items() if t != "lm_head"} == \
           {t: e["format"] for t, e in ref.tensors.items() if t != "lm_head"}
    assert ref.tensors["lm_head"]["format"] == "bf16"

    raw = b.raw_weights()
    assert "lm_head" not in raw
    codes, rscale = raw["lm_head.codes"], raw["lm_head.rscale"]
    assert codes.dtype == np.int8 and codes.shape == (n, k)
    assert rscale.dtype == np.float32 and rscale.shape == (n,)
    # the checkpoint's head (a bf16 checkpoint: the bf16 bundle holds its exact values) by the definition
    want_codes, want_rscale = reference_int8(ref.float_weights()["lm_head"])
    assert np.array_equal(rscale, want_rscale)
    assert np.array_equal(codes.astype(np.int64), want_codes)
    # what the runtime computes with: numpy's own codes * rscale of the stored arrays
    head = b.float_weights()["lm_head"]
    assert head.dtype == np.float32
    assert np.array_equal(head, codes.astype(np.float32) * rscale.reshape(n, 1))
    # the recorded error is that of these values
    w = ref.float_weights()["lm_head"].astype(np.float64)
    rel = np.linalg.norm(head - w) / np.linalg.norm(w)
    assert entry["rel_rms"] == pytest.approx(rel, abs=2e-6) and 0 < rel < 0.02
    assert entry["max_abs"] == pytest.approx(np.max(np.abs(head - w)), rel=1e-6)


def test_plan_and_arena_bytes(llama_pair):
    from impc.arena_layout import arena_entries
    from impc.plan import tensor_bytes
    from imp_runtime.activation_formats import XF_F16, XF_F16X2, gfmt, xfmt

    _, ref, b = llama_pair
    n, k = b.spec.vocab_size, b.spec.hidden
    assert tensor_bytes((n, k), "int8") == n * k + 4 * n
    # the plan's weights are the bytes stored; the head's share is n*k + 4n against bf16's 2nk
    for bundle in (ref, b):
        assert bundle.manifest["plan"]["weights_bytes"] == sum(a.nbytes for a in bundle.raw_weights().values())
    assert ref.manifest["plan"]["weights_bytes"] - b.manifest["plan"]["weights_bytes"] == 2 * n * k - (n * k + 4 * n)

    formats = {t: e["format"] for t, e in b.tensors.items()}
    entries = arena_entries(b.spec, formats, rows=4, logit_rows=2, max_seqs=3, max_pages=4, page=16, kv_pages=8)
    heads = [e for e in entries if e[0].startswith("lm_head")]
    assert heads == [("lm_head.codes", "weight", "u8", (n, k), n * k, None),
                     ("lm_head.rscale", "weight", "f32", (n,), 4 * n, None)]
    # in the arena's order, the weight entries are the bundle's arrays byte for byte
    raw = b.raw_weights()
    assert [(e[0], e[4]) for e in entries if e[1] == "weight"] == [(key, raw[key].nbytes) for key in
                                                                  [e[0] for e in entries if e[1] == "weight"]]
    assert sum(e[4] for e in entries if e[1] == "weight") == b.manifest["plan"]["weights_bytes"]
    assert xfmt("int8") == XF_F16X2 and gfmt("int8") == XF_F16


def _executor_logits(bundle, tokens: list[int]) -> np.ndarray:
    seq = SoloSequence(CpuExecutor(bundle))
    rows = [seq.prefill(tokens[:PROMPT_LEN], all_logits=True)]
    for t in tokens[PROMPT_LEN:]:
        rows.append(seq.decode(t))
    return np.concatenate(rows)


def test_cpu_logits_use_the_int8_head(llama_pair):
    import torch
    import transformers as tf

    ck, ref, b = llama_pair
    tokens = np.random.default_rng(3).integers(4, b.spec.vocab_size, PROMPT_LEN + DECODE_STEPS).tolist()
    got = _executor_logits(b, tokens)
    base = _executor_logits(ref, tokens)

    # oracle: transformers' final hidden states (after the final norm) on the checkpoint's values, which are
    # the bf16 body's exactly, times the head de-quantized here from the stored arrays
    model = tf.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        h = model.model(torch.tensor([tokens])).last_hidden_state[0].numpy().astype(np.float64)
    raw = b.raw_weights()
    head = raw["lm_head.codes"].astype(np.float64) * raw["lm_head.rscale"].astype(np.float64)[:, None]
    want = h @ head.T
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))

    # against the bf16 head on the same body: the difference is h @ (Q - W).T, bounded by the rounding
    # error's size (|Q - W| <= rscale / 2 a row), and not zero
    w = ref.float_weights()["lm_head"].astype(np.float64)
    diff = np.abs(got.astype(np.float64) - base)
    exact_bound = np.abs(h) @ np.abs(head - w).T
    row_bound = np.abs(h).sum(axis=1, keepdims=True) * raw["lm_head.rscale"].astype(np.float64)[None, :] / 2
    slack = 1e-4 * np.max(np.abs(base))          # the two runs' float32 rounding
    assert np.all(diff <= exact_bound + slack)
    assert np.all(exact_bound <= row_bound * (1 + 1e-9))
    assert np.max(diff) > 10 * slack              # the executor did use the INT8 head
    assert np.mean(np.argmax(got, 1) == np.argmax(base, 1)) >= 0.9


def test_nvfp4_body_leaves_the_int8_head_alone(llama_pair, tmp_path):
    """The calibrated NVFP4 path (GPTQ, byte budget): the head stays INT8, rounded from the checkpoint as
    with a bf16 body: neither GPTQ'd nor a budget candidate."""
    ck, ref, _ = llama_pair
    m = compile_model(CompileOptions(model=str(ck), out=tmp_path / "b", targets="none", max_context=256,
                                     head_format="int8"))
    b = load_bundle(tmp_path / "b")
    assert m["quantization"]["lm_head"] == "int8" and b.tensors["lm_head"]["format"] == "int8"
    assert any(e["format"] == "nvfp4" for e in b.tensors.values())
    cal = m["quantization"]["calibration"]
    assert cal is not None and "lm_head" not in cal["budget"]["widened"]
    assert "out_err" not in b.tensors["lm_head"] and "kl_alone" not in b.tensors["lm_head"]
    raw = b.raw_weights()
    want_codes, want_rscale = reference_int8(ref.float_weights()["lm_head"])
    assert np.array_equal(raw["lm_head.rscale"], want_rscale)
    assert np.array_equal(raw["lm_head.codes"].astype(np.int64), want_codes)



# ------------------------------------------------------------------ a tied head's INT8 copy


def test_tied_head_stored_as_an_int8_copy(checkpoints, tmp_path):
    """--head-format int8 on a tied model: the table stays bf16 for the lookups and an INT8 copy of it is the head
    (an untied bundle); the cpu executor's logits are transformers' final hidden states times that copy."""
    import torch
    import transformers as tf

    ck = checkpoints("llama_tied")
    tied = compile_model(CompileOptions(model=str(ck), out=tmp_path / "tied", quant="bf16", targets="none",
                                        max_context=256))
    m = compile_model(CompileOptions(model=str(ck), out=tmp_path / "copy", quant="bf16", targets="none",
                                     max_context=256, head_format="int8"))
    assert tied["model"]["tie_embeddings"] is True and tied["quantization"]["lm_head"] == "tied"
    assert m["model"]["tie_embeddings"] is False and m["quantization"]["head_copy_of_embed"] is True
    ref, b = load_bundle(tmp_path / "tied"), load_bundle(tmp_path / "copy")
    assert b.tensors["lm_head"]["format"] == "int8" and b.tensors["embed"]["format"] == "bf16"
    table = ref.float_weights()["embed"]
    assert np.array_equal(b.float_weights()["embed"], table)
    raw = b.raw_weights()
    want_codes, want_rscale = reference_int8(table)
    assert np.array_equal(raw["lm_head.rscale"], want_rscale)
    assert np.array_equal(raw["lm_head.codes"].astype(np.int64), want_codes)
    # the memory plan holds the copy beside the table
    n, k = b.spec.vocab_size, b.spec.hidden
    assert b.manifest["plan"]["weights_bytes"] - ref.manifest["plan"]["weights_bytes"] == n * k + 4 * n

    tokens = np.random.default_rng(5).integers(4, n, PROMPT_LEN + DECODE_STEPS).tolist()
    got = _executor_logits(b, tokens)
    model = tf.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        h = model.model(torch.tensor([tokens])).last_hidden_state[0].numpy().astype(np.float64)
    head = raw["lm_head.codes"].astype(np.float64) * raw["lm_head.rscale"].astype(np.float64)[:, None]
    want = h @ head.T
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
    base = _executor_logits(ref, tokens)            # the tied bf16 head: close, and not the same
    assert 0 < np.max(np.abs(got - base)) and np.mean(np.argmax(got, 1) == np.argmax(base, 1)) >= 0.9


def test_tied_head_copy_leaves_the_body_budget_alone(checkpoints, tmp_path):
    """Calibrated NVFP4 with a budget factor: the copy's bytes are added to the tied model's budget, so the body
    keeps in bf16 exactly the tensors it keeps with the table as the head (the copy changes the head alone)."""
    ck = checkpoints("llama_tied")
    opts = dict(targets="none", max_context=256, budget="1.2")
    tied = compile_model(CompileOptions(model=str(ck), out=tmp_path / "tied", **opts))
    m = compile_model(CompileOptions(model=str(ck), out=tmp_path / "copy", head_format="int8", **opts))
    bt, bc = tied["quantization"]["calibration"]["budget"], m["quantization"]["calibration"]["budget"]
    assert bt["widened"] and bc["widened"] == bt["widened"]
    spec = load_bundle(tmp_path / "copy").spec
    n, k = spec.vocab_size, spec.hidden
    copy = n * k + 4 * n
    assert bc["budget_bytes"] == bt["budget_bytes"] + copy and bc["base_bytes"] == bt["base_bytes"] + copy
    assert bc["weights_bytes"] == bt["weights_bytes"] + copy

# ------------------------------------------------------------------ options and refusals


def test_options_agree():
    assert CompileOptions(model="m", out="o", quant_head=True).head_format == "nvfp4"
    assert CompileOptions(model="m", out="o", head_format="nvfp4").quant_head is True
    assert CompileOptions(model="m", out="o").head_format == "auto"


def test_refusals(checkpoints, tmp_path, capsys):
    from impc.cli import main

    with pytest.raises(CompileError, match=r"--head-format int8 with --quant-embed: .*tied"):
        compile_model(CompileOptions(model=str(checkpoints("llama_tied")), out=tmp_path / "a", targets="none",
                                     head_format="int8", quant_embed=True))
    with pytest.raises(CompileError, match=r"--quant-head .*--head-format int8"):
        compile_model(CompileOptions(model=str(checkpoints("llama")), out=tmp_path / "b", targets="none",
                                     quant_head=True, head_format="int8"))
    with pytest.raises(CompileError, match="--head-format fp8"):
        compile_model(CompileOptions(model=str(checkpoints("llama")), out=tmp_path / "c", targets="none",
                                     head_format="fp8"))
    for args in (["--quant-head", "--head-format", "int8"], ["--quant-head", "--head-format", "bf16"]):
        capsys.readouterr()
        assert main(["compile", str(checkpoints("llama")), "-o", str(tmp_path / "d"), "--target", "none", "-q",
                     *args]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--quant-head" in err and "contradicts" in err
    assert not any((tmp_path / d).exists() for d in "abcd")


def test_gemv_int8_expansion_matches_the_plane_order():
    """templates/gemv.cu.j2 int8x8_to_f16x8, emulated bit for bit from the template's own constants: every code
    -128..127 comes out exact in fp16 (its byte with the sign flipped under 0x64, plus the HADD2 constant), and the
    four outputs of 8 codes pair them in the XF_F16X2 planes' k order (runtime/activation_formats.py _xf_pos), which
    is what lets the GEMV feed them to the MMA against the activation words unpermuted."""
    import re
    from pathlib import Path
    from imp_runtime.activation_formats import _xf_pos
    templates = Path(__file__).resolve().parent.parent / "templates"
    src = (templates / "gemv.cu.j2").read_text()
    body = src[src.index("void int8x8_to_f16x8"):]
    body = body[:body.index("\n}\n")]
    prelude = (templates / "prelude.cuh.j2").read_text()       # the pair conversion both INT8 kernels call
    assert re.search(r"xa = a \^ I8_FLIP, xb = b \^ I8_FLIP", body)
    flip = int(re.search(r"I8_FLIP = (0x[0-9A-Fa-f]+)u", prelude).group(1), 16)
    pair = re.search(r"hadd2_u32\(__byte_perm\(flipped, (0x[0-9A-Fa-f]+)u, sel\), (0x[0-9A-Fa-f]+)u\)", prelude)
    under, add = int(pair.group(1), 16), int(pair.group(2), 16)
    outs = re.findall(r"o\[(\d)\] = i8x2_to_f16x2\((x[ab]), (0x[0-9A-Fa-f]+)\)", body)
    assert len(outs) == 4

    def byte_perm(x: int, y: int, sel: int) -> int:     # PTX prmt (default mode): byte i from selector nibble i
        pool = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
        return sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))

    def half_add(bits: int, c: int) -> float:           # one lane of HADD2: fp16 + fp16, rounded to fp16
        return float(np.float16(np.array([bits], np.uint16).view(np.float16)[0] + np.array([c], np.uint16).view(np.float16)[0]))

    rng = np.random.default_rng(5)
    for _ in range(64):
        codes = rng.integers(-128, 128, 8)
        raw = (codes.astype(np.int64) & 0xFF)
        a = int(sum(int(raw[i]) << (8 * i) for i in range(4)))
        b = int(sum(int(raw[4 + i]) << (8 * i) for i in range(4)))
        regs = {"xa": a ^ flip, "xb": b ^ flip}
        order = []
        for idx, src_reg, sel in sorted(outs):
            w = byte_perm(regs[src_reg], under, int(sel, 16))
            lo, hi = half_add(w & 0xFFFF, add & 0xFFFF), half_add(w >> 16, add >> 16)
            order += [lo, hi]
        # the k each output half holds: the plane position p holds k = inverse of _xf_pos within 8
        pos = _xf_pos(8)
        k_at = np.empty(8, int)
        k_at[pos] = np.arange(8)
        assert order == [float(codes[k]) for k in k_at], (codes, order)
    # every code is exact
    for v in range(-128, 128):
        w = byte_perm((v & 0xFF) ^ (flip & 0xFF), under, 0x4440)
        assert half_add(w & 0xFFFF, add & 0xFFFF) == float(v)
