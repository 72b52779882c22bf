"""The `cpu` executor: the reference forward pass in numpy float32.

It runs the bundle's exact stored values (NVFP4 and bf16 weights are de-quantized once at load), so
it is the oracle every GPU kernel is compared with, the backend of the test suite, and what serves on
a machine without a GPU. Each function below is the reference of one kernel family in templates/.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from imp_runtime.bundle import Bundle
from imp_runtime.rope import apply_rope, cos_sin
from imp_runtime.spec import ModelSpec

# ------------------------------------------------------------------ kernel references


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] * w / rms(x): the reference of templates/rmsnorm.cu.j2."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


def gated_act(gate_up: np.ndarray, activation: str) -> np.ndarray:
    """gate_up [T, 2I] -> act(gate) * up [T, I]: the reference of templates/act.cu.j2."""
    i = gate_up.shape[-1] // 2
    g, u = gate_up[..., :i], gate_up[..., i:]
    return (silu(g) if activation == "silu" else gelu_tanh(g)) * u


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float,
              window: int) -> np.ndarray:
    """Causal attention of queries at positions q_pos over keys 0..len(k)-1 (GQA by head groups).
    q [T, H, hd], k/v [S, KV, hd] -> [T, H, hd]. window > 0: a key is visible when q_pos - k_pos < window."""
    t, h, hd = q.shape
    s, kv = k.shape[0], k.shape[1]
    g = h // kv
    qg = q.reshape(t, kv, g, hd).transpose(1, 2, 0, 3)                   # [KV, G, T, hd]
    kt = k.transpose(1, 2, 0)                                            # [KV, hd, S]
    scores = np.matmul(qg, kt[:, None]) * np.float32(scale)              # [KV, G, T, S]
    k_pos = np.arange(s)
    mask = k_pos[None, :] > q_pos[:, None]
    if window:
        mask |= (q_pos[:, None] - k_pos[None, :]) >= window
    scores = np.where(mask[None, None], np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, v.transpose(1, 0, 2)[:, None])                    # [KV, G, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(t, h, hd)


# ------------------------------------------------------------------ executor


@dataclass
class _Sequence:
    k: list[np.ndarray]            # per layer [capacity, KV, hd]
    v: list[np.ndarray]
    length: int = 0


@dataclass
class CpuExecutor:
    bundle: Bundle
    w: dict[str, np.ndarray] = field(init=False, repr=False)
    name = "cpu"

    def __post_init__(self):
        self.spec: ModelSpec = self.bundle.spec
        self.w = self.bundle.float_weights()
        self.head = self.w["embed"] if self.spec.tie_embeddings else self.w["lm_head"]
        self.max_context: int = self.bundle.manifest["plan"]["max_context"]
        self._seqs: dict[int, _Sequence] = {}
        self._next = 0

    # --- sequences (the KV cache) ---

    def new_sequence(self) -> int:
        sid, self._next = self._next, self._next + 1
        s = self.spec
        cap = 256
        self._seqs[sid] = _Sequence([np.zeros((cap, s.n_kv_heads, s.head_dim), np.float32) for _ in range(s.n_layers)],
                                    [np.zeros((cap, s.n_kv_heads, s.head_dim), np.float32) for _ in range(s.n_layers)])
        return sid

    def free(self, sid: int) -> None:
        self._seqs.pop(sid, None)

    def length(self, sid: int) -> int:
        return self._seqs[sid].length

    def _reserve(self, seq: _Sequence, n: int) -> None:
        cap = seq.k[0].shape[0]
        if n <= cap:
            return
        new = max(n, cap * 2)
        for cache in (seq.k, seq.v):
            for i, a in enumerate(cache):
                grown = np.zeros((new,) + a.shape[1:], np.float32)
                grown[:cap] = a
                cache[i] = grown

    # --- forward ---

    def prefill(self, sid: int, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to sequence sid; logits of the last token [V], or of every token [T, V]."""
        seq = self._seqs[sid]
        if seq.length + len(tokens) > self.max_context:
            raise ValueError(f"sequence of {seq.length + len(tokens)} tokens exceeds the context of "
                             f"{self.max_context}")
        h = self._forward(seq, np.asarray(tokens, dtype=np.int64))
        return self._logits(h if all_logits else h[-1:])[slice(None) if all_logits else 0]

    def decode(self, sids: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each sequence: logits [B, V]."""
        return np.stack([self.prefill(sid, [tok]) for sid, tok in zip(sids, tokens)])

    def _logits(self, h: np.ndarray) -> np.ndarray:
        s = self.spec
        logits = rms_norm(h, self.w["final_norm"], s.norm_eps) @ self.head.T
        if s.final_softcap:
            logits = np.tanh(logits / np.float32(s.final_softcap)) * np.float32(s.final_softcap)
        return logits

    def _forward(self, seq: _Sequence, tokens: np.ndarray) -> np.ndarray:
        s, w = self.spec, self.w
        t, start = len(tokens), seq.length
        pos = np.arange(start, start + t)
        self._reserve(seq, start + t)
        x = w["embed"][tokens] * np.float32(s.embed_scale)
        for i in range(s.n_layers):
            p = f"layers.{i}."
            # attention
            a = rms_norm(x, w[p + "attn_norm"], s.norm_eps)
            qkv = a @ w[p + "qkv"].T
            if s.qkv_bias:
                qkv = qkv + w[p + "qkv_bias"]
            q = qkv[:, :s.q_dim].reshape(t, s.n_heads, s.head_dim)
            k = qkv[:, s.q_dim:s.q_dim + s.kv_dim].reshape(t, s.n_kv_heads, s.head_dim)
            v = qkv[:, s.q_dim + s.kv_dim:].reshape(t, s.n_kv_heads, s.head_dim)
            if s.qk_norm:
                q = rms_norm(q, w[p + "q_norm"], s.norm_eps)
                k = rms_norm(k, w[p + "k_norm"], s.norm_eps)
            cos, sin = cos_sin(s, i, pos)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            seq.k[i][start:start + t] = k
            seq.v[i][start:start + t] = v
            window = s.sliding_window if s.kind(i) == "sliding" else 0
            o = attention(q, seq.k[i][:start + t], seq.v[i][:start + t], pos, s.softmax_scale, window)
            o = o.reshape(t, s.q_dim) @ w[p + "o"].T
            if s.sandwich_norm:
                o = rms_norm(o, w[p + "post_attn_norm"], s.norm_eps)
            x = x + o
            # MLP
            m = rms_norm(x, w[p + "ffn_norm"], s.norm_eps)
            m = gated_act(m @ w[p + "gate_up"].T, s.activation) @ w[p + "down"].T
            if s.sandwich_norm:
                m = rms_norm(m, w[p + "post_ffn_norm"], s.norm_eps)
            x = x + m
        seq.length = start + t
        return x
