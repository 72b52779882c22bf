"""INT8 with one scale a row ("int8") as a bundle stores it, and its exact de-quantization (the reference
every kernel matches). Only an untied output head is stored this way (`impc compile --head-format int8`).

A weight W [N, K] is stored as two arrays:
  name.codes   int8 [N, K]    row-major, symmetric: -127..127
  name.rscale  float32 [N]    one scale a row: float32(amax(|W[n, :]|) / 127), 0 for a row of zeros
value = float32(code) * rscale[n], one float32 product (its one rounding, the same in every executor).
impc/quantize.py quantize_int8_rows makes them; the device arena uploads both as stored (codes as u8 bytes).
"""
from __future__ import annotations

import numpy as np

INT8_MAX = 127


def dequantize(codes: np.ndarray, rscale: np.ndarray) -> np.ndarray:
    """codes int8 [N, K] and rscale float32 [N] -> the float32 [N, K] values they stand for."""
    codes = np.asarray(codes).view(np.int8)
    return codes.astype(np.float32) * np.asarray(rscale, dtype=np.float32).reshape(-1, 1)
