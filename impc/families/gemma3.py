"""Gemma 3 (text): sandwich norms storing w for a (1 + w) factor, q/k norm, embeddings scaled by
sqrt(hidden), gelu-tanh gating, sliding-window layers with their own RoPE base, tied embeddings."""
import math

from impc.families.base import base_spec_args, hf_tensors, rope_params
from imp_runtime.spec import ModelSpec

MODEL_TYPE = "gemma3"


def layer_kinds(config: dict) -> tuple[str, ...]:
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return tuple("sliding" if t == "sliding_attention" else "full" for t in config["layer_types"])
    pattern = int(config.get("sliding_window_pattern", 6))   # every pattern-th layer is global
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))


def spec(config: dict) -> ModelSpec:
    args = base_spec_args(config)
    args["tie_embeddings"] = bool(config.get("tie_word_embeddings", True))
    return ModelSpec(
        family=MODEL_TYPE, qk_norm=True, sandwich_norm=True, activation="gelu_tanh",
        embed_scale=math.sqrt(args["hidden"]),
        attn_scale=float(config.get("query_pre_attn_scalar", args["head_dim"])) ** -0.5,
        sliding_window=int(config.get("sliding_window") or 0), layer_kinds=layer_kinds(config),
        rope_theta_local=float(config.get("rope_local_base_freq")
                               or rope_params(config, "sliding_attention").get("rope_theta", 10000.0)),
        final_softcap=float(config.get("final_logit_softcapping") or 0.0),
        **args)


def tensors(spec, ck):
    return hf_tensors(spec, ck, norm_offset=1.0)
