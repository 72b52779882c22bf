"""The NVFP4 quantizer against a float64 implementation of DESIGN.md's definition, written here
independently: scalar loops, explicit grids, no shared code with impc.quantize."""
from __future__ import annotations

import math

import numpy as np
import pytest

from impc.quantize import quantize_nvfp4
from imp_runtime.nvfp4 import pack_e2m1, unpack_e2m1

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_grid() -> list[float]:
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue                      # NaN
            vals.append(m / 8 * 2 ** -6 if e == 0 else (1 + m / 8) * 2 ** (e - 7))
    return vals                               # code order == value order


E4M3_GRID = e4m3_grid()


def nearest_even(x: float, grid: list[float]) -> tuple[int, float]:
    """Index and value of the grid point nearest to x >= 0; ties go to the even index."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - x), i % 2))
    return best, grid[best]


def reference(w: np.ndarray) -> np.ndarray:
    """De-quantized values by the definition, in float64 (the padded tail dropped)."""
    n, k = w.shape
    kp = (k + 15) // 16 * 16
    wp = np.zeros((n, kp))
    wp[:, :k] = w
    amax = np.abs(wp).max()
    st = float(np.float32(amax / (6 * 448))) if amax > 0 else 1.0
    out = np.zeros_like(wp)
    for r in range(n):
        for b in range(kp // 16):
            blk = wp[r, b * 16:(b + 1) * 16]
            _, sb = nearest_even(min(np.abs(blk).max() / (6 * st), 448.0), E4M3_GRID)
            for j, v in enumerate(blk):
                if sb == 0:
                    continue
                x = min(abs(v) / (sb * st), 6.0)
                _, q = nearest_even(x, E2M1_GRID)
                out[r, b * 16 + j] = math.copysign(q, v) * sb * float(np.float32(st))
    return out[:, :k]


def check(w: np.ndarray) -> np.ndarray:
    got = quantize_nvfp4(w).dequantize()
    ref = reference(np.asarray(w, dtype=np.float64))
    # float32 storage of s_t: the only rounding is the final multiply, so compare to 1 ulp of float32
    np.testing.assert_allclose(got, ref, rtol=2e-7, atol=0)
    return got


def test_random_gaussian():
    check(np.random.default_rng(0).standard_normal((8, 64)))


def test_all_zero_blocks():
    w = np.random.default_rng(1).standard_normal((4, 48))
    w[:, 16:32] = 0.0
    w[2] = 0.0
    got = check(w)
    assert np.all(got[:, 16:32] == 0) and np.all(got[2] == 0)


def test_one_outlier():
    w = np.random.default_rng(2).standard_normal((4, 32)) * 1e-3
    w[1, 5] = 1e3
    got = check(w)
    assert got[1, 5] == pytest.approx(1e3, rel=1e-6)   # amax maps to 6 * 448 exactly


def test_e4m3_range_edges():
    """Block maxima spanning the E4M3 range: the tensor max at 448, tiny blocks down in subnormals."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 64))
    w[0, :16] *= 1e4                     # sets the tensor scale
    w[1, 16:32] *= 1e-4                  # block scale near E4M3's subnormals
    w[2, 32:48] *= 1e-7                  # block scale underflows to zero
    check(w)


def test_k_not_multiple_of_16():
    check(np.random.default_rng(4).standard_normal((5, 37)))


def test_negative_zero_and_ties():
    w = np.array([[-0.0, 0.0, 0.25, -0.25, 0.75, 1.25, -1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 0.1, -0.1, 4.0, 1.0]])
    got = check(w)
    assert got[0, 0] == 0.0 and got[0, 1] == 0.0


def test_exact_grid_values_roundtrip():
    """Values already on the grid with a power-of-two tensor scale come back exactly."""
    w = np.array([E2M1_GRID[1:] + [-v for v in E2M1_GRID[1:]] + [0.0, 6.0]]) * 448 / 448
    got = quantize_nvfp4(w).dequantize()
    np.testing.assert_allclose(got, w, rtol=1e-6)


def test_scale_search_never_worse_per_block_and_stays_on_the_grid():
    w = np.random.default_rng(5).standard_normal((16, 96)) * np.exp(np.random.default_rng(6).standard_normal((16, 1)))
    plain = quantize_nvfp4(w).dequantize()
    searched_t = quantize_nvfp4(w, scale_search=True)
    searched = searched_t.dequantize()
    block_err = lambda q: ((q - w) ** 2).reshape(16, -1, 16).sum(axis=2)  # noqa: E731
    assert np.all(block_err(searched) <= block_err(plain) * (1 + 1e-12))
    assert block_err(searched).sum() < 0.95 * block_err(plain).sum()
    # every value is an E2M1 grid point times the block's E4M3 scale times the tensor scale
    st = float(searched_t.tscale[0])
    for r in range(16):
        for b in range(6):
            sb = E4M3_GRID[searched_t.scales[r, b]]
            for v in searched[r, b * 16:(b + 1) * 16]:
                assert sb > 0 and min(abs(abs(v) - g * sb * st) for g in E2M1_GRID) <= 1e-6 * abs(v) + 1e-30


# ------------------------------------------------------------------ stored layout (DESIGN.md)

def test_stored_code_bytes_scale_byte_and_codes():
    """The bytes themselves, by the definition (runtime/nvfp4.py, bundle format 2): elements 2j and 2j + 1 in byte j,
    the even element's sign at bit 7 and its exponent and mantissa at bits 3..1, the odd element's sign at bit 0
    and its exponent and mantissa at bits 6..4; E2M1 code = sign bit 3, exponent bits 2..1, mantissa bit 0; the
    block scale an E4M3 byte. A row whose amax is 6 has s_t = 6 / (6 * 448) and block scale 448 = 1.75 * 2^8 ->
    0x7E, so each element's code is the E2M1 code of the element itself."""
    values = [0.5, -6.0, 1.0, 0.0, 1.5, -0.5, 2.0, 3.0, -4.0, 6.0, -1.0, -1.5, 4.0, -2.0, -3.0, 0.0]
    magnitude = {0.0: 0x0, 0.5: 0x1, 1.0: 0x2, 1.5: 0x3, 2.0: 0x4, 3.0: 0x5, 4.0: 0x6, 6.0: 0x7}
    negative = lambda v: 1 if v < 0 else 0   # noqa: E731
    q = quantize_nvfp4(np.array([values]))
    assert q.scales.tolist() == [[0x7E]]
    assert q.tscale[0] == np.float32(6.0 / (6 * 448))
    expected = [(negative(values[2 * i]) << 7) | (magnitude[abs(values[2 * i])] << 1)
                | (magnitude[abs(values[2 * i + 1])] << 4) | negative(values[2 * i + 1]) for i in range(8)]
    assert q.codes.tolist() == [expected]
    assert q.codes[0, 0] == 0x73           # element 0 (0.5: 001 at bits 3..1), element 1 (-6: 111 at 6..4, sign bit 0)


def test_stored_code_bytes_are_a_bijection():
    """Every pair of E2M1 codes has its own byte and reads back as itself (no two pairs share a byte)."""
    even, odd = np.meshgrid(np.arange(16, dtype=np.uint8), np.arange(16, dtype=np.uint8), indexing="ij")
    stored = pack_e2m1(even, odd)
    assert len(set(stored.ravel().tolist())) == 256
    back_even, back_odd = unpack_e2m1(stored)
    assert np.array_equal(back_even, even) and np.array_equal(back_odd, odd)


# ------------------------------------------------------------------ GPTQ within the NVFP4 grid

def reference_gptq(w: np.ndarray, h: np.ndarray, damp: float, order: list[int] | None = None,
                   scale_codes: np.ndarray | None = None) -> np.ndarray:
    """GPTQ as the optimal-brain-surgeon update, written from the paper in float64 with an explicit
    inverse: in the given column order, round column j on the fixed grid, move the columns not yet
    rounded by -err * Hinv[j, :] / Hinv[j, j], then eliminate j from the inverse. Block scales are
    amax / 6 of the original W (or the given E4M3 codes). Returns the de-quantized W."""
    n, k = w.shape
    amax = np.abs(w).max()
    st = float(np.float32(amax / (6 * 448)))
    step = np.zeros((n, k))
    for r in range(n):
        for b in range(k // 16):
            if scale_codes is None:
                _, sb = nearest_even(min(np.abs(w[r, b * 16:(b + 1) * 16]).max() / (6 * st), 448.0), E4M3_GRID)
            else:
                sb = E4M3_GRID[scale_codes[r, b]]
            step[r, b * 16:(b + 1) * 16] = sb * st
    hinv = np.linalg.inv(h + damp * np.mean(np.diag(h)) * np.eye(k))
    work = w.astype(np.float64).copy()
    out = np.zeros_like(work)
    rest = list(order if order is not None else range(k))
    while rest:
        j = rest.pop(0)
        for r in range(n):
            x = min(abs(work[r, j]) / step[r, j], 6.0) if step[r, j] > 0 else 0.0
            out[r, j] = math.copysign(nearest_even(x, E2M1_GRID)[1], work[r, j]) * step[r, j]
        err = (work[:, j] - out[:, j]) / hinv[j, j]
        work[:, rest] -= np.outer(err, hinv[j, rest])
        hinv = hinv - np.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return out


def correlated_inputs(rng, t: int, k: int) -> np.ndarray:
    """Activations shaped like a transformer's: correlated channels of very different scales."""
    mix = np.eye(k) + 0.5 * rng.standard_normal((k, k)) / np.sqrt(k)
    return (rng.standard_normal((t, k)) @ mix) * np.exp(rng.standard_normal(k))


def test_gptq_matches_float64_reference_and_beats_rounding():
    from impc.gptq import DAMP, gptq_nvfp4

    rng = np.random.default_rng(7)
    n, k = 12, 64
    x = correlated_inputs(rng, 512, k)
    h = x.T @ x
    w = rng.standard_normal((n, k)) * np.exp(0.5 * rng.standard_normal((n, 1)))
    weighted = lambda q: float(np.trace((w - q) @ h @ (w - q).T))   # noqa: E731
    rounded = weighted(reference(w))
    # columns in order, amax / 6 scales (the grid of plain rounding)
    plain = gptq_nvfp4(w, h, act_order=False, scale_search=False)
    assert np.array_equal(plain.scales, quantize_nvfp4(w).scales)
    # the same codes as the reference: every value equal up to the float32 tensor-scale multiply
    np.testing.assert_allclose(plain.dequantize(), reference_gptq(w, h, DAMP), rtol=2e-7, atol=0)
    # act-order: the most active inputs first
    ordered = gptq_nvfp4(w, h, act_order=True, scale_search=False).dequantize()
    order = sorted(range(k), key=lambda j: (-h[j, j], j))
    np.testing.assert_allclose(ordered, reference_gptq(w, h, DAMP, order), rtol=2e-7, atol=0)
    # the default also searches block scales: each within one E4M3 code of amax / 6
    default = gptq_nvfp4(w, h)
    nominal = quantize_nvfp4(w).scales.astype(int)
    assert np.all(np.abs(default.scales.astype(int) - nominal) <= 1) and np.any(default.scales != nominal)
    np.testing.assert_allclose(default.dequantize(), reference_gptq(w, h, DAMP, order, default.scales),
                               rtol=2e-7, atol=0)
    # the objective GPTQ minimises, the calibration-weighted error: at least 15% below rounding's,
    # each refinement lower still
    assert weighted(plain.dequantize()) < 0.85 * rounded
    assert weighted(default.dequantize()) < weighted(ordered) < weighted(plain.dequantize())


def test_gptq_is_deterministic_and_handles_dead_inputs_and_padding():
    from impc.gptq import gptq_nvfp4

    rng = np.random.default_rng(8)
    x = correlated_inputs(rng, 256, 40)
    x[:, 5] = 0.0                              # a channel the calibration never activates
    h = x.T @ x
    w = rng.standard_normal((6, 40))
    a, b = gptq_nvfp4(w, h), gptq_nvfp4(w.copy(), h.copy())
    assert a.codes.tobytes() == b.codes.tobytes() and a.scales.tobytes() == b.scales.tobytes()
    deq = a.dequantize()
    assert deq.shape == (6, 40) and np.all(deq[:, 5] == 0)   # dead inputs: weight irrelevant, stored as 0
    assert np.all(np.isfinite(deq))


def test_measure_error_by_hand():
    """||W - Q|| / ||W|| and max |W - Q| on cases worked by hand (the compiler records both per tensor)."""
    from impc.quantize import measure_error
    e = measure_error(np.array([[3.0, 4.0]], np.float32), np.array([[3.0, 3.0]], np.float32))
    assert e.rel_rms == pytest.approx(0.2, rel=1e-12) and e.max_abs == 1.0          # |[0, 1]| / |[3, 4]|
    e = measure_error(np.array([1.0, 2.0], np.float32), np.array([1.0, 1.0], np.float32))
    assert e.rel_rms == pytest.approx(5 ** -0.5, rel=1e-12) and e.max_abs == 1.0
    assert measure_error(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32)).rel_rms == 0.0
