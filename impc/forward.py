"""The model's forward pass over calibration chunks, one layer at a time, for the compiler.

Calibration needs what the cpu executor does not give: the inputs of every linear, a layer run on its
own from a cached input, and a weight swapped in between two layers. So this is the same math as
imp_runtime.executor_cpu (its kernel references: rms_norm, gated_act, attention, RoPE; attention and SiLU
rearranged for speed below, compared with the references by the tests), arranged per
layer over a batch of equal-length chunks that each start at position 0.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Mapping

import numpy as np

from imp_runtime.executor_cpu import gated_act, rms_norm
from imp_runtime.rope import apply_rope, cos_sin
from imp_runtime.spec import ModelSpec

LINEARS = ("qkv", "o", "gate_up", "down")
QUERY_BLOCK = 64     # causal attention in query blocks: block j reads keys 0 .. its end only
ROW_CHUNK = 1 << 16  # elements a row-wise pass (norm, SiLU) of a large array works on at a time (in L2)
LARGE = 1 << 20      # elements from which a row-wise pass goes ROW_CHUNK at a time (row_step)
SCORES_IN_CACHE = 3 << 18   # attention scores of a query block (bytes) for which chunks are batched together

# Called with a linear's short name ("qkv", ...) and its inputs [rows, in]; returns the weight to apply.
LinearHook = Callable[[str, np.ndarray], np.ndarray]


def layer_weights(weights: Mapping[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """One layer's tensors by short name ("qkv", "attn_norm", ...)."""
    prefix = f"layers.{layer}."
    return {name[len(prefix):]: w for name, w in weights.items() if name.startswith(prefix)}


def embed(spec: ModelSpec, table: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """Token ids [C, T] -> the first layer's input [C, T, D]."""
    return table[chunks] * np.float32(spec.embed_scale)


def layer_forward(spec: ModelSpec, layer: int, w: Mapping[str, np.ndarray], x: np.ndarray,
                  hook: LinearHook | None = None) -> np.ndarray:
    """x [C, T, D] -> the layer's output [C, T, D]. With a hook, each linear's inputs go to it and the
    weight it returns is applied (how the sequential quantizer sees inputs and swaps in its result)."""
    s = spec
    c, t, d = x.shape

    def linear(name: str, inputs: np.ndarray) -> np.ndarray:
        weight = hook(name, inputs) if hook else w[name]
        return inputs @ weight.T

    pos = np.arange(t)
    a = norm_rows(x, w["attn_norm"], s.norm_eps).reshape(c * t, d)
    qkv = linear("qkv", a)
    if s.qkv_bias:
        qkv = qkv + w["qkv_bias"]
    qkv = qkv.reshape(c, t, -1)
    cos, sin = cos_sin(s, layer, pos)
    window = s.sliding_window if s.kind(layer) == "sliding" else 0
    # q and k of every chunk normed and rotated at once (each value as the per-chunk calls gave it: the
    # operations are per element, the norms per head row), attention chunk by chunk into heads
    q = qkv[:, :, :s.q_dim].reshape(c, t, s.n_heads, s.head_dim)
    k = qkv[:, :, s.q_dim:s.q_dim + s.kv_dim].reshape(c, t, s.n_kv_heads, s.head_dim)
    if s.qk_norm:
        q = rms_norm(q, w["q_norm"], s.norm_eps)
        k = rms_norm(k, w["k_norm"], s.norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = qkv[:, :, s.q_dim + s.kv_dim:].reshape(c, t, s.n_kv_heads, s.head_dim)
    heads = np.empty((c, t, s.n_heads, s.head_dim), dtype=np.float32)
    # several chunks per call where a query block's scores are small (the sensitivity runs' 64-token chunks)
    per = max(1, SCORES_IN_CACHE // (s.n_heads * min(t, QUERY_BLOCK) * t * 4))
    for i in range(0, c, per):
        causal_attention(q[i:i + per], k[i:i + per], v[i:i + per], s.softmax_scale, window, out=heads[i:i + per])
    o = linear("o", heads.reshape(c * t, s.q_dim)).reshape(c, t, d)
    if s.sandwich_norm:
        o = rms_norm(o, w["post_attn_norm"], s.norm_eps)
    x = x + o
    m = norm_rows(x, w["ffn_norm"], s.norm_eps).reshape(c * t, d)
    m = linear("down", gated_activation(linear("gate_up", m), s.activation)).reshape(c, t, d)
    if s.sandwich_norm:
        m = rms_norm(m, w["post_ffn_norm"], s.norm_eps)
    return x + m


def row_step(rows: np.ndarray) -> int:
    """Rows a row-wise pass over `rows` [N, D] takes at a time: all of a small array, ROW_CHUNK elements' worth of
    a large one (so that its passes stay in the core's cache)."""
    return max(1, rows.shape[0] if rows.size < LARGE else ROW_CHUNK // rows.shape[1])


def norm_rows(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """executor_cpu.rms_norm of a contiguous x [..., D], bit for bit (each row's values depend on that row
    only), a few rows at a time (row_step)."""
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape, dtype=np.result_type(x, w))
    step = row_step(rows)
    for r in range(0, rows.shape[0], step):
        out[r:r + step] = rms_norm(rows[r:r + step], w, eps)
    return out.reshape(x.shape)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int,
                     out: np.ndarray | None = None) -> np.ndarray:
    """executor_cpu.attention for chunks whose queries and keys both sit at positions 0 .. T-1
    (q [..., T, H, hd], k/v [..., T, KV, hd] -> [..., T, H, hd], into out when given; leading axes: chunks,
    each attended on its own), in query blocks: a block's scores cover only the keys it may see (causal, and
    within the window), so ~half the score matrix of a 512-token chunk is never computed, and the softmax is
    normalised on the [T, hd] output instead of on the scores. Same values up to float32 rounding (2.4x faster
    at T = 512; tests/test_calibrate.py compares); each chunk's values the same whatever the chunks beside it
    (the same matrix products, row by row reductions)."""
    lead = q.shape[:-3]
    t, h, hd = q.shape[-3:]
    kv = k.shape[-2]
    if out is None:
        out = np.empty(q.shape, dtype=np.float32)
    n = int(np.prod(lead, dtype=np.int64))
    q, k, v, o = (a.reshape(n, *a.shape[-3:]) for a in (q, k, v, out))   # views (out: its own memory)
    qg = q.reshape(n, t, kv, h // kv, hd).transpose(0, 2, 3, 1, 4)      # [C, KV, G, T, hd]
    kt = k.transpose(0, 2, 3, 1)[:, :, None]                            # [C, KV, 1, hd, S]
    vt = v.transpose(0, 2, 1, 3)[:, :, None]                            # [C, KV, 1, S, hd]
    og = o.reshape(n, t, kv, h // kv, hd).transpose(0, 2, 3, 1, 4)      # [C, KV, G, T, hd], a view of out
    for i1 in range(0, t, QUERY_BLOCK):
        i2 = min(i1 + QUERY_BLOCK, t)
        j1 = max(0, i1 - window + 1) if window else 0                  # the block's first visible key
        scores = np.matmul(qg[..., i1:i2, :], kt[..., j1:i2])          # [C, KV, G, b, keys]
        scores *= np.float32(scale)
        mask, hidden = _block_mask(i1, i2, j1, window)
        for c1, c2 in hidden:
            np.copyto(scores[..., c1:c2], np.float32(-np.inf), where=mask[:, c1:c2])
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        np.divide(np.matmul(scores, vt[..., j1:i2, :]), total, out=og[..., i1:i2, :])
    return out


@lru_cache(maxsize=256)
def _block_mask(i1: int, i2: int, j1: int, window: int) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
    """The keys j1..i2-1 a query block i1..i2-1 may not see ([b, keys], True where masked), and the ranges of
    key columns holding any such (-inf is written on those only: the keys before the block are visible to it,
    unless a window cuts the first ones)."""
    q_pos, k_pos = np.arange(i1, i2)[:, None], np.arange(j1, i2)[None, :]
    mask = k_pos > q_pos
    if window:
        mask |= (q_pos - k_pos) >= window
    edges = np.flatnonzero(np.diff(mask.any(axis=0), prepend=False, append=False))
    mask.setflags(write=False)
    return mask, tuple((int(a), int(b)) for a, b in edges.reshape(-1, 2))


def gated_activation(gate_up: np.ndarray, activation: str) -> np.ndarray:
    """executor_cpu.gated_act, bit for bit, with SiLU computed in place (a third fewer passes over
    [T, I] than the reference's temporaries), a few rows at a time (the passes stay in the core's cache)."""
    if activation != "silu":
        return gated_act(gate_up, activation)
    i = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * i)
    out = np.empty((rows.shape[0], i), dtype=gate_up.dtype)
    step = row_step(rows[:, :i])
    for r in range(0, rows.shape[0], step):
        g, u, a = rows[r:r + step, :i], rows[r:r + step, i:], out[r:r + step]
        np.negative(g, out=a)           # silu(g) = g / (1 + exp(-g)), in the reference's order
        np.exp(a, out=a)
        a += np.float32(1.0)
        np.divide(g, a, out=a)
        a *= u
    return out.reshape(*gate_up.shape[:-1], i)


def final_hidden(spec: ModelSpec, weights: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The last layer's output [C, T, D] -> the normalised hidden state the head reads."""
    return rms_norm(x, weights["final_norm"], spec.norm_eps)


def log_probs(spec: ModelSpec, weights: Mapping[str, np.ndarray], x: np.ndarray, dtype=np.float64) -> np.ndarray:
    """The last layer's output [C, T, D] -> next-token log-probabilities [C*T, V]."""
    head = weights["embed"] if spec.tie_embeddings else weights["lm_head"]
    logits = final_hidden(spec, weights, x).reshape(-1, x.shape[-1]) @ head.T
    if spec.final_softcap:
        logits = np.tanh(logits / np.float32(spec.final_softcap)) * np.float32(spec.final_softcap)
    return log_softmax_rows(logits, dtype)


def log_softmax_rows(logits: np.ndarray, dtype=np.float64) -> np.ndarray:
    """Row-wise log-softmax (float64 by default: KL of close distributions needs the precision)."""
    x = logits.astype(dtype)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def mean_kl(ref_logp: np.ndarray, logp: np.ndarray) -> float:
    """Mean over positions of KL(ref || candidate), both as log-probabilities [N, V]."""
    return float(np.mean(np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=-1)))
