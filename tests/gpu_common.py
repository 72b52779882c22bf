"""Shared by the GPU tests: where their bundles live, and sequences driven without the scheduler.

The bundles are compiled where the nvcc wheels are (`scripts/build_gpu_bundles.py`, into
build/gpu-bundles/ or $IMP_GPU_BUNDLES); a missing bundle is built on the spot, and a bundle that
cannot be built fails the test (a GPU check that silently skips would prove nothing)."""
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
        pytest.fail(f"GPU test bundle {name} is missing and cannot be built here ({e.__class__.__name__}: {e}); "
                    f"run scripts/build_gpu_bundles.py where the nvcc wheels are and carry build/gpu-bundles")
    return path


def solo(ex):
    """A sequence on executor ex (runtime/kv_blocks.py's SoloSequence), its pages from one block manager
    per executor, so sequences alive at the same time never share a page."""
    from imp_runtime.kv_blocks import BlockManager, SoloSequence
    if getattr(ex, "_test_blocks", None) is None:
        ex._test_blocks = BlockManager(ex.num_pages, ex.page_size)
    return SoloSequence(ex, ex._test_blocks)
