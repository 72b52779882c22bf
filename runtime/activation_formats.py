"""Activation formats between kernels (templates/prelude.cuh.j2 defines them; the numbers must match).

  XF_BF16   (0): [rows, K] bf16, the prefill GEMM's input over bf16 weights.
  XF_F16X2  (1): [2*rows, K] fp16 planes for a decode GEMV over NVFP4 weights: row 2b = hi = fp16(x * 2^-6),
                 row 2b+1 = lo = fp16(x * 2^-6 - hi), k permuted within each 8 to the GEMV's fragment order.
                 The per-block GEMVs read hi + lo; the streamed ones (gemv_ring_*) read hi alone (`ring_read`).
  XF_BF16X2 (2): [2*rows, K] bf16 planes for a decode GEMV over bf16 weights: hi = bf16(x), lo = bf16(x - hi).
  XF_F16    (3): [rows, K] fp16(x * 2^-6), the prefill GEMM's input over NVFP4 weights.
  XF_F16W   (4): XF_F16 with k permuted within each 256 (wq_pos): the NVFP4 decode GEMM's input on Hopper.
The 2^-6 pre-scale keeps the products of two projections inside fp16's range; kernels undo it exactly.
`to_planes` / `from_planes` / `ring_read` are the host's view of the plane formats (kernel tests)."""
from __future__ import annotations

import numpy as np

XF_BF16, XF_F16X2, XF_BF16X2, XF_F16, XF_F16W = 0, 1, 2, 3, 4
XF_F16_SCALE = 2.0 ** -6
GEMV_NB = (1, 2, 4, 8, 16)           # the decode GEMV's batch variants (gemv_*_nb{N})


def xfmt(fmt: str) -> int:
    """The x-plane format a decode GEMV over weights stored as fmt (nvfp4 | int8 | bf16) reads: fp16 planes
    for NVFP4 and INT8 weights, bf16 planes for bf16 weights."""
    return XF_F16X2 if fmt in ("nvfp4", "int8") else XF_BF16X2


def gfmt(fmt: str) -> int:
    """The activation format a GEMM over weights stored as fmt reads: fp16 (pre-scaled) for NVFP4 and
    INT8 weights, bf16 for bf16 weights (bf16 -> fp16 is not exact for weights below 2^-14)."""
    return XF_F16 if fmt in ("nvfp4", "int8") else XF_BF16


def _xf_pos(k: int) -> np.ndarray:
    i = np.arange(k)
    j = i & 7
    return (i & ~7) | np.where(j & 1, 4 + (j >> 1), j >> 1)


def wq_pos(k: int) -> np.ndarray:
    """Position of each of k elements in an XF_F16W row (templates/prelude.cuh.j2 wq_pos; k a multiple of 256)."""
    i = np.arange(k)
    r = i & 255
    t, u, w = r >> 6, (r >> 3) & 7, r & 7
    return (i & ~255) | (u << 5) | ((w & 1) << 4) | ((w >> 2) << 3) | (t << 1) | ((w >> 1) & 1)


def write_activation(a: np.ndarray, fmt: int) -> np.ndarray:
    """float32 [rows, k] -> the uint16 bits an activation buffer holds in a 16-bit format (XF_BF16, XF_F16,
    XF_F16W)."""
    a = np.asarray(a, np.float32)
    if fmt == XF_BF16:
        return _bf16_bits(a)
    h = (a * np.float32(XF_F16_SCALE)).astype(np.float16).view(np.uint16)
    if fmt == XF_F16:
        return h
    if fmt == XF_F16W:
        out = np.empty_like(h)
        out[:, wq_pos(a.shape[1])] = h
        return out
    raise ValueError(f"not a 16-bit activation format: {fmt}")


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def to_planes(a: np.ndarray, fmt: int) -> np.ndarray:
    """float32 [M, K] -> x planes [2M, K] as uint16 bits."""
    a = np.asarray(a, np.float32)
    m, k = a.shape
    out = np.empty((2 * m, k), np.uint16)
    if fmt == XF_F16X2:
        s = np.clip(a * np.float32(XF_F16_SCALE), -65504, 65504).astype(np.float32)
        h = s.astype(np.float16)
        lo = (s - h.astype(np.float32)).astype(np.float16)
        pos = _xf_pos(k)
        out[0::2][:, pos] = h.view(np.uint16)
        out[1::2][:, pos] = lo.view(np.uint16)
    elif fmt == XF_BF16X2:
        h = _bf16_bits(a)
        out[0::2] = h
        out[1::2] = _bf16_bits(a - (h.astype(np.uint32) << 16).view(np.float32))
    else:
        raise ValueError(f"x-plane format {fmt}")
    return out


def from_planes(raw: np.ndarray, fmt: int) -> np.ndarray:
    """x planes [2M, K] uint16 bits -> the float32 [M, K] they represent."""
    raw = np.asarray(raw, np.uint16)
    if fmt == XF_F16X2:
        v = raw.view(np.float16).astype(np.float32)
        v = (v[0::2] + v[1::2]) / np.float32(XF_F16_SCALE)
        return v[:, _xf_pos(raw.shape[1])]
    if fmt == XF_BF16X2:
        v = (raw.astype(np.uint32) << 16).view(np.float32)
        return v[0::2] + v[1::2]
    raise ValueError(f"x-plane format {fmt}")


def ring_read(a: np.ndarray) -> np.ndarray:
    """The float32 [M, K] a streamed GEMV (templates/gemv_ring.cu.j2) multiplies when a [M, K] is written as XF_F16X2
    planes: the hi plane alone, fp16(x * 2^-6) / 2^-6 (saturated as the writers saturate)."""
    planes = to_planes(a, XF_F16X2)
    planes[1::2] = 0                     # (+0.0: the lo planes left out)
    return from_planes(planes, XF_F16X2)


def read_activation(raw: np.ndarray, rows: int, k: int, fmt: int) -> np.ndarray:
    """The float32 [rows, k] an activation buffer's bytes hold in format fmt."""
    raw = np.asarray(raw).view(np.uint16)
    if fmt == XF_BF16:
        return (raw[:rows * k].astype(np.uint32) << 16).view(np.float32).reshape(rows, k)
    if fmt in (XF_F16, XF_F16W):
        v = raw[:rows * k].view(np.float16).astype(np.float32).reshape(rows, k) / np.float32(XF_F16_SCALE)
        return v[:, wq_pos(k)] if fmt == XF_F16W else v
    return from_planes(raw[:2 * rows * k].reshape(2 * rows, k), fmt)
