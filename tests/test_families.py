"""Every family: the cpu executor on a compiled bundle against transformers (the oracle) on the same
weights, over a 64-token prompt and 16 decode steps."""
from __future__ import annotations

import numpy as np
import pytest

from imp_runtime.bundle import load_bundle
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import SoloSequence

FAMILIES = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "gemma3"]
PROMPT_LEN, DECODE_STEPS = 64, 16


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def hf_model(path, state_dict=None):
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        assert not unexpected, unexpected
        assert all("rotary" in m or ("lm_head" in m and model.config.tie_word_embeddings) for m in missing), missing
        if model.config.tie_word_embeddings:
            model.tie_weights()
    return model.eval()


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """Logits of every prompt position, then of each decode step, through transformers' KV cache."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([tokens[:PROMPT_LEN]]), use_cache=True)
        rows = [out.logits[0].numpy()]
        past = out.past_key_values
        for t in tokens[PROMPT_LEN:]:
            out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0].numpy())
    return np.concatenate(rows)


def imp_logits(bundle_path, tokens: list[int]) -> np.ndarray:
    seq = SoloSequence(CpuExecutor(load_bundle(bundle_path)))
    rows = [seq.prefill(tokens[:PROMPT_LEN], all_logits=True)]
    for t in tokens[PROMPT_LEN:]:
        rows.append(seq.decode(t))
    return np.concatenate(rows)


def tokens_for(vocab: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(4, vocab, PROMPT_LEN + DECODE_STEPS).tolist()


def dequantized_state_dict(bundle_path, family: str) -> dict:
    """The bundle's exact (de-quantized) values under transformers' names: canonical -> HF."""
    import torch

    b = load_bundle(bundle_path)
    s, w = b.spec, b.float_weights()
    offset = 1.0 if s.family == "gemma3" else 0.0
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    sd = {"model.embed_tokens.weight": t(w["embed"]), "model.norm.weight": t(w["final_norm"] - offset)}
    if "lm_head" in w:
        sd["lm_head.weight"] = t(w["lm_head"])
    for i in range(s.n_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = np.split(w[c + "qkv"], [s.q_dim, s.q_dim + s.kv_dim])
        sd.update({p + "self_attn.q_proj.weight": t(q), p + "self_attn.k_proj.weight": t(k),
                   p + "self_attn.v_proj.weight": t(v), p + "self_attn.o_proj.weight": t(w[c + "o"])})
        if s.qkv_bias:
            qb, kb, vb = np.split(w[c + "qkv_bias"], [s.q_dim, s.q_dim + s.kv_dim])
            sd.update({p + "self_attn.q_proj.bias": t(qb), p + "self_attn.k_proj.bias": t(kb),
                       p + "self_attn.v_proj.bias": t(vb)})
        gate, up = np.split(w[c + "gate_up"], 2)
        sd.update({p + "mlp.gate_proj.weight": t(gate), p + "mlp.up_proj.weight": t(up),
                   p + "mlp.down_proj.weight": t(w[c + "down"])})
        norms = {"input_layernorm": "attn_norm"}
        if s.sandwich_norm:
            norms.update(post_attention_layernorm="post_attn_norm", pre_feedforward_layernorm="ffn_norm",
                         post_feedforward_layernorm="post_ffn_norm")
        else:
            norms.update(post_attention_layernorm="ffn_norm")
        if s.qk_norm:
            norms.update({"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"})
        for hf, canon in norms.items():
            sd[p + hf + ".weight"] = t(w[c + canon] - offset)
    return sd


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_bundle_matches_transformers(family, checkpoints, bundles):
    ckpt = checkpoints(family)
    model = hf_model(ckpt)
    tokens = tokens_for(model.config.vocab_size)
    ref = hf_logits(model, tokens)
    got = imp_logits(bundles(family, "bf16"), tokens)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_nvfp4_bundle_matches_transformers_on_dequantized_weights(family, checkpoints, bundles):
    path = bundles(family, "nvfp4", quant_embed=True, quant_head=True)
    model = hf_model(checkpoints(family), dequantized_state_dict(path, family))
    tokens = tokens_for(model.config.vocab_size, seed=2)
    ref = hf_logits(model, tokens)
    got = imp_logits(path, tokens)
    assert rel_err(got, ref) <= 1e-3
    # and the quantization really happened: the weights differ from the checkpoint's
    orig = hf_model(checkpoints(family))
    assert rel_err(hf_logits(orig, tokens), ref) > 1e-3
