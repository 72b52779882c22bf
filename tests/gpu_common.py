"""Shared by the GPU tests: where their bundles live and how to get an executor for one.

The bundles are compiled on a machine with the nvcc wheels (`scripts/build_gpu_bundles.py`, which
`scripts/gpu_check.sh` expects under build/gpu-bundles/) and carried to the GPU machine, which has no
compiler wheels; where the compiler is present a missing bundle is built on the spot."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_BUNDLES = Path(os.environ.get("IMP_GPU_BUNDLES", ROOT / "build" / "gpu-bundles"))


def have_gpu() -> bool:
    try:
        from imp_runtime.executor_cuda import gpu_available
    except ImportError:
        return False
    return gpu_available()


def gpu_bundle(name: str) -> Path:
    path = GPU_BUNDLES / name
    if (path / "manifest.json").is_file():
        return path
    try:
        import sys
        sys.path.insert(0, str(ROOT / "scripts"))
        from build_gpu_bundles import build
        build([name])
    except Exception as e:          # no compiler here, or no checkpoint for it
        pytest.skip(f"GPU test bundle {name} is missing ({e.__class__.__name__}: {e}); "
                    f"run scripts/build_gpu_bundles.py where the nvcc wheels are")
    return path
