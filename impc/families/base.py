"""What the families share: the HF decoder layout (model.layers.N.self_attn.q_proj ...), read into
the bundle's fused canonical tensors (q|k|v rows stacked, gate|up rows stacked)."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from impc.checkpoint import Checkpoint
from impc.errors import CompileError
from imp_runtime.spec import ModelSpec, RopeScaling


def base_spec_args(c: dict) -> dict:
    """ModelSpec fields every family reads the same way from an HF config."""
    try:
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        return dict(
            vocab_size=c["vocab_size"], hidden=hidden, n_layers=c["num_hidden_layers"], n_heads=heads,
            n_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or hidden // heads,
            intermediate=c["intermediate_size"],
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_params(c).get("rope_theta", 10000.0)),
            max_position=int(c.get("max_position_embeddings", 4096)),
            rope_scaling=rope_scaling(rope_params(c)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise CompileError(f"config.json lacks {e.args[0]}") from None


def rope_params(c: dict, layer_type: str = "full_attention") -> dict:
    """RoPE settings of one layer type, from either config style: transformers < 5 (rope_theta and
    rope_scaling at top level) or >= 5 (rope_parameters, nested by layer type where types differ)."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and layer_type in rp:
        rp = rp[layer_type]
    out = dict(c.get("rope_scaling") or {})
    out.update(rp or {})
    if "rope_theta" in c and "rope_theta" not in (rp or {}):
        out["rope_theta"] = c["rope_theta"]
    return out


def rope_scaling(rs: dict) -> RopeScaling:
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=float(rs["factor"]),
                           low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                           original_max_position=int(rs.get("original_max_position_embeddings", 8192)))
    raise CompileError(f"RoPE scaling '{kind}' is not supported (supported: linear, llama3)")


def hf_tensors(spec: ModelSpec, ck: Checkpoint, norm_offset: float = 0.0) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (canonical name, float32 array) in bundle order, one tensor (or one fused pair) at a time.
    norm_offset is added to every RMSNorm weight (gemma stores w and multiplies by 1 + w)."""
    def get(name: str) -> np.ndarray:
        if not ck.has(name):
            raise CompileError(f"checkpoint lacks tensor {name}")
        return ck.tensor(name)

    def norm(name: str) -> np.ndarray:
        return get(name) + np.float32(norm_offset)

    yield "embed", get("model.embed_tokens.weight")
    for i in range(spec.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        yield o + "attn_norm", norm(p + "input_layernorm.weight")
        yield o + "qkv", np.concatenate([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if spec.qkv_bias:
            yield o + "qkv_bias", np.concatenate([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        if spec.qk_norm:
            yield o + "q_norm", norm(p + "self_attn.q_norm.weight")
            yield o + "k_norm", norm(p + "self_attn.k_norm.weight")
        yield o + "o", get(p + "self_attn.o_proj.weight")
        if spec.sandwich_norm:
            yield o + "post_attn_norm", norm(p + "post_attention_layernorm.weight")
            yield o + "ffn_norm", norm(p + "pre_feedforward_layernorm.weight")
        else:
            yield o + "ffn_norm", norm(p + "post_attention_layernorm.weight")
        yield o + "gate_up", np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        yield o + "down", get(p + "mlp.down_proj.weight")
        if spec.sandwich_norm:
            yield o + "post_ffn_norm", norm(p + "post_feedforward_layernorm.weight")
    yield "final_norm", norm("model.norm.weight")
    if not spec.tie_embeddings:
        if ck.has("lm_head.weight"):
            yield "lm_head", get("lm_head.weight")
        else:  # some checkpoints tie without saying so
            raise CompileError("checkpoint has no lm_head.weight and does not tie embeddings")
