"""The `cpu` executor: the reference forward pass in numpy float32.

It runs the bundle's exact stored values (NVFP4 and bf16 weights are de-quantized once at load), so
it is the oracle every GPU kernel is compared with, the backend of the test suite, and what serves on
a machine without a GPU. Each function below is the reference of one kernel family in templates/.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from imp_runtime.bundle import Bundle
from imp_runtime.executor import PrefillChunk, StepResult, StepRow
from imp_runtime.rope import apply_rope, cos_sin
from imp_runtime.sampler import choose, step_rng
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


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths: np.ndarray, scale: float,
                     window: int) -> np.ndarray:
    """`attention` for a decode batch: row b's one query (at position lengths[b] - 1) over its keys
    0 .. lengths[b] - 1, every row at once. q [B, H, hd]; k/v [B, S, KV, hd], S >= max(lengths), where
    keys past a row's length are padding (masked, whatever they hold) -> [B, H, hd]. The reference of
    templates/attn_decode.cu.j2; equal to `attention` row by row (tests/test_continuous_batching.py)."""
    b, h, hd = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    qg = q.reshape(b, kv, g, hd)
    # [B, KV, G, hd] @ [B, KV, hd, S]: one batched product per layer, not one per row; the transposed
    # views have a unit stride in one of their last two axes, so matmul hands them to BLAS uncopied
    scores = np.matmul(qg, k.transpose(0, 2, 3, 1)) * np.float32(scale)
    k_pos = np.arange(s)
    q_pos = lengths - 1
    mask = k_pos[None, :] > q_pos[:, None]                                # [B, S]
    if window:
        mask |= (q_pos[:, None] - k_pos[None, :]) >= window
    scores = np.where(mask[:, None, None, :], np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    # padding keys have p = 0, so their values (zeros, or finite KV of another sequence) add nothing
    return np.matmul(p, v.transpose(0, 2, 1, 3)).reshape(b, h, hd)          # [B, KV, G, hd]


# ------------------------------------------------------------------ executor

KV_BUDGET_BYTES = 1 << 30          # the pool's cap on the host (numpy's zeroed memory is committed lazily
                                   # unless commit_pool is called: a server does, at load)
DEFAULT_PAGE_SIZE = 16             # a cpu-only bundle plans no GPU target to take these from
DEFAULT_PREFILL_CHUNK = 512


@dataclass
class _Sequence:
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # page of each page index


@dataclass
class CpuExecutor:
    """The paged KV pool is kv[layer, K|V, page, offset, kv_head, head_dim] in float32; a sequence's
    position p lives at (pages[p // page_size], p % page_size), pages being what `set_pages` gave."""
    bundle: Bundle
    num_pages: int | None = None           # None: from the plan (context x batch), capped by kv_bytes
    kv_bytes: int = KV_BUDGET_BYTES
    w: dict[str, np.ndarray] = field(init=False, repr=False)       # embedding, norms, biases
    wt: dict[str, np.ndarray] = field(init=False, repr=False)      # linear weights, transposed
    name = "cpu"
    async_decode = False                   # decode_submit computes the step before it returns
    mixed_steps = False                    # a mixed step costs what its parts do: the scheduler keeps them apart
    penalties_on_device = False            # the engine applies penalties on the host (it gets such rows' logits)
    samples_chunks = True                  # a mixed step's prompt-ending chunk gets its first token as a decode row
    feeds_sampled = True                   # StepRow.token None: the token the previous step sampled for the row
    max_segments = 16                      # (when a test mixes them anyway)

    def __post_init__(self):
        self.spec: ModelSpec = self.bundle.spec
        self.w = self.bundle.float_weights()
        # linear weights held as W.T, [in, out] contiguous: BLAS multiplies a few rows by it about 1.5x
        # faster than by the stored [out, in] transposed on the fly, which is what batched decode needs
        self.wt = {name: np.ascontiguousarray(self.w.pop(name).T) for name in list(self.w)
                   if name.rsplit(".", 1)[-1] in ("qkv", "o", "gate_up", "down") or name == "lm_head"}
        self.head_t = np.ascontiguousarray(self.w["embed"].T) if self.spec.tie_embeddings else self.wt.pop("lm_head")
        plan = self.bundle.manifest["plan"]
        target = next(iter(plan.get("targets", {}).values()), {})
        self.max_context: int = plan["max_context"]
        self.max_batch: int = plan.get("max_batch", 64)
        self.page_size: int = target.get("page_size", DEFAULT_PAGE_SIZE)
        self.prefill_chunk: int = min(target.get("prefill_chunk", plan.get("prefill_chunk", DEFAULT_PREFILL_CHUNK)),
                                      self.max_context)
        s = self.spec
        page_bytes = 2 * s.n_layers * self.page_size * s.kv_dim * 4
        one_sequence = math.ceil(self.max_context / self.page_size)
        if self.num_pages is None:
            wanted = math.ceil(self.max_context * self.max_batch / self.page_size)
            self.num_pages = 1 + max(one_sequence, min(wanted, self.kv_bytes // page_bytes))
        self.kv = np.zeros((s.n_layers, 2, self.num_pages, self.page_size, s.n_kv_heads, s.head_dim), np.float32)
        self._seqs: dict[int, _Sequence] = {}
        self._next = 1
        self._rng = np.random.default_rng()      # rows sampled without a seed
        self._last_sampled: dict[int, int] = {}   # sid -> the token the last step sampled for it

    def commit_pool(self) -> None:
        """Write the whole KV pool once, so the OS backs every page now. The block manager keeps finished
        sequences' full pages for the prefix cache and evicts only when no page is free, so a server
        touches the whole pool sooner or later; committed at load, its resident memory is flat from the
        start instead of growing for as long as the cache takes to reach every page."""
        self.kv.fill(0)

    # --- sequences: slots and their pages ---

    def new_sequence(self) -> int:
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = _Sequence()
        return sid

    def set_pages(self, sid: int, pages: list[int]) -> None:
        self._seqs[sid].pages = np.asarray(pages, dtype=np.int64)

    def free(self, sid: int) -> None:
        self._seqs.pop(sid, None)

    def _slots(self, sid: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset) of each position of sid."""
        pages = self._seqs[sid].pages
        index = positions // self.page_size
        if positions.size and int(index.max()) >= len(pages):
            raise ValueError(f"sequence {sid} has {len(pages)} KV pages; position {int(positions.max())} "
                             f"needs {int(index.max()) + 1} (set_pages first)")
        return pages[index], positions % self.page_size

    def _kv_of(self, sid: int, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions 0 .. n-1 of sid, gathered from its pages: [n, KV, hd] each."""
        s, pages = self.spec, self._seqs[sid].pages[:math.ceil(n / self.page_size)]
        kv = np.take(self.kv[layer], pages, axis=1).reshape(2, -1, s.n_kv_heads, s.head_dim)
        return kv[0, :n], kv[1, :n]

    # --- forward ---

    def prefill(self, sid: int, tokens: list[int], start: int, all_logits: bool = False) -> np.ndarray:
        """Write KV for tokens at positions start.. (earlier positions already hold KV); logits of the
        last token [V], or of every token [T, V]."""
        if start + len(tokens) > self.max_context:
            raise ValueError(f"sequence of {start + len(tokens)} tokens exceeds the context of {self.max_context}")
        pos = np.arange(start, start + len(tokens))
        slots = self._slots(sid, pos)

        def attend(layer: int, q: np.ndarray, window: int) -> np.ndarray:
            k, v = self._kv_of(sid, layer, start + len(tokens))
            return attention(q, k, v, pos, self.spec.softmax_scale, window)

        h = self._forward(np.asarray(tokens, dtype=np.int64), pos, slots, attend)
        return self._logits(h if all_logits else h[-1:])[slice(None) if all_logits else 0]

    def decode(self, rows: list[StepRow]) -> StepResult:
        """One token for every row as one batch: each linear is one matrix product over all rows, and
        attention one batched product over every row's pages (padded to the longest row, masked); then
        each row is sampled with its parameters."""
        if not 1 <= len(rows) <= self.max_batch:
            raise ValueError(f"a decode step takes 1 to {self.max_batch} rows, not {len(rows)}")
        pos = np.asarray([r.position for r in rows], dtype=np.int64)
        if int(pos.max()) >= self.max_context:
            raise ValueError(f"position {int(pos.max())} is past the context of {self.max_context}")
        per_row = [self._slots(r.sid, pos[i:i + 1]) for i, r in enumerate(rows)]
        slots = (np.concatenate([p for p, _ in per_row]), np.concatenate([o for _, o in per_row]))

        # every row's pages as one matrix (padded with page 0), so each layer gathers all rows' KV at once
        tables = [self._seqs[r.sid].pages[:r.position // self.page_size + 1] for r in rows]
        page_matrix = np.zeros((len(rows), max(len(t) for t in tables)), np.int64)
        for i, t in enumerate(tables):
            page_matrix[i, :len(t)] = t

        def attend(layer: int, q: np.ndarray, window: int) -> np.ndarray:
            s = self.spec
            # np.take, not kv[:, pages]: that result is not contiguous, and reshaping it copies slowly
            kv = np.take(self.kv[layer], page_matrix, axis=1).reshape(2, len(rows), -1, s.n_kv_heads, s.head_dim)
            return decode_attention(q, kv[0], kv[1], pos + 1, s.softmax_scale, window)

        fed = []
        for r in rows:              # token None: the one the previous step sampled for the sequence
            if r.token is None and r.sid not in self._last_sampled:
                raise ValueError(f"sequence {r.sid} has no token sampled by the previous step to feed")
            fed.append(self._last_sampled[r.sid] if r.token is None else r.token)
        h = self._forward(np.asarray(fed, dtype=np.int64), pos, slots, attend)
        logits = self._logits(h)
        tokens = []
        for i, r in enumerate(rows):
            seeded = r.params is not None and r.params.seed is not None
            tokens.append(choose(logits[i], r.params, step_rng(r.params.seed, r.position + 1) if seeded else self._rng))
        self._last_sampled = {r.sid: t for r, t in zip(rows, tokens)}
        return StepResult(tokens, {i: logits[i] for i, r in enumerate(rows) if r.want_logits})

    def decode_submit(self, rows: list[StepRow], chunks: list[PrefillChunk] | None = None) -> StepResult:
        result = self.decode(rows) if rows or not chunks else StepResult([])
        if not rows:
            self._last_sampled = {}
        for c in chunks or []:     # other sequences: their prefills are independent of the decode rows
            logits = self.prefill(c.sid, c.tokens, c.start)
            result.chunk_logits.append(logits if c.want_logits else None)
            tok = None
            if c.sample:           # as a decode row draws its token (the new token's position seeds the draw)
                seeded = c.params is not None and c.params.seed is not None
                end = c.start + len(c.tokens)
                tok = choose(logits, c.params, step_rng(c.params.seed, end) if seeded else self._rng)
            result.chunk_tokens.append(tok)
            if tok is not None:
                self._last_sampled[c.sid] = tok
        return result

    def decode_collect(self, handle: StepResult) -> StepResult:
        return handle

    def _logits(self, h: np.ndarray) -> np.ndarray:
        s = self.spec
        logits = rms_norm(h, self.w["final_norm"], s.norm_eps) @ self.head_t
        if s.final_softcap:
            logits = np.tanh(logits / np.float32(s.final_softcap)) * np.float32(s.final_softcap)
        return logits

    def _forward(self, tokens: np.ndarray, pos: np.ndarray, slots: tuple[np.ndarray, np.ndarray],
                 attend) -> np.ndarray:
        """The layers over T rows (one sequence's chunk or one row per sequence): row t has position
        pos[t] and its KV goes to slots[t]; attend(layer, q, window) -> [T, H, hd] reads the cache."""
        s, w, wt = self.spec, self.w, self.wt
        t = len(tokens)
        page, offset = slots
        x = w["embed"][tokens] * np.float32(s.embed_scale)
        rope: dict = {}               # (base, scaling) -> the rows' cos, sin: computed once a forward, not a layer
        for i in range(s.n_layers):
            p = f"layers.{i}."
            # attention
            a = rms_norm(x, w[p + "attn_norm"], s.norm_eps)
            qkv = a @ wt[p + "qkv"]
            if s.qkv_bias:
                qkv = qkv + w[p + "qkv_bias"]
            q = qkv[:, :s.q_dim].reshape(t, s.n_heads, s.head_dim)
            k = qkv[:, s.q_dim:s.q_dim + s.kv_dim].reshape(t, s.n_kv_heads, s.head_dim)
            v = qkv[:, s.q_dim + s.kv_dim:].reshape(t, s.n_kv_heads, s.head_dim)
            if s.qk_norm:
                q = rms_norm(q, w[p + "q_norm"], s.norm_eps)
                k = rms_norm(k, w[p + "k_norm"], s.norm_eps)
            key = s.rope_for(i)
            if key not in rope:
                rope[key] = cos_sin(s, i, pos)
            cos, sin = rope[key]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.kv[i, 0, page, offset] = k
            self.kv[i, 1, page, offset] = v
            o = attend(i, q, s.sliding_window if s.kind(i) == "sliding" else 0)
            o = o.reshape(t, s.q_dim) @ wt[p + "o"]
            if s.sandwich_norm:
                o = rms_norm(o, w[p + "post_attn_norm"], s.norm_eps)
            x = x + o
            # MLP
            m = rms_norm(x, w[p + "ffn_norm"], s.norm_eps)
            m = gated_act(m @ wt[p + "gate_up"], s.activation) @ wt[p + "down"]
            if s.sandwich_norm:
                m = rms_norm(m, w[p + "post_ffn_norm"], s.norm_eps)
            x = x + m
        return x
