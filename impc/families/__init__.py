"""Stage 2: model spec. One file per architecture family; each maps an HF config to a ModelSpec and
the checkpoint's tensors to the bundle's canonical tensors (runtime/spec.py lists them)."""
from __future__ import annotations

from impc.errors import CompileError
from impc.families import gemma3, llama, mistral, qwen2, qwen3

FAMILIES = {f.MODEL_TYPE: f for f in (llama, mistral, qwen2, qwen3, gemma3)}
# model_type spellings of the same family
ALIASES = {"gemma3_text": "gemma3"}


def family_for(config: dict):
    model_type = config.get("model_type", "")
    name = ALIASES.get(model_type, model_type)
    if name not in FAMILIES:
        arch = (config.get("architectures") or [model_type or "unknown"])[0]
        raise CompileError(f"unsupported architecture '{arch}' (model_type '{model_type}'); "
                           f"supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]
