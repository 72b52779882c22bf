"""The bundle as the runtime reads it: manifest.json, weights, tokenizer, chat template, cubins.

Every file is listed in the manifest with its sha256; loading checks the format version and every
hash, so a truncated, corrupted or missing file is a one-line BundleError naming the file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from imp_runtime import int8
from imp_runtime.nvfp4 import dequantize
from imp_runtime.spec import ModelSpec

FORMAT = "imp-bundle"
FORMAT_VERSION = 2        # 2: NVFP4 codes' bits placed for the decode kernels (runtime/nvfp4.py pack_e2m1)
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


class BundleError(Exception):
    """A bundle that cannot be used; the message names the file and what is wrong."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


@dataclass
class Bundle:
    path: Path
    manifest: dict
    spec: ModelSpec
    _programs: dict = field(default_factory=dict, repr=False, compare=False)   # target -> validated Program

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def tensors(self) -> dict[str, dict]:
        return self.manifest["quantization"]["tensors"]

    def file(self, rel: str) -> Path:
        return self.path / rel

    def tokenizer_json(self) -> str:
        return self.file(self.manifest["tokenizer"]["file"]).read_text()

    def chat_template(self) -> str | None:
        rel = self.manifest["tokenizer"].get("chat_template")
        return self.file(rel).read_text() if rel else None

    def program(self, target: str):
        """The launch program of one target, parsed and validated against the cubin's kernels."""
        from imp_runtime.program import ProgramError, loads, validate
        if target in self._programs:
            return self._programs[target]
        k = self.manifest.get("kernels", {})
        rel = k.get("programs", {}).get(target)
        if rel is None:
            raise BundleError(f"{self.path}: no launch program for {target} (targets with one: "
                              f"{', '.join(k.get('programs', {})) or 'none'})")
        try:
            prog = loads(self.file(rel).read_text())
            if prog.target != target:
                raise ProgramError(f"it is the program of {prog.target}")
            validate(prog, set(k["functions"][target]))
        except ProgramError as e:
            raise BundleError(f"{self.file(rel)}: launch program refused: {e}") from None
        self._programs[target] = prog
        return prog

    @property
    def synthetic(self) -> bool:
        """Built by `impc compile --synthetic`: no weights file; the cuda executor generates them."""
        return bool(self.manifest.get("synthetic"))

    def raw_weights(self) -> dict[str, np.ndarray]:
        """Every stored array by its safetensors key (memory-mapped; nothing is converted)."""
        if self.synthetic:
            raise BundleError(f"{self.path}: a synthetic bundle has no stored weights (they are generated on "
                              "the GPU from its seed); run it with the cuda executor")
        from safetensors.numpy import load_file
        return load_file(self.file(WEIGHTS))

    def float_weights(self) -> dict[str, np.ndarray]:
        """Every canonical tensor as exact float32 values (NVFP4, INT8 and bf16 de-quantized)."""
        raw = self.raw_weights()
        out: dict[str, np.ndarray] = {}
        for name, info in self.tensors.items():
            fmt = info["format"]
            if fmt == "nvfp4":
                out[name] = dequantize(raw[name + ".codes"], raw[name + ".scales"], raw[name + ".tscale"],
                                       info["shape"][1])
            elif fmt == "int8":
                out[name] = int8.dequantize(raw[name + ".codes"], raw[name + ".rscale"]).reshape(info["shape"])
            elif fmt == "bf16":
                out[name] = bf16_to_f32(raw[name]).reshape(info["shape"])
            else:
                out[name] = raw[name].astype(np.float32).reshape(info["shape"])
        return out


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory (build one with `impc compile`)")
    if not mpath.is_file():
        raise BundleError(f"{mpath}: missing; {path} is not a complete bundle")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mpath}: corrupted ({e.__class__.__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{mpath}: not an imp bundle manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"{mpath}: bundle format {manifest.get('format_version')}, this runtime reads "
                          f"{FORMAT_VERSION}: rebuild it with `impc compile`")
    if verify:
        for rel, digest in manifest["files"].items():
            f = path / rel
            if not f.is_file():
                raise BundleError(f"{f}: missing from the bundle")
            if sha256_file(f) != digest:
                raise BundleError(f"{f}: corrupted or truncated (sha256 differs from the manifest)")
    try:
        spec = ModelSpec.from_dict(manifest["model"])
    except (KeyError, TypeError) as e:
        raise BundleError(f"{mpath}: bad model description ({e})") from None
    bundle = Bundle(path=path, manifest=manifest, spec=spec)
    if verify:
        for target in manifest.get("kernels", {}).get("targets", []):
            bundle.program(target)
    return bundle
