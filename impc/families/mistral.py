"""Mistral: the llama layout; a sliding window on every layer when the config sets one."""
from impc.families.base import base_spec_args, hf_tensors
from imp_runtime.spec import ModelSpec

MODEL_TYPE = "mistral"


def spec(config: dict) -> ModelSpec:
    window = int(config.get("sliding_window") or 0)
    n = config["num_hidden_layers"]
    return ModelSpec(family=MODEL_TYPE, sliding_window=window,
                     layer_kinds=("sliding",) * n if window else (), **base_spec_args(config))


tensors = hf_tensors
