"""The request path below the server: tokens in, a stream of token events out.

Engine owns the bundle, the tokenizer, the chat template, one executor and the scheduler over it
(runtime/scheduler.py decides each step; runtime/kv_blocks.py holds the pages and the prefix cache).
A `Generation` is one request's host-side work: sampling where the host must (logprobs, penalties,
constraints), stop strings and detokenizing. `generate` serves one request from the caller's thread
(impc run); the HTTP server's queue steps the same scheduler from its worker thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from imp_runtime.bundle import Bundle, load_bundle
from imp_runtime.chat_template import ChatTemplate, TemplateError
from imp_runtime.kv_blocks import BlockManager
from imp_runtime.sampler import Sampler, SamplingParams, choose, log_softmax, step_rng
from imp_runtime.scheduler import Request, RequestTooLarge, Scheduler, SchedulerConfig
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
    cached_tokens: int = 0                     # prompt tokens whose KV came from the prefix cache


def make_executor(bundle: Bundle, device: str = "auto", kv_pages: int | None = None):
    """`cuda` when a GPU and a matching cubin are present, `cpu` otherwise; `device` forces one.
    kv_pages (cpu only): the KV pool's size in pages (padding page included) instead of the default."""
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
                if kv_pages is not None:       # the cuda executor's memory is the bundle's plan, nothing else
                    raise RequestError("the cuda executor's KV pool is the bundle's memory plan; "
                                       "recompile with `impc compile ... --vram GiB` to change it")
                return CudaExecutor(bundle)
            if device == "cuda":
                raise RequestError("no NVIDIA GPU with a working driver was found (use --device cpu)")
    from imp_runtime.executor_cpu import CpuExecutor
    return CpuExecutor(bundle, num_pages=kv_pages)


class Engine:
    """The bundle, its tokenizer and chat template, one executor, and the scheduler that shares the
    executor among requests (with the KV block manager and its prefix cache)."""

    def __init__(self, bundle_path: str | Path, device: str = "auto", verify: bool = True,
                 max_running: int | None = None, kv_pages: int | None = None):
        self.bundle = load_bundle(bundle_path, verify=verify)
        m = self.bundle.manifest
        self.name = self.bundle.name
        self.tokenizer = Tokenizer(self.bundle.tokenizer_json(), m["tokenizer"])
        self.chat = ChatTemplate(self.bundle.chat_template(), m["tokenizer"].get("bos_token"),
                                 m["tokenizer"].get("eos_token"))
        self.executor = make_executor(self.bundle, device, kv_pages)
        self.max_context: int = m["plan"]["max_context"]
        self.generation_defaults: dict = m.get("generation", {})
        self.blocks = BlockManager(self.executor.num_pages, self.executor.page_size)
        self.scheduler = Scheduler(self.executor, self.blocks, SchedulerConfig.for_executor(self.executor, max_running))

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, continue_final: bool = False,
                    **kwargs) -> str:
        """The chat's prompt text: the assistant's turn opened after the messages, or (continue_final) the last
        message, an assistant's, left open so the answer continues it (a prefill: Anthropic's final assistant message,
        vLLM's continue_final_message): rendered without a new turn and cut after that message's text, as
        transformers' apply_chat_template(continue_final_message=True) does."""
        if not continue_final:
            return self.chat.render(messages, tools=tools, add_generation_prompt=True, **kwargs)
        text = self.chat.render(messages, tools=tools, add_generation_prompt=False, **kwargs)
        final = messages[-1]["content"].strip()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise TemplateError("the template does not write the final assistant message's text as it is, so the "
                                "answer cannot continue it")
        return text[:at + len(final)]

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, tools, **kwargs))

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               constraint: Constraint | None = None) -> Request:
        """Check a request and queue it on the scheduler (RequestError when it cannot be served)."""
        gen = Generation(self, prompt_ids, params, constraint)
        try:
            return self.scheduler.submit(gen)
        except RequestTooLarge as e:
            raise RequestError(str(e)) from None

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 constraint: Constraint | None = None) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token; the last carries finish_reason. The caller's thread
        steps the scheduler (so not for a scheduler a server's worker steps). Closing the iterator early
        cancels the request, which frees its KV pages at once."""
        req = self.submit(prompt_ids, params, constraint)
        try:
            while not req.done:
                for out in self.scheduler.step():
                    if out.request is req:
                        if out.error is not None:
                            raise out.error
                        yield out.event
        finally:
            self.scheduler.cancel(req)

    def generate_many(self, prompts: list[list[int]], params: SamplingParams) -> list[list[TokenEvent]]:
        """Several requests at once through the scheduler (continuous batching); each one's events."""
        reqs = [self.submit(p, params) for p in prompts]
        events: dict[int, list[TokenEvent]] = {id(r): [] for r in reqs}
        try:
            while not all(r.done for r in reqs):
                for out in self.scheduler.step():
                    if out.error is not None:
                        raise out.error
                    events[id(out.request)].append(out.event)
        finally:
            for r in reqs:
                self.scheduler.cancel(r)
        return [events[id(r)] for r in reqs]


class Generation:
    """One request's host side: its sampler, its detokenizer and the stop-string hold-back. The
    scheduler feeds it each step's result: `on_logits` where the request samples on the host (logprobs,
    a token-mask constraint, a logit bias, penalties unless the executor applies them, and a first token that comes from
    a prefill's logits), `on_token` where the executor sampled it (decode rows, and a mixed step's prompt-ending
    chunks on executors with `samples_chunks`)."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
                 constraint: Constraint | None):
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= engine.max_context:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the context holds {engine.max_context}")
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        self.prompt_ids, self.params, self.constraint = list(prompt_ids), params, constraint
        self.budget = min(params.max_tokens, engine.max_context - len(prompt_ids))
        self.penalised = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                          or params.frequency_penalty != 0.0)
        self.host_sampled = (constraint is not None or params.logprobs is not None or bool(params.logit_bias)
                             or (self.penalised and not getattr(engine.executor, "penalties_on_device", False)))
        self.sampler = Sampler(params, prompt_ids)
        self.detok = engine.tokenizer.detokenizer()
        self.stops = [s for s in params.stop if s]
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.tokenizer.eos_ids)
        self.held = ""                 # text not yet released: it might be the start of a stop string
        self.out: list[int] = []       # tokens sampled so far
        self.finished = False

    # --- what the scheduler reads ---

    @property
    def kv_length(self) -> int:
        """Positions whose KV must be written before the next decode step: all but the last sampled token."""
        return len(self.prompt_ids) + max(len(self.out) - 1, 0)

    def kv_tokens(self) -> list[int]:
        return (self.prompt_ids + self.out)[:self.kv_length]

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.out

    @property
    def pending(self) -> int:
        """The token the next decode step feeds: the last one sampled."""
        return self.out[-1]

    # --- the step's result ---

    def on_logits(self, logits: np.ndarray) -> TokenEvent:
        allowed = self.constraint.allowed() if self.constraint else None
        if self.host_sampled:
            tok, scored = self.sampler.sample(logits, allowed)
        else:      # as the executor samples (its penalties too): a seeded draw depends on (seed, position) only
            if self.penalised:
                logits = self.sampler.penalise(logits)
            seed, pos = self.params.seed, len(self.prompt_ids) + len(self.out)
            tok, scored = choose(logits, self.params, self.sampler.rng if seed is None else step_rng(seed, pos)), logits
        return self._event(tok, scored)

    def on_token(self, tok: int) -> TokenEvent:
        return self._event(tok, None)

    def _event(self, tok: int, scored: np.ndarray | None) -> TokenEvent:
        self.record(tok)
        return self.describe(tok, scored)

    # The two halves of taking a token. A pipelining scheduler calls `record` before it launches the next
    # step (which feeds this token) and `describe` while the device computes that step.

    def record(self, tok: int) -> bool:
        """The cheap half: the token joins the sequence. True when it ends the generation whatever its text
        says (an end-of-sequence or stop token, the token budget); `describe` may also end it on a stop
        string or a finished constraint (a constrained request samples on the host: never pipelined)."""
        self.out.append(tok)
        if self.penalised and not self.host_sampled:    # (the host sampler counts its own draws)
            # the penalties' history: a preempted request's device state is rebuilt from these counts
            self.sampler.out_counts[tok] = self.sampler.out_counts.get(tok, 0) + 1
        if self.constraint:
            self.constraint.advance(tok)
        return tok in self.stop_ids or len(self.out) == self.budget

    def describe(self, tok: int, scored: np.ndarray | None) -> TokenEvent:
        """The rest, for the token `record` took last: its logprobs, the text it adds (detokenizing, the
        stop-string hold-back) and whether it ends the generation."""
        p, constraint = self.params, self.constraint
        lp, top = None, []
        if p.logprobs is not None:
            ls = log_softmax(scored)
            lp = float(ls[tok])
            if p.logprobs > 0:
                idx = np.argsort(-ls)[:p.logprobs]
                top = [(int(i), float(ls[i])) for i in idx]
        if tok in self.stop_ids:
            return self._finish(TokenEvent(tok, self.held, lp, top, "stop"))
        text = self.detok.add(tok)
        if self.stops:              # text that may start a stop string is held back until it cannot
            self.held += text
            cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                return self._finish(TokenEvent(tok, self.held[:cut], lp, top, "stop"))
        finish = "stop" if constraint and constraint.is_done() else "length" if len(self.out) == self.budget else None
        if self.stops:
            keep = 0 if finish else _stop_prefix_len(self.held, self.stops)
            text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        ev = TokenEvent(tok, text, lp, top, finish)
        return self._finish(ev) if finish else ev

    def _finish(self, ev: TokenEvent) -> TokenEvent:
        self.finished = True
        return ev


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
