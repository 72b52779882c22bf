"""Sampling from one row of logits: penalties, temperature, top-k, top-p, min-p, seed.

`Sampler` is the host's, per request (penalties need the request's history; its seeded generator is
drawn in sequence). `choose` with `step_rng` is what an executor's decode step applies to each row.

Order (as vLLM and llama.cpp do): constraint mask, penalties, then greedy or temperature -> top-k ->
top-p -> min-p -> draw. Log-probabilities reported are of the penalised distribution at temperature 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0    # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None      # None: none; n >= 0: the chosen token's and the top n
    logit_bias: dict[int, float] = field(default_factory=dict)   # OpenAI's: added to these tokens' logits (host-sampled)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


class Sampler:
    def __init__(self, params: SamplingParams, prompt_ids: list[int]):
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.prompt_ids = prompt_ids
        self._seen: np.ndarray | None = None
        self.out_counts: dict[int, int] = {}

    @property
    def seen(self) -> np.ndarray:
        """The prompt's distinct tokens (the repetition penalty's), sorted; computed when first needed."""
        if self._seen is None:
            self._seen = np.unique(np.asarray(self.prompt_ids, dtype=np.int64))
        return self._seen

    def penalise(self, logits: np.ndarray) -> np.ndarray:
        p = self.p
        logits = logits.astype(np.float32, copy=True)
        if p.repetition_penalty != 1.0:
            ids = np.union1d(self.seen, np.fromiter(self.out_counts, dtype=np.int64)) if self.out_counts else self.seen
            if ids.size:
                v = logits[ids]
                logits[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.out_counts:
            ids = np.fromiter(self.out_counts, dtype=np.int64)
            counts = np.fromiter(self.out_counts.values(), dtype=np.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if p.logit_bias:                 # after the penalties, as OpenAI's and vLLM's logits processors are
            ids = np.fromiter(p.logit_bias, dtype=np.int64)
            logits[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float32)
        return logits

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Pick the next token; returns it and the penalised logits (for log-probabilities)."""
        logits = self.penalise(logits)
        if allowed is not None:
            logits = np.where(allowed[:logits.shape[0]], logits, -np.inf).astype(np.float32)
        tok = choose(logits, self.p, self.rng)
        self.out_counts[tok] = self.out_counts.get(tok, 0) + 1
        return tok, logits


def choose(logits: np.ndarray, p: SamplingParams | None, rng: np.random.Generator) -> int:
    """Greedy (p None or temperature 0), or temperature -> top-k -> top-p -> min-p -> draw from rng.
    The last stage of `Sampler.sample`, and what an executor applies to each row of a decode step."""
    if p is None or p.temperature <= 0:
        return int(np.argmax(logits))
    if _untruncated(p, logits.shape[0]):        # `candidates`' whole softmax, in place (no 152k-long copies)
        tokens, cdf = None, np.cumsum(_softmax_weights(logits, p), dtype=np.float64)
    else:
        tokens, probs = candidates(logits, p)
        cdf = np.cumsum(probs)
    # Generator.choice(len(cdf), p=...)'s draw without its checks of p: the cdf normalised to end at exactly 1, so a
    # uniform < 1 never lands past the last token of nonzero weight (a constraint's masked tokens weigh 0)
    cdf /= cdf[-1]
    i = int(np.searchsorted(cdf, rng.random(), side="right"))
    return i if tokens is None else int(tokens[i])


def _untruncated(p: SamplingParams, n: int) -> bool:
    return not (0 < p.top_k < n) and p.top_p >= 1.0 and p.min_p <= 0.0


def _softmax_weights(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """exp(logits / temperature - max), float32 (the whole row: ~8x cheaper than float64)."""
    z = logits / np.float32(p.temperature)
    z -= z.max()
    return np.exp(z, out=z)


# Tokens a truncated distribution (top-k, top-p, min-p) is looked for among first: a partial sort of the
# vocabulary's likeliest tokens instead of a sort of all of it (a stable argsort of 152k float64 takes ~20 ms
# on a server's CPU, a decode step's time; the partition ~1 ms). The passes over the whole row run in float32
# (exp ~8x cheaper than float64), the kept tokens' probabilities in float64.
_CANDIDATES = 1024


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a non-greedy draw picks from and their probabilities (summing to 1): all tokens in vocabulary
    order when nothing truncates the distribution, else the kept ones likeliest first (ties: lower id first)."""
    n = logits.shape[0]
    if _untruncated(p, n):                                  # the whole softmax: no order needed
        probs = _softmax_weights(logits, p).astype(np.float64)
        return np.arange(n), probs / probs.sum()
    z = logits / np.float32(p.temperature)
    k = p.top_k if 0 < p.top_k < n else n
    m = max(k if k < n else 0, _CANDIDATES)
    if m < n:
        top = np.argpartition(-z, m - 1)[:m]
        top.sort()                                          # ids ascending, so the stable sort breaks ties by id
        order = top[np.argsort(-z[top], kind="stable")]
        kept = _truncate(logits, order[:k] if k < n else order, p, None if k < n else z)
        if kept is not None:
            return kept
    order = np.argsort(-z, kind="stable")[:k]
    return _truncate(logits, order, p, None)


def _truncate(logits: np.ndarray, order: np.ndarray, p: SamplingParams, row: np.ndarray | None):
    """top-p then min-p over `order` (the top-k tokens, likeliest first). row: the whole row's scaled float32
    logits when `order` is only its leading candidates (the row's mass is the normaliser); None when `order`
    is the whole distribution to keep from. Returns None when the kept set may reach past the candidates."""
    zs = logits[order].astype(np.float64) / p.temperature
    probs = np.exp(zs - zs[0])
    total = probs.sum() if row is None else np.exp(row - np.float32(zs[0])).sum(dtype=np.float64)
    probs /= total
    keep = len(order)
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cum = np.cumsum(probs)
        if row is not None and cum[-1] < p.top_p:
            return None
        keep = min(keep, int(np.searchsorted(cum, p.top_p)) + 1)
    if p.min_p > 0.0:
        above = int(np.sum(probs >= p.min_p * probs[0]))
        if row is not None and p.top_p >= 1.0 and above == len(order):
            return None
        keep = min(keep, max(1, above))
    probs = probs[:keep]
    return order[:keep], probs / probs.sum()


def step_rng(seed: int, position: int) -> np.random.Generator:
    """The generator a seeded row draws its token at `position` from when an executor samples it: a
    function of (seed, position) only, so a sequence recomputed after preemption, or decoded in another
    batch, draws the same tokens."""
    return np.random.default_rng([seed % (1 << 64), position])
