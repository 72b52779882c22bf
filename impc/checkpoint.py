"""Stage 1: load. A checkpoint, whatever its file format, as the rest of the compiler sees it.

Both loaders (Hugging Face folders here, GGUF in load_gguf.py) present the same thing: an HF-style
config dict, HF tensor names in HF layout, a `tokenizers` tokenizer, the chat template and the
generation defaults. Tensors are read lazily, one at a time, from memory-mapped files.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from impc.errors import CompileError  # noqa: F401  (re-exported: loaders raise it)
from imp_runtime.bundle import bf16_to_f32


@dataclass
class Checkpoint:
    path: Path
    config: dict                          # HF config.json keys (model_type, hidden_size, ...)
    tokenizer_json: str                   # a serialized tokenizers.Tokenizer
    chat_template: str | None
    special_tokens: dict                  # bos_token, eos_token, pad_token, unk_token (strings or None)
    eos_token_ids: list[int]
    generation_config: dict
    tensor_names: list[str]
    read: Callable[[str], np.ndarray] = field(repr=False)   # HF name -> float32 array, HF layout
    files: list[Path] = field(default_factory=list)         # what source_hash covers
    add_bos: bool = False                 # whether the tokenizer is expected to prepend BOS

    def tensor(self, name: str) -> np.ndarray:
        return self.read(name)

    def has(self, name: str) -> bool:
        return name in self._name_set

    @property
    def _name_set(self) -> set[str]:
        if not hasattr(self, "_names_cache"):
            self._names_cache = set(self.tensor_names)
        return self._names_cache

    def source_hash(self) -> str:
        h = hashlib.sha256()
        for f in sorted(self.files):
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()


def load_checkpoint(model: str) -> Checkpoint:
    """MODEL is a .gguf file, a Hugging Face folder, or a known short name (smollm2)."""
    from impc.models import resolve_model_name

    path = resolve_model_name(model)
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        from impc.load_gguf import load_gguf
        return load_gguf(path)
    if not path.exists():
        raise CompileError(f"{model}: no such file or folder (expected a .gguf file, a Hugging Face "
                           "folder with config.json, or the name 'smollm2')")
    raise CompileError(f"{model}: not a .gguf file or a Hugging Face folder")


# --------------------------------------------------------------------------- Hugging Face folders

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CompileError(f"{path}: cannot read JSON ({e})") from None


def load_hf_folder(path: Path) -> Checkpoint:
    if not (path / "config.json").is_file():
        raise CompileError(f"{path}: no config.json (is this a Hugging Face model folder?)")
    config = _read_json(path / "config.json")
    # Multimodal checkpoints (gemma3) keep the language model's config under text_config.
    if "text_config" in config and "hidden_size" not in config:
        text = dict(config["text_config"])
        text.setdefault("model_type", config.get("model_type", "") + "_text")
        config = {**text, "_outer_model_type": config.get("model_type")}

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index)["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    else:
        shard_names = sorted(p.name for p in path.glob("*.safetensors"))
        if not shard_names:
            raise CompileError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
        weight_map = {}
        for s in shard_names:
            for k in SafetensorsFile(path / s).header:
                weight_map[k] = s
    for s in shard_names:
        if not (path / s).is_file():
            raise CompileError(f"{path}: shard {s} named in the index is missing")

    handles: dict[str, SafetensorsFile] = {}

    def read(name: str) -> np.ndarray:
        shard = weight_map[name]
        if shard not in handles:
            handles[shard] = SafetensorsFile(path / shard)
        return handles[shard].read_f32(name)

    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise CompileError(f"{path}: no tokenizer.json (a fast tokenizer is required)")
    tok_cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    chat_template = tok_cfg.get("chat_template")
    if isinstance(chat_template, list):   # named templates: take the default one
        chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
    if chat_template is None and (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()

    def token_str(v):
        return v.get("content") if isinstance(v, dict) else v

    special = {k: token_str(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tokenizer_json = tok_path.read_text()
    add_bos = bool(tok_cfg.get("add_bos_token", False))
    files = [path / "config.json", tok_path] + [path / s for s in shard_names]
    return Checkpoint(path=path, config=config, tokenizer_json=tokenizer_json, chat_template=chat_template,
                      special_tokens=special, eos_token_ids=eos_ids, generation_config=gen,
                      tensor_names=sorted(weight_map), read=read, files=files, add_bos=add_bos)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


class SafetensorsFile:
    """A memory-mapped safetensors file. safetensors' numpy reader has no bfloat16, which is what most
    checkpoints hold, so the header is parsed here and tensors are viewed straight from the map."""

    def __init__(self, path: Path):
        import struct
        self.path = path
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        (n,) = struct.unpack("<Q", bytes(self.map[:8]))
        self.header = json.loads(bytes(self.map[8:8 + n]))
        self.header.pop("__metadata__", None)
        self.base = 8 + n

    def read_f32(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise CompileError(f"{self.path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = self.map[self.base + start:self.base + end].view(_ST_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            raw = bf16_to_f32(raw)
        return raw.astype(np.float32).reshape(info["shape"])
