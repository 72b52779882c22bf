"""Llama 1-3 (incl. Llama-3 RoPE scaling and tied embeddings, as in SmolLM2 and Llama-3.2)."""
from impc.families.base import base_spec_args, hf_tensors
from imp_runtime.spec import ModelSpec

MODEL_TYPE = "llama"


def spec(config: dict) -> ModelSpec:
    return ModelSpec(family=MODEL_TYPE, qkv_bias=bool(config.get("attention_bias", False)),
                     **base_spec_args(config))


tensors = hf_tensors
