"""NVFP4 as a bundle stores it, and its exact de-quantization (the reference every kernel matches).

A weight W [N, K] is cut into blocks of 16 along K (K padded with zeros to a multiple of 16):
  codes   uint8 [N, Kp/2]   two E2M1 codes a byte, the even element in the low nibble
  scales  uint8 [N, Kp/16]  FP8 E4M3 bit patterns, one per block
  tscale  float32 [1]       the tensor scale
value = e2m1(code) * e4m3(scale) * tscale. e2m1 * e4m3 is exact in float32 (and bf16), so the only
rounding is the final multiply by tscale, which every executor does in float32 the same way.
"""
from __future__ import annotations

import numpy as np

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# E2M1 nibble -> value: bit 3 sign, bits 2..1 exponent, bit 0 mantissa.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    """FP8 E4M3 (fn variant: no infinities, 0x7f/0xff are NaN) bit pattern -> float32."""
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * man / 8.0 * 2.0 ** -6
        else:
            out[b] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return out


E4M3_VALUES = _e4m3_table()


def padded_k(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK * BLOCK


def dequantize(codes: np.ndarray, scales: np.ndarray, tscale: np.ndarray | float, k: int) -> np.ndarray:
    """Exact float32 values of an NVFP4 tensor, cropped to its true K."""
    n = codes.shape[0]
    lo = E2M1_VALUES[codes & 0xF]
    hi = E2M1_VALUES[codes >> 4]
    q = np.empty((n, codes.shape[1] * 2), dtype=np.float32)
    q[:, 0::2] = lo
    q[:, 1::2] = hi
    block = E4M3_VALUES[scales]                                  # [N, Kp/16]
    w = (q.reshape(n, -1, BLOCK) * block[:, :, None]).reshape(n, -1)  # exact
    w *= np.float32(np.asarray(tscale, dtype=np.float32).reshape(-1)[0])
    return w[:, :k]
