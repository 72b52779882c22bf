"""Shared by the GPU tests: where their bundles live, and sequences driven without the scheduler.

The bundles are compiled where the nvcc wheels are (`scripts/build_gpu_bundles.py`, into
build/gpu-bundles/ or $IMP_GPU_BUNDLES); a missing bundle is built on the spot, and a bundle that
cannot be built fails the test (a GPU check that silently skips would prove nothing)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
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


# ------------------------------------------------------------------ random weights, drawn as stored
# The kernel tests overwrite a launch's weight buffers with random weights and compare against float64 products of
# their exact values. Drawn here as the bundle stores them (codes and scales), not by quantizing a float matrix:
# rounding a Qwen3-8B shape's gate_up (24,576 x 4,096) through impc/quantize.py took ~30 s of host time on two
# cores, and a GPU call waited for it in each of the 8B-shape tests (~16 s a test on the GPU machine; drawn: under 1 s).
# The magnitudes are those the quantizer gave the Gaussian rows the tests drew before (block scales 2.75-448 over
# rows spanning 30x; tiny rows' scales E4M3 subnormals and small normals, some zero): checked by
# tests/test_gpu_weights.py on this machine, where the GPU tests cannot run.


def _row_factors(n: int, rng, tiny_rows: int) -> np.ndarray:
    """A factor a row spanning 30x, the first tiny_rows 1e-4 smaller (their scales far below the tensor's)."""
    rf = rng.uniform(0.1, 3, (n, 1))
    rf[:tiny_rows] *= 1e-4
    return rf


def random_nvfp4(n: int, k: int, rng, tiny_rows: int = 0):
    """Random NVFP4 weights [n, k] (impc/quantize.py NVFP4Tensor): every code byte uniform, so all sixteen E2M1
    codes in both places of a byte (K's padding zero, as the quantizer leaves it); block scales E4M3 codes of 448 / 3
    x the row's factor x U(0.35, 1); a tensor scale near the one the quantizer gives rows of N(0, 1) x that factor."""
    from impc.quantize import NVFP4Tensor, round_e4m3
    from imp_runtime.nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, padded_k
    kp = padded_k(k)
    codes = rng.integers(0, 256, (n, kp // 2), dtype=np.uint8)
    if kp != k:
        codes[:, (k + 1) // 2:] = 0
        if k % 2:
            codes[:, k // 2] &= 0x8E          # element k - 1's code kept, element k's (padding) zero: pack_e2m1's bits
    sv = E4M3_MAX / 3 * _row_factors(n, rng, tiny_rows) * rng.uniform(0.35, 1, (n, kp // BLOCK))
    scales = round_e4m3(np.minimum(sv, E4M3_MAX))
    tscale = np.array([15.4 / (E2M1_MAX * E4M3_MAX) * rng.uniform(0.8, 1.25)], dtype=np.float32)
    return NVFP4Tensor(codes, scales, tscale, (n, k))


def random_int8_rows(n: int, k: int, rng, tiny_rows: int = 0):
    """Random INT8 rows [n, k] (impc/quantize.py Int8Rows): codes uniform in -127..127, a scale a row of ~4 / 127 x
    the row's factor (the quantizer's for rows of N(0, 1) x that factor)."""
    from impc.quantize import Int8Rows
    codes = rng.integers(-127, 128, (n, k), dtype=np.int8)
    rscale = (4.0 / 127 * _row_factors(n, rng, tiny_rows)[:, 0] * rng.uniform(0.8, 1.25, n)).astype(np.float32)
    return Int8Rows(codes, rscale)


def random_float_rows(n: int, k: int, rng, tiny_rows: int = 0) -> np.ndarray:
    """Random float32 weights [n, k]: N(0, 1) x the row's factor (the bf16 GEMMs' weights, rounded by the caller)."""
    w = rng.standard_normal((n, k), dtype=np.float32)
    w *= _row_factors(n, rng, tiny_rows).astype(np.float32)
    return w
