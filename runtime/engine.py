"""The request path below the server: tokens in, a stream of token events out.

Engine owns the bundle, the tokenizer, the chat template and one executor. `generate` drives
prefill, then decode steps, sampling each token on the host and applying stop strings; callers
(impc run, the HTTP server) only iterate over TokenEvents.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from imp_runtime.bundle import Bundle, load_bundle
from imp_runtime.chat_template import ChatTemplate
from imp_runtime.sampler import Sampler, SamplingParams, log_softmax
from imp_runtime.tokenizer import Tokenizer


class Constraint(Protocol):
    """Constrained decoding (structured output, forced tool calls): which tokens may come next."""
    def allowed(self) -> np.ndarray | None: ...       # bool [vocab] or None for no restriction
    def advance(self, token_id: int) -> None: ...
    def is_done(self) -> bool: ...


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, bad parameters); safe to show the user."""


@dataclass
class TokenEvent:
    token_id: int
    text: str                                  # new text this token adds (may be "" while held back)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None           # None while running; "stop" | "length" at the end


def make_executor(bundle: Bundle, device: str = "auto"):
    """`cuda` when a GPU and a matching cubin are present, `cpu` otherwise; `device` forces one."""
    if device not in ("auto", "cpu", "cuda"):
        raise RequestError(f"unknown device '{device}': choose auto, cpu or cuda")
    if device in ("auto", "cuda"):
        try:
            from imp_runtime.executor_cuda import CudaExecutor, gpu_available
        except ImportError:
            if device == "cuda":
                raise RequestError("the cuda executor is not available in this build") from None
        else:
            if gpu_available():
                return CudaExecutor(bundle)
            if device == "cuda":
                raise RequestError("no NVIDIA GPU with a working driver was found (use --device cpu)")
    from imp_runtime.executor_cpu import CpuExecutor
    return CpuExecutor(bundle)


class Engine:
    def __init__(self, bundle_path: str | Path, device: str = "auto", verify: bool = True):
        self.bundle = load_bundle(bundle_path, verify=verify)
        m = self.bundle.manifest
        self.name = self.bundle.name
        self.tokenizer = Tokenizer(self.bundle.tokenizer_json(), m["tokenizer"])
        self.chat = ChatTemplate(self.bundle.chat_template(), m["tokenizer"].get("bos_token"),
                                 m["tokenizer"].get("eos_token"))
        self.executor = make_executor(self.bundle, device)
        self.max_context: int = m["plan"]["max_context"]
        self.generation_defaults: dict = m.get("generation", {})
        self.lock = threading.Lock()   # one executor step at a time; requests interleave step by step

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
        return self.chat.render(messages, tools=tools, add_generation_prompt=True, **kwargs)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, tools, **kwargs))

    def start(self, prompt_ids: list[int], params: SamplingParams,
              constraint: Constraint | None = None) -> "Generation":
        """Check a request and prefill it; then `next_event` / `decode_batch` drive it."""
        g = Generation(self, prompt_ids, params, constraint)
        try:
            g.prefill()
        except BaseException:
            g.close()
            raise
        return g

    def decode_batch(self, gens: list["Generation"]) -> None:
        """One decode step for every generation that has a pending token, as ONE executor batch:
        continuous batching (sequences join and leave between steps)."""
        gens = [g for g in gens if g.pending is not None]
        if not gens:
            return
        with self.lock:
            logits = self.executor.decode([g.sid for g in gens], [g.pending for g in gens])
        for g, row in zip(gens, logits):
            g.logits, g.pending = row, None

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 constraint: Constraint | None = None) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token; the last carries finish_reason. Closing the
        iterator early (a client went away) frees the sequence's KV cache."""
        g = Generation(self, prompt_ids, params, constraint)
        try:
            g.prefill()
            while True:
                ev = g.next_event()
                yield ev
                if ev.finish_reason:
                    return
                self.decode_batch([g])
        finally:
            g.close()


class Generation:
    """One request's generation: its sequence in the executor, its sampler, its detokenizer and the
    stop-string hold-back. `next_event` samples from the latest logits; the token it returns becomes
    `pending` until a decode step (`Engine.decode_batch`, possibly shared with other generations)
    turns it into the next logits."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
                 constraint: Constraint | None):
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= engine.max_context:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the context holds {engine.max_context}")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        self.engine, self.prompt_ids, self.params, self.constraint = engine, list(prompt_ids), params, constraint
        self.budget = min(params.max_tokens, engine.max_context - len(prompt_ids))
        self.sampler = Sampler(params, prompt_ids)
        self.detok = engine.tokenizer.detokenizer()
        self.stops = [s for s in params.stop if s]
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.tokenizer.eos_ids)
        self.held = ""                 # text not yet released: it might be the start of a stop string
        self.n = 0                     # tokens sampled so far
        self.sid: int | None = None
        self.logits: np.ndarray | None = None
        self.pending: int | None = None
        self.finished = False

    def prefill(self) -> None:
        ex = self.engine.executor
        with self.engine.lock:
            self.sid = ex.new_sequence()
            self.logits = ex.prefill(self.sid, self.prompt_ids)

    def next_event(self) -> TokenEvent:
        """Sample the next token from the current logits and say what text it adds."""
        p, constraint = self.params, self.constraint
        self.n += 1
        allowed = constraint.allowed() if constraint else None
        tok, scored = self.sampler.sample(self.logits, allowed)
        self.logits = None
        if constraint:
            constraint.advance(tok)
        lp, top = None, []
        if p.logprobs is not None:
            ls = log_softmax(scored)
            lp = float(ls[tok])
            if p.logprobs > 0:
                idx = np.argsort(-ls)[:p.logprobs]
                top = [(int(i), float(ls[i])) for i in idx]
        if tok in self.stop_ids:
            return self._finish(TokenEvent(tok, self.held, lp, top, "stop"))
        self.held += self.detok.add(tok)
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return self._finish(TokenEvent(tok, self.held[:cut], lp, top, "stop"))
        finish = None
        if constraint and constraint.is_done():
            finish = "stop"
        elif self.n == self.budget:
            finish = "length"
        keep = 0 if finish else _stop_prefix_len(self.held, self.stops)
        text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if finish:
            return self._finish(TokenEvent(tok, text, lp, top, finish))
        self.pending = tok
        return TokenEvent(tok, text, lp, top, None)

    def _finish(self, ev: TokenEvent) -> TokenEvent:
        self.finished = True
        return ev

    def close(self) -> None:
        """Free the sequence's KV cache (idempotent)."""
        if self.sid is not None:
            with self.engine.lock:
                self.engine.executor.free(self.sid)
            self.sid = None
        self.pending = None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
