"""Stage 6: write the bundle directory (runtime/bundle.py reads it back).

Everything goes into a temporary sibling folder first and is renamed into place at the end, so an
interrupted build never leaves half a bundle, and an existing bundle is replaced only by a whole one.
Nothing time- or path-dependent is written: the same input gives byte-identical bundles.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from impc.errors import CompileError
from imp_runtime.bundle import FORMAT, FORMAT_VERSION, MANIFEST, WEIGHTS, sha256_file


def check_output_dir(out: Path) -> None:
    """Refuse to replace a folder that is not a bundle (never lose a user's files)."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise CompileError(f"{out} exists and is not an imp bundle; choose another -o or remove it")


def write_bundle(out: Path, manifest: dict, arrays: dict[str, np.ndarray], texts: dict[str, str],
                 blobs: dict[str, bytes]) -> None:
    from safetensors.numpy import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        if arrays:
            # safetensors writes an array's raw buffer: a Fortran-ordered one would be stored scrambled
            save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp / WEIGHTS))
        for rel, text in texts.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        for rel, data in blobs.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        for rel in files:
            (tmp / rel).chmod(0o644)        # safetensors writes 0600; a bundle is meant to be shared
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest,
                    "files": {rel: sha256_file(tmp / rel) for rel in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
