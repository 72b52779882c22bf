"""Qwen3: no qkv bias; RMSNorm on each head of q and k before RoPE."""
from impc.families.base import base_spec_args, hf_tensors
from imp_runtime.spec import ModelSpec

MODEL_TYPE = "qwen3"


def spec(config: dict) -> ModelSpec:
    return ModelSpec(family=MODEL_TYPE, qk_norm=True, qkv_bias=bool(config.get("attention_bias", False)),
                     **base_spec_args(config))


tensors = hf_tensors
