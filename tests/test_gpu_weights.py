"""The GPU kernel tests' random weights (tests/gpu_common.py random_nvfp4, random_int8_rows), checked where they
cannot run: stored as the bundle stores them, K's padding zero, every code drawn, and magnitudes like those the
quantizer (impc/quantize.py) gives the Gaussian rows the tests drew before, tiny rows included."""
from __future__ import annotations

import numpy as np

from impc.quantize import quantize_int8_rows, quantize_nvfp4
from imp_runtime.nvfp4 import E4M3_VALUES, unpack_e2m1
from tests.gpu_common import random_int8_rows, random_nvfp4


def gaussian_rows(n: int, k: int, rng, tiny_rows: int) -> np.ndarray:
    """The tests' weights before: N(0, 1) rows times a factor spanning 30x, the first tiny_rows 1e-4 smaller."""
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
    w[:tiny_rows] *= 1e-4
    return w


def nibbles(codes: np.ndarray) -> np.ndarray:
    even, odd = unpack_e2m1(codes)
    out = np.empty((codes.shape[0], codes.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = even, odd
    return out


def test_nvfp4_stored_as_the_quantizer_stores_it():
    rng = np.random.default_rng(0)
    for n, k in [(64, 4096), (48, 37), (16, 33), (32, 18)]:
        q, ref = random_nvfp4(n, k, rng, tiny_rows=4), quantize_nvfp4(gaussian_rows(n, k, rng, 4))
        for got, want in ((q.codes, ref.codes), (q.scales, ref.scales), (q.tscale, ref.tscale)):
            assert got.shape == want.shape and got.dtype == want.dtype
        assert q.shape == (n, k) and q.dequantize().shape == (n, k)
        assert np.all(nibbles(q.codes)[:, k:] == 0), f"K {k}: padding codes not zero"
        assert np.all(np.isfinite(E4M3_VALUES[q.scales])) and np.all(q.scales < 0x80), "NaN or negative block scales"
        assert np.isfinite(q.tscale[0]) and q.tscale[0] > 0
    big = random_nvfp4(256, 1024, rng)
    for place in unpack_e2m1(big.codes):           # all sixteen codes, even and odd elements alike
        counts = np.bincount(place.ravel(), minlength=16)
        assert np.all(np.abs(counts / place.size - 1 / 16) < 0.01), counts


def test_nvfp4_magnitudes_like_the_quantizers():
    """Block scale codes and weight magnitudes within the ranges the quantizer gave the old Gaussian draw: normal
    rows' scales in the top decades of E4M3, tiny rows' among its subnormals and smallest normals (a few zero)."""
    rng = np.random.default_rng(1)
    n, k, tiny = 512, 2048, 40
    q, ref = random_nvfp4(n, k, rng, tiny), quantize_nvfp4(gaussian_rows(n, k, rng, tiny))
    for s in (q.scales, ref.scales):
        assert 60 <= np.percentile(s[tiny:], 1) and np.percentile(s[tiny:], 50) >= 100, np.percentile(s[tiny:], [1, 50])
        assert np.max(s[:tiny]) <= 24 and np.percentile(s[:tiny], 50) <= 10, np.percentile(s[:tiny], [50, 100])
        assert np.mean(s[:tiny] == 0) < 0.1
    assert abs(np.median(q.scales[tiny:].astype(int)) - np.median(ref.scales[tiny:].astype(int))) <= 12
    wq, wr = np.abs(q.dequantize()), np.abs(ref.dequantize())
    assert 0.4 <= wq[tiny:].mean() / wr[tiny:].mean() <= 2.5
    assert 0.3 <= wq.max() / wr.max() <= 3
    assert wq[:tiny].max() < 1e-2 * wq[tiny:].mean()


def test_int8_rows_like_the_quantizers():
    rng = np.random.default_rng(2)
    n, k, tiny = 256, 1024, 10
    q, ref = random_int8_rows(n, k, rng, tiny), quantize_int8_rows(gaussian_rows(n, k, rng, tiny))
    assert q.codes.shape == ref.codes.shape and q.codes.dtype == ref.codes.dtype and q.rscale.dtype == ref.rscale.dtype
    assert q.codes.min() == -127 and q.codes.max() == 127
    assert np.all(q.rscale > 0)
    ratio = np.median(q.rscale[tiny:]) / np.median(ref.rscale[tiny:])
    assert 0.6 <= ratio <= 1.6, ratio
    assert np.max(q.rscale[:tiny]) < 1e-2 * np.min(q.rscale[tiny:])
    assert np.array_equal(q.dequantize(), q.codes.astype(np.float32) * q.rscale[:, None])
