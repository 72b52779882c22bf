"""Stage 3: quantize linear weights to NVFP4 (runtime/nvfp4.py documents the stored form), and an untied
output head to INT8 with one scale a row when asked (runtime/int8.py; quantize_int8_rows below).

  s_t  = amax(|W|) / (6 * 448)                          tensor scale, float32
  s_b  = E4M3(amax(block) / (6 * s_t)), nearest-even    one per 16 elements along K
  q    = E2M1(W / (s_b * s_t)), nearest-even, saturating at 6
A block whose scale is zero holds zeros. Each tensor's error is measured against its input.

With scale search (DESIGN.md's option, `--scale-search`), each block also tries the E4M3 codes one
below and one above s_b and keeps whichever gives the smallest squared error of the block. On SmolLM2
it lowers ||W - Q|| / ||W|| from 0.095 to 0.085 and mean KL against bf16 from 0.211 to 0.203 nats, for
three times the quantization time; it is off by default because that gain is within what one prompt's
greedy answer can swing either way (SmolLM2's "capital of France" answer loses Paris with it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from imp_runtime import int8
from imp_runtime.nvfp4 import BLOCK, E2M1_MAX, E2M1_VALUES, E4M3_MAX, E4M3_VALUES, dequantize, pack_e2m1, padded_k

# Positive finite E4M3 values in code order (codes 0..126 increase monotonically).
_E4M3_POS = E4M3_VALUES[:127].astype(np.float64)


@dataclass
class QuantError:
    rel_rms: float      # ||W - Q|| / ||W||
    max_abs: float


@dataclass
class NVFP4Tensor:
    codes: np.ndarray   # uint8 [N, Kp/2]
    scales: np.ndarray  # uint8 [N, Kp/16]
    tscale: np.ndarray  # float32 [1]
    shape: tuple[int, int]

    def dequantize(self) -> np.ndarray:
        return dequantize(self.codes, self.scales, self.tscale, self.shape[1])


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Non-negative values (<= 448) to E4M3 codes, round to nearest, ties to the even code."""
    idx = np.clip(np.searchsorted(_E4M3_POS, x), 1, 126)
    lo, hi = _E4M3_POS[idx - 1], _E4M3_POS[idx]
    d_lo, d_hi = x - lo, hi - x
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (idx % 2 == 0))
    code = np.where(take_hi, idx, idx - 1)
    code = np.where(x <= 0, 0, code)
    return code.astype(np.uint8)


# Decision points between neighbouring E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}. At a tie, nearest-
# even goes to the even code: down at .25, 1.25, 2.5, 5 and up at .75, 1.75, 3.5, so those three
# thresholds sit one float below the midpoint and a value equal to the midpoint counts as above it.
_E2M1_THRESHOLDS = np.array([0.25, np.nextafter(0.75, 0), 1.25, np.nextafter(1.75, 0), 2.5, np.nextafter(3.5, 0), 5.0])


def round_e2m1(x: np.ndarray) -> np.ndarray:
    """Values to E2M1 nibbles, round to nearest, ties to even code, saturating at +-6: the magnitude's
    code is the number of thresholds below it (searchsorted is exact, no arithmetic on x)."""
    idx = np.searchsorted(_E2M1_THRESHOLDS, np.abs(x), side="left").astype(np.uint8)
    return idx | np.where(x < 0, np.uint8(8), np.uint8(0))


def pad_k(w: np.ndarray) -> np.ndarray:
    """W [N, K] with K padded by zero columns to a multiple of 16."""
    k = w.shape[1]
    return np.pad(w, ((0, 0), (0, padded_k(k) - k))) if padded_k(k) != k else w


def nvfp4_scales(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tensor scale (float32 [1]) and the nominal block scales (E4M3 codes [N, Kp/16]) of a padded
    float64 W [N, Kp]: s_t = amax / (6 * 448), s_b = E4M3(amax(block) / (6 * s_t))."""
    n, kp = w.shape
    amax = float(np.max(np.abs(w))) if w.size else 0.0
    tscale = np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    bmax = np.max(np.abs(w.reshape(n, kp // BLOCK, BLOCK)), axis=2)
    return np.array([tscale], dtype=np.float32), round_e4m3(np.minimum(bmax / (E2M1_MAX * float(tscale)), E4M3_MAX))


def pack_codes(q: np.ndarray) -> np.ndarray:
    """E2M1 codes [N, Kp] -> stored bytes [N, Kp/2]: elements 2j and 2j + 1 in byte j, bits placed by
    runtime/nvfp4.py pack_e2m1 (bundle format 2)."""
    return np.ascontiguousarray(pack_e2m1(q[:, 0::2], q[:, 1::2]))   # C order: stored as raw bytes


def quantize_nvfp4(w: np.ndarray, scale_search: bool = False) -> NVFP4Tensor:
    """W [N, K] float -> NVFP4 by rounding to nearest, in float64 so the result is independent of the
    input dtype."""
    k = w.shape[1]
    w = pad_k(np.asarray(w, dtype=np.float64))
    n, kp = w.shape
    tscale, nominal = nvfp4_scales(w)
    st = float(tscale[0])
    blocks = w.reshape(n, kp // BLOCK, BLOCK)
    scales, q, best_err = nominal, None, None
    for offset in ((0, -1, 1) if scale_search else (0,)):
        cand = np.clip(nominal.astype(np.int16) + offset, 0, 126).astype(np.uint8)
        cand = np.where(nominal == 0, 0, cand).astype(np.uint8)   # an all-zero block stays zero
        cq, err = _codes_for(blocks, cand, st, with_error=scale_search)
        if q is None:
            scales, q, best_err = cand, cq, err
        else:
            better = err < best_err
            scales = np.where(better, cand, scales)
            q = np.where(better[:, :, None], cq, q)
            best_err = np.minimum(err, best_err)
    return NVFP4Tensor(pack_codes(q.reshape(n, kp)), scales, tscale, (n, k))


def _codes_for(blocks: np.ndarray, scales: np.ndarray, st: float, with_error: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """E2M1 codes of every block for the given block scales, and each block's squared error."""
    denom = _E4M3_POS[scales] * st                              # [N, Kp/16]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(denom[:, :, None] > 0, blocks / denom[:, :, None], 0.0)
    q = round_e2m1(scaled)
    if not with_error:
        return q, None
    err = np.sum((E2M1_VALUES[q].astype(np.float64) * denom[:, :, None] - blocks) ** 2, axis=2)
    return q, err


@dataclass
class Int8Rows:
    codes: np.ndarray   # int8 [N, K]
    rscale: np.ndarray  # float32 [N]

    def dequantize(self) -> np.ndarray:
        return int8.dequantize(self.codes, self.rscale)


def quantize_int8_rows(w: np.ndarray, rows_at_once: int = 4096) -> Int8Rows:
    """W [N, K] -> INT8, symmetric, one scale a row: rscale[n] = float32(amax_n / 127) (the division in
    float64), codes = clip(rint(W / rscale[n]), -127, 127) with the quotient in float64 of the float32
    values and rint half to even; a row of zeros gets rscale 0 and codes 0. A few thousand rows at a time,
    so an 8B model's head (128256 x 4096) never has a float64 copy whole."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    codes = np.empty((n, k), dtype=np.int8)
    rscale = np.empty(n, dtype=np.float32)
    for r0 in range(0, n, rows_at_once):
        block = w[r0:r0 + rows_at_once].astype(np.float64)
        amax = np.max(np.abs(block), axis=1) if k else np.zeros(len(block))
        s = (amax / int8.INT8_MAX).astype(np.float32)
        s64 = s.astype(np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s64 > 0, np.rint(block / s64), 0.0)
        codes[r0:r0 + rows_at_once] = np.clip(q, -int8.INT8_MAX, int8.INT8_MAX).astype(np.int8)
        rscale[r0:r0 + rows_at_once] = s
    return Int8Rows(codes, rscale)


def measure_error(w: np.ndarray, deq: np.ndarray) -> QuantError:
    """||W - Q|| / ||W|| and max |W - Q|: the difference in float32 (its rounding, ~6e-8 of an element, is far
    below the 6 digits recorded), the sums of squares accumulated in float64. A float64 copy of every tensor
    took ~4.6 s of a SmolLM2 compile on one core; this takes a sixth of it."""
    w = np.asarray(w, dtype=np.float32)
    diff = w - np.asarray(deq, dtype=np.float32)
    axes = "".join("ijklmn"[:w.ndim])
    sq = lambda a: float(np.einsum(f"{axes},{axes}->", a, a, dtype=np.float64))  # noqa: E731
    norm = sq(w) ** 0.5
    return QuantError(sq(diff) ** 0.5 / norm if norm else 0.0, float(np.max(np.abs(diff))) if diff.size else 0.0)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even (as torch does)."""
    return (_bf16_rounded(a) >> 16).astype(np.uint16)


def bf16_values(a: np.ndarray) -> np.ndarray:
    """The float32 values of to_bf16_bits(a) (bf16_to_f32 of them, in fewer passes)."""
    r = _bf16_rounded(a)
    r &= np.uint32(0xFFFF0000)
    return r.view(np.float32).reshape(np.shape(a))


def _bf16_rounded(a: np.ndarray) -> np.ndarray:
    """bits + 0x7FFF + ((bits >> 16) & 1) of a's float32 bit patterns (uint32, wrapping), in place on one array."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = bits >> 16
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += bits
    return r
