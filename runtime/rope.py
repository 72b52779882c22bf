"""Rotary position embedding tables, as Hugging Face computes them (rotate-half layout: the first
half of each head's dimensions pairs with the second half)."""
from __future__ import annotations

import math

import numpy as np

from imp_runtime.spec import ModelSpec, RopeScaling


def inv_freq(head_dim: int, base: float, scaling: RopeScaling) -> np.ndarray:
    f = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling.kind == "linear":
        f = f / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / f
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, f / scaling.factor, f)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        f = np.where(mid, (1 - smooth) * f / scaling.factor + smooth * f, scaled)
    return f.astype(np.float32)


def cos_sin(spec: ModelSpec, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [len(positions), head_dim / 2] in float32."""
    base, scaling = spec.rope_for(layer)
    freqs = positions.astype(np.float32)[:, None] * inv_freq(spec.head_dim, base, scaling)[None, :]
    return np.cos(freqs), np.sin(freqs)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, head_dim]; cos/sin [T, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
