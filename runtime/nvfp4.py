"""NVFP4 as a bundle stores it, and its exact de-quantization (the reference every kernel matches).

A weight W [N, K] is cut into blocks of 16 along K (K padded with zeros to a multiple of 16):
  codes   uint8 [N, Kp/2]   two E2M1 codes a byte (elements 2j and 2j + 1 in byte j), their bits placed for the
                            decode kernels (pack_e2m1 below), not nibble by nibble
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


# The stored byte of an even element's code e and the next element's code o (E2M1 codes: bit 3 sign, bits 2..1
# exponent, bit 0 mantissa): e's sign at bit 7 and its three low bits at bits 3..1; o's sign at bit 0 and its three
# low bits at bits 6..4. Bundle format 2 (runtime/bundle.py); format 1 stored e in the low nibble and o in the high.
# Why: the GPU expands eight codes (a 32-bit word) into fp16 by placing each code's bits at fp16 bits 15 and 11..9;
# with the even codes already there within their bytes that is one mask for four codes and two shifts and masks
# for the other four (templates/prelude.cuh.j2 fp4x8_to_f16x8: 9 instructions a word instead of 11; the one-row
# decode GEMV's loop 345 -> 313 a stage, b1 +2%: BENCHMARKS.md, twenty-fifth session).
def pack_e2m1(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    """Stored bytes of E2M1 codes (uint8 arrays of one shape, values 0..15): element 2j's code and element 2j + 1's."""
    e, o = even.astype(np.uint8), odd.astype(np.uint8)
    return (((e & 7) << 1) | ((e & 8) << 4) | ((o & 7) << 4) | (o >> 3)).astype(np.uint8)


def unpack_e2m1(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """pack_e2m1's inverse: (even, odd) E2M1 codes of stored bytes."""
    c = codes.astype(np.uint8)
    return ((c >> 1) & 7) | ((c >> 4) & 8), ((c >> 4) & 7) | ((c & 1) << 3)


def padded_k(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK * BLOCK


def dequantize(codes: np.ndarray, scales: np.ndarray, tscale: np.ndarray | float, k: int) -> np.ndarray:
    """Exact float32 values of an NVFP4 tensor, cropped to its true K."""
    n = codes.shape[0]
    even, odd = unpack_e2m1(codes)
    lo = E2M1_VALUES[even]
    hi = E2M1_VALUES[odd]
    q = np.empty((n, codes.shape[1] * 2), dtype=np.float32)
    q[:, 0::2] = lo
    q[:, 1::2] = hi
    block = E4M3_VALUES[scales]                                  # [N, Kp/16]
    w = (q.reshape(n, -1, BLOCK) * block[:, :, None]).reshape(n, -1)  # exact
    w *= np.float32(np.asarray(tscale, dtype=np.float32).reshape(-1)[0])
    return w[:, :k]
