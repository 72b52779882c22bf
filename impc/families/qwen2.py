"""Qwen2 / Qwen2.5: the llama layout with a bias on q, k and v."""
from impc.families.base import base_spec_args, hf_tensors
from imp_runtime.spec import ModelSpec

MODEL_TYPE = "qwen2"


def spec(config: dict) -> ModelSpec:
    # Qwen2 configs carry a sliding_window that use_sliding_window=false switches off (the default).
    return ModelSpec(family=MODEL_TYPE, qkv_bias=True, **base_spec_args(config))


tensors = hf_tensors
