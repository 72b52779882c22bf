"""What every endpoint shares: the engine and its queue, limits, model check, prompt building, token
budgets, sampling parameters, and a `Choice` that turns token events into text and tool-call parts."""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from starlette.requests import Request

from imp_runtime.chat_template import TemplateError
from imp_runtime.engine import Engine, TokenEvent
from imp_runtime.sampler import SamplingParams
from imp_runtime.server.errors import APIError, bad_request
from imp_runtime.server.fields import (get_bool, get_int, get_logit_bias, get_number, get_obj, get_str,
                                      get_token_ids)
from imp_runtime.server.metrics import Metrics
from imp_runtime.server.queue import FairQueue, Job
from imp_runtime.server.reasoning import ReasoningPart, ThinkSplitter, opens_inside, template_thinks
from imp_runtime.server.structured import Grammar, Grammars, GrammarConstraint
from imp_runtime.server.tools import (CallArgs, CallStart, Part, TextPart, Tool, ToolCall, ToolFormat,
                                      detect_format)


_INT32_MAX = 2**31 - 1


@dataclass
class Limits:
    max_n: int = 8                       # choices per request
    max_body_bytes: int = 4 << 20        # larger bodies are a 413
    max_json_depth: int = 64             # deeper bodies are a 400 (deep enough for any real JSON schema)
    max_running: int | None = None       # generations interleaved at once; the rest wait in FIFO order (None:
                                         # the executor's largest decode batch)
    page_size: int = 16                  # KV page size reported in metrics
    step_tokens: int | None = None       # tokens one step computes at most (decode rows + prefill); None: the chunk
    allowed_origins: tuple[str, ...] = ()   # origins whose browser pages may call the API (CORS); () the same origin
    reasoning: bool = True               # a thinking model's <think> block told apart from its answer (reasoning.py)
    model_names: tuple[str, ...] = ()    # the names requests may give (vLLM's --served-model-name): the first is the
                                         # one responses and /health report; "*" takes any name (as llama.cpp's
                                         # server does); () the bundle's own name only


@dataclass(frozen=True)
class ModelNames:
    """The model names a server answers to (Limits.model_names, `impc serve --served-model-name`): `names` in order,
    the first the one it reports; `any`: every name is taken, as llama.cpp's server does, for agent stacks that send
    their own model names (an Anthropic SDK's "claude-..."). By default only the bundle's name, as vLLM does."""
    names: tuple[str, ...]
    any: bool = False

    @classmethod
    def of(cls, given: tuple[str, ...] | list[str], bundle_name: str) -> "ModelNames":
        named = tuple(dict.fromkeys(n for n in given if n != "*"))      # in order, once each
        return cls(named or (bundle_name,), "*" in given)

    def serves(self, name: str) -> bool:
        return self.any or name in self.names


_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def template_kwargs(body: dict) -> dict:
    """The request's `chat_template_kwargs`: variables for the chat template, not the ones the server sets."""
    extra = get_obj(body, "chat_template_kwargs", {})
    for k in extra:
        if k in _TEMPLATE_OWN or not k.isidentifier():
            raise bad_request(f"chat_template_kwargs.{k}", "the server sets this variable" if k in _TEMPLATE_OWN
                              else "expected a template variable name")
    return extra


class Service:
    def __init__(self, engine: Engine, api_key: str | None = None, limits: Limits | None = None):
        self.engine = engine
        self.api_key = api_key
        self.limits = limits or Limits()
        self.served = ModelNames.of(self.limits.model_names, engine.name)
        self.model = self.served.names[0]           # the name responses and /health report
        self.metrics = Metrics()
        self.metrics.watch_scheduler(engine.scheduler)
        self.queue = FairQueue(engine, self.metrics, self.limits.max_running, self.limits.page_size,
                               self.limits.step_tokens)
        self.tool_format: ToolFormat = detect_format(engine.chat.source)
        tok = engine.tokenizer
        vocab = max(engine.bundle.spec.vocab_size, tok.vocab_size)
        self.grammars = Grammars(engine.bundle.tokenizer_json(), vocab, tok.eos_ids)
        self.created = int(time.time())
        self.live: set[Job] = set()       # jobs whose client still waits for them
        self.closing: str | None = None   # why the server is shutting down, once it is: no new jobs


    def close(self) -> None:
        self.queue.close()

    # --- request pieces ---

    def serves(self, name: str) -> bool:
        return self.served.serves(name)

    def unknown_model(self, name: str, status: int = 404) -> APIError:
        served = ", ".join(f"'{n}'" for n in self.served.names)
        return APIError(status, f"model: the model '{name}' does not exist; this server serves {served}",
                        param="model", code="model_not_found")

    def check_model(self, body: dict, required: bool = False, status: int = 404) -> str:
        """The name responses report (the first served name) for a request whose `model` the server serves."""
        name = get_str(body, "model", required=required)
        if name is not None and not self.serves(name):
            raise self.unknown_model(name, status)
        return self.model

    def encode_chat(self, messages: list[dict], tools: list[Tool], field_name: str = "messages",
                    body: dict | None = None, continue_final: bool = False) -> list[int]:
        """A chat's prompt ids: the model's template over the messages and tools, with the request's
        `chat_template_kwargs` (vLLM's and SGLang's field: e.g. Qwen3's {"enable_thinking": false}) where `body` is
        given; `continue_final`: the answer continues the last message, an assistant's (Engine.render_chat)."""
        if continue_final and (messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls")):
            raise bad_request(field_name, "to continue the final message, it must be an assistant's text")
        msgs, tools_arg = self.tool_format.prepare(messages, tools)
        extra = template_kwargs(body) if body is not None else {}
        try:
            text = self.engine.render_chat(msgs, tools_arg, continue_final=continue_final, **extra)
        except TemplateError as e:
            raise bad_request(field_name, f"the model's chat template refused these messages: {e}") from None
        return self.engine.tokenizer.encode(text)

    def encode_text(self, text: str) -> list[int]:
        """A raw prompt, with the BOS the tokenizer's own post-processor adds (as transformers does)."""
        return self.engine.tokenizer.encode(text, add_special_tokens=True)

    def budget(self, n_prompt: int, max_tokens: int | None, prompt_field: str, max_field: str) -> int:
        """The tokens a generation may produce: the request's max_tokens, or the rest of the context."""
        ctx = self.engine.max_context
        if n_prompt == 0:
            raise bad_request(prompt_field, "the prompt is empty")
        if n_prompt >= ctx:
            raise bad_request(prompt_field, f"the prompt has {n_prompt} tokens but the model's context holds "
                                            f"{ctx}; shorten it")
        if max_tokens is None:
            return ctx - n_prompt
        if n_prompt + max_tokens > ctx:
            raise bad_request(max_field, f"{max_tokens} tokens requested after a prompt of {n_prompt} tokens "
                                         f"exceed the model's context of {ctx}; ask for at most {ctx - n_prompt}")
        return max_tokens

    def reasoning_start(self, ids: list[int], grammar: Grammar | None = None) -> bool | None:
        """For a chat prompt: None where answers are not split into reasoning and answer (the template is no
        thinking model's, or `--reasoning-parser none`), else whether the prompt left a <think> open. Also None where
        the prompt left it open and a grammar constrains the answer: the grammar's text is the answer, from its first
        token (split, it would all be reasoning)."""
        if not (self.limits.reasoning and template_thinks(self.engine.chat.source)):
            return None
        inside = opens_inside(self.engine.tokenizer.decode(ids[-16:], skip_special_tokens=False))
        return None if inside and grammar is not None else inside

    def sampling(self, body: dict, max_tokens: int, *, temperature_max: float = 2.0, stop: list[str] = (),
                 logprobs: int | None = None) -> SamplingParams:
        """The sampling fields both OpenAI and Anthropic share (names as OpenAI/vLLM spell them);
        unset ones take the bundle's generation defaults, then the API's."""
        d = self.engine.generation_defaults
        top_k = get_int(body, "top_k", d.get("top_k", 0), lo=-1, hi=_INT32_MAX)
        # any signed 64-bit seed, as OpenAI and vLLM take; the generator reads its unsigned bit pattern,
        # so a negative seed is reproducible like any other
        seed = get_int(body, "seed", None, lo=-2**63, hi=2**63 - 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=get_number(body, "temperature", d.get("temperature", 1.0), lo=0.0, hi=temperature_max),
            top_p=get_number(body, "top_p", d.get("top_p", 1.0), lo=0.0, hi=1.0),
            top_k=max(top_k, 0),
            min_p=get_number(body, "min_p", d.get("min_p", 0.0), lo=0.0, hi=1.0),
            repetition_penalty=get_number(body, "repetition_penalty", d.get("repetition_penalty", 1.0), lo=0.01, hi=10.0),
            presence_penalty=get_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
            frequency_penalty=get_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
            seed=None if seed is None else seed % 2**64,
            stop=list(stop),
            stop_token_ids=get_token_ids(body, "stop_token_ids", self.engine.bundle.spec.vocab_size),   # vLLM's
            # vLLM's extension, which load generators send so every request runs to max_tokens
            ignore_eos=get_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            logit_bias=get_logit_bias(body, "logit_bias", self.engine.bundle.spec.vocab_size))

    @staticmethod
    def for_choice(params: SamplingParams, i: int) -> SamplingParams:
        """Choice i of n draws from seed + i, so a seeded request is reproducible and its choices differ."""
        if i == 0 or params.seed is None:
            return params
        return replace(params, seed=(params.seed + i) % 2**64)

    def tool_grammar(self, tools: list[Tool], field_name: str) -> Grammar:
        return self.grammars.lark(self.tool_format.grammar(tools), field_name)

    def check_tools(self, tools: list[Tool], where: list[str]) -> None:
        """A tool whose schema structured output cannot enforce is refused now, not when it is forced."""
        for tool, w in zip(tools, where):
            self.tool_grammar([tool], w)

    # --- running ---

    def start(self, request: Request, ids: list[int], params: SamplingParams, grammar: Grammar | None) -> Job:
        if self.closing:     # a request that came in between the signal and the listener's close
            raise _shutting_down(self.closing)
        constraint = self.grammars.constraint(grammar) if grammar else None
        job = self.queue.submit(ids, params, constraint, t_arrival=request.state.t0)
        self.live.add(job)
        return job

    def cancel(self, jobs: list[Job]) -> None:
        """Cancel jobs whose client has gone (a no-op for finished ones): frees their KV."""
        for j in jobs:
            self.live.discard(j)
            self.queue.cancel(j)

    def end_all(self, reason: str) -> None:
        """Server shutdown: every live job is cancelled (its KV freed) and its client told why, so a
        stream ends with the dialect's error event and a waiting request gets a 503, at once, rather
        than being cut off when the server's grace period runs out. Requests that arrive after this get
        the same 503 rather than starting a generation the shutdown would cut."""
        self.closing = reason
        for job in list(self.live):
            self.cancel([job])
            job.events.put_nowait(_shutting_down(reason))

    async def run_all(self, request: Request, jobs: list[Job]) -> list[list[TokenEvent]]:
        """Non-streaming: wait for every job, cancelling all of them if the client disconnects."""
        async def drain(job):
            return [ev async for ev in job.stream()]

        gathered = asyncio.ensure_future(asyncio.gather(*(drain(j) for j in jobs)))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
            if gathered.done():
                try:
                    return gathered.result()
                except APIError as e:           # a failed generation
                    raise _explained(jobs, e) from None
            raise APIError(499, "the client closed the connection")
        finally:
            watcher.cancel()
            gathered.cancel()
            self.cancel(jobs)

    async def merged(self, jobs: list[Job]) -> AsyncIterator[tuple[int, TokenEvent]]:
        """Streaming: (choice index, event) from all jobs as they come. Closing this (the client left)
        cancels every job, which frees their KV."""
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i, job):
            try:
                async for ev in job.stream():
                    await out.put((i, ev))
            except APIError as e:  # the job failed: hand the error to the consumer
                await out.put((i, _explained([job], e)))
            await out.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, j)) for i, j in enumerate(jobs)]
        try:
            left = len(jobs)
            while left:
                i, item = await out.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            self.cancel(jobs)


def _shutting_down(reason: str) -> APIError:
    return APIError(503, f"the server is shutting down: {reason}", code="server_shutdown")


def _explained(jobs: list[Job], error: APIError) -> APIError:
    """A generation that failed because its grammar did is the request's problem, not the server's: a
    400 naming the field the grammar came from, not the queue's generic 500."""
    for job in jobs:
        c = job.constraint
        if isinstance(c, GrammarConstraint) and c.failure is not None:
            return bad_request(c.field, f"the grammar failed during generation: {c.failure}")
    return error


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so receive() only reports that)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class Choice:
    """One generated answer as it accumulates: raw text, token ids, logprobs, and its reading as content
    and tool calls (through the tool-call parser when tools are in play)."""
    svc: Service
    tool_format: ToolFormat | None
    call_id_prefix: str = "call_"
    reasoning_start: bool | None = None   # Service.reasoning_start: None, no reasoning split; else starts inside
    raw: list[str] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    finish: str | None = None

    def __post_init__(self):
        self.parser = self.tool_format.parser() if self.tool_format else None
        self.splitter = None if self.reasoning_start is None else ThinkSplitter(self.reasoning_start)

    def add(self, ev: TokenEvent) -> list[Part | ReasoningPart]:
        """The parts this token adds to the answer: its reasoning (where split), then text and tool calls."""
        self.events.append(ev)
        self.raw.append(ev.text)
        if self.splitter:
            segments = self.splitter.feed(ev.text) + (self.splitter.finish() if ev.finish_reason else [])
        else:
            segments = [(False, ev.text)] if ev.text else []
        parts: list[Part | ReasoningPart] = []
        for is_reasoning, text in segments:
            if is_reasoning:
                self.reasoning.append(text)
                parts.append(ReasoningPart(text))
            else:
                parts += self.parser.feed(text) if self.parser else [TextPart(text)]
        if self.parser and ev.finish_reason:
            parts += self.parser.finish()
        for p in parts:
            if isinstance(p, TextPart):
                self.content.append(p.text)
            elif isinstance(p, CallStart):
                self.calls.append(ToolCall(p.name, "", new_id(self.call_id_prefix)))
            elif isinstance(p, CallArgs):
                self.calls[p.index].arguments += p.delta
        if ev.finish_reason:
            self.finish = ev.finish_reason
        return parts

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str | None:
        """The reasoning where this answer's was split out (possibly empty), else None."""
        return None if self.splitter is None else "".join(self.reasoning)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (the usage's cached_tokens)."""
        return self.events[0].cached_tokens if self.events else 0

    @property
    def n_tokens(self) -> int:
        return len(self.events)

    def finish_reason(self) -> str:
        """OpenAI's: stop | length | tool_calls."""
        return "tool_calls" if self.calls and self.finish == "stop" else (self.finish or "stop")

    def stop_sequence(self, stops: list[str]) -> str | None:
        """Which stop string ended the answer, if one did (the engine cuts the text before it)."""
        if self.finish != "stop" or not stops or not self.events:
            return None
        last = self.events[-1].token_id
        if last in self.svc.engine.tokenizer.eos_ids:
            return None
        full = self.svc.engine.tokenizer.decode([e.token_id for e in self.events])
        tail = full[len("".join(self.raw)):]
        hits = [(tail.find(s), s) for s in stops if s in tail]
        return min(hits)[1] if hits else None

    def token_text(self, token_id: int) -> str:
        return self.svc.engine.tokenizer.token_text(token_id)
