"""OpenAI's Chat Completions, Completions and Models endpoints (the Responses API is responses_api.py).

Field names, defaults and response shapes follow https://platform.openai.com/docs/api-reference; the
sampling extensions (top_k, min_p, repetition_penalty) are vLLM's. Streams are SSE `data:` lines,
one chunk per token as it is produced, ending with `data: [DONE]`.
"""
from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from imp_runtime.server.dialect import check_tool_set, event_stream, messages_of, run_to_end, sse, text_of
from imp_runtime.server.errors import APIError, bad_request, openai_error_body
from imp_runtime.server.fields import get_bool, get_int, get_list, get_obj, get_stop, get_str
from imp_runtime.server.reasoning import ReasoningPart
from imp_runtime.server.service import Choice, Service, new_id
from imp_runtime.server.structured import Grammar
from imp_runtime.server.tools import CallArgs, CallStart, Part, TextPart, Tool, ToolCall, check_tool

DONE = "data: [DONE]\n\n"
OPENAI_TEXT_PARTS = ("text", "input_text", "output_text")


def error_chunk(e: APIError) -> str:
    return sse(openai_error_body(e))


# ------------------------------------------------------------------ request pieces shared with responses_api


def content_text(v, where: str, allow_null: bool = False) -> str:
    return text_of(v, where, OPENAI_TEXT_PARTS, allow_null)


def parse_tools(svc: Service, body: dict, flat: bool = False) -> tuple[list[Tool], str, list[Tool]]:
    """tools and tool_choice -> (tools, mode none|auto|required, the tools a forced choice allows).
    Chat nests each tool under "function"; the Responses API (`flat`) does not."""
    tools, where = [], []
    for i, t in enumerate(get_list(body, "tools", [])):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}]", "expected a tool object")
        if t.get("type", "function") != "function":
            raise bad_request(f"tools[{i}].type", f"only function tools are supported, got {json.dumps(t.get('type'))}")
        fn, w = (t, f"tools[{i}]") if flat else (t.get("function"), f"tools[{i}].function")
        if not isinstance(fn, dict):
            raise bad_request(w, "expected a function object")
        tools.append(check_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), w))
        where.append(f"{w}.parameters")
    check_tool_set(svc, tools, where)
    choice = body.get("tool_choice")
    if choice is None:
        return tools, ("auto" if tools else "none"), []
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request("tool_choice", f"expected none, auto, required or a named tool, got {json.dumps(choice)}")
        if choice != "none" and not tools:
            raise bad_request("tool_choice", f"tool_choice {choice} needs tools")
        return tools, choice, (tools if choice == "required" else [])
    if not isinstance(choice, dict):
        raise bad_request("tool_choice", "expected a string or an object")
    fn = choice.get("function") if not flat else choice
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": ...}}'
                          if not flat else 'a named tool choice is {"type": "function", "name": ...}')
    forced = [t for t in tools if t.name == name]
    if not forced:
        raise bad_request("tool_choice", f"no tool named {json.dumps(name)} in tools")
    return tools, "required", forced


def format_grammar(svc: Service, fmt, where: str, flat: bool = False) -> Grammar | None:
    """response_format (chat) / text.format (responses, `flat`) -> an llguidance grammar or None.
    Beyond OpenAI's types, {"type": "regex", "regex": ...} constrains to a regular expression."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(where, "expected an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return svc.grammars.json_schema({"type": "object"}, where)
    if kind == "json_schema":
        js = fmt if flat else get_obj(fmt, "json_schema", required=True, label=f"{where}.json_schema")
        schema_where = f"{where}.schema" if flat else f"{where}.json_schema.schema"
        schema = js.get("schema")
        if schema is None:
            raise bad_request(schema_where, "this field is required")
        return svc.grammars.json_schema(schema, schema_where)
    if kind == "regex":
        return svc.grammars.regex(fmt.get("regex", fmt.get("pattern")), f"{where}.regex")
    raise bad_request(f"{where}.type", f"expected text, json_object, json_schema or regex, got {json.dumps(kind)}")


def continue_final(body: dict) -> bool:
    """vLLM's `continue_final_message` (the answer continues the final assistant message) and `add_generation_prompt`
    (a new assistant turn; the default), which exclude each other."""
    cont = get_bool(body, "continue_final_message", False)
    if get_bool(body, "add_generation_prompt", not cont) == cont:
        raise bad_request("continue_final_message", "continue the final message or open a new assistant turn "
                                                    "(add_generation_prompt), one of the two")
    return cont


def parse_chat_messages(body: dict) -> list[dict]:
    out = []
    for w, m, role in messages_of(body, ("system", "developer", "user", "assistant", "tool")):
        role = "system" if role == "developer" else role
        msg = {"role": role}
        if role == "assistant":
            calls = []
            for j, c in enumerate(get_list(m, "tool_calls", [], label=f"{w}.tool_calls")):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{w}.tool_calls[{j}].function", "expected {name, arguments}")
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    raise bad_request(f"{w}.tool_calls[{j}].function.arguments", "expected a JSON string")
                calls.append(ToolCall(fn["name"], args, str(c.get("id", ""))))
            msg["tool_calls"] = calls
            msg["content"] = content_text(m.get("content"), f"{w}.content", allow_null=bool(calls))
        else:
            msg["content"] = content_text(m.get("content"), f"{w}.content")
        if role == "tool":
            msg["tool_call_id"] = get_str(m, "tool_call_id", "", label=f"{w}.tool_call_id")
        out.append(msg)
    return out


def usage(n_prompt: int, choices: list[Choice]) -> dict:
    done = sum(c.n_tokens for c in choices)
    return {"prompt_tokens": n_prompt, "completion_tokens": done, "total_tokens": n_prompt + done,
            "prompt_tokens_details": {"cached_tokens": max((c.cached_tokens for c in choices), default=0)}}


def chunker(rid: str, kind: str, created: int, model: str, include_usage: bool):
    """The SSE chunk of one choice's delta (or, with `usage`, the closing usage chunk) for chat
    (`chat.completion.chunk`) and completions (`text_completion`) streams."""
    def chunk(choice: dict | None, usage: dict | None = None) -> str:
        d = {"id": rid, "object": kind, "created": created, "model": model, "system_fingerprint": None,
             "choices": [choice] if choice is not None else []}
        if include_usage:
            d["usage"] = usage
        return sse(d)
    return chunk


class TextChunks:
    """`chunk(make_choice(i, text))` for the chunk a stream sends most, a choice's plain text delta, from a
    template rendered once per choice: only the text is JSON-encoded per token (json.dumps of the whole
    chunk was a sixth of the event loop's time per token at 64 streams). Same bytes as the chunk."""
    SLOT = "\u2063imp-text-slot\u2063"       # a string json.dumps(ensure_ascii=False) writes as it is

    def __init__(self, chunk, make_choice):
        self.chunk, self.make_choice, self.parts = chunk, make_choice, {}

    def __call__(self, i: int, text: str) -> str:
        parts = self.parts.get(i)
        if parts is None:
            rendered = self.chunk(self.make_choice(i, self.SLOT))
            parts = self.parts[i] = tuple(rendered.split(json.dumps(self.SLOT, ensure_ascii=False)))
            assert len(parts) == 2, "the chunk template holds the text once"
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]


def stream_usage_flag(body: dict, stream: bool) -> bool:
    opts = get_obj(body, "stream_options", None)
    if opts is not None and not stream:
        raise bad_request("stream_options", "only allowed when stream is true")
    return get_bool(opts or {}, "include_usage", False, label="stream_options.include_usage")


# ------------------------------------------------------------------ /v1/chat/completions


def _lp_entry(choice: Choice, ev) -> dict:
    def one(tid, lp):
        t = choice.token_text(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}
    return {**one(ev.token_id, ev.logprob), "top_logprobs": [one(t, lp) for t, lp in ev.top_logprobs]}


def _chat_deltas(parts: list[Part], choice: Choice) -> list[dict]:
    deltas = []
    for p in parts:
        if isinstance(p, TextPart):
            deltas.append({"content": p.text})
        elif isinstance(p, ReasoningPart):           # vLLM's reasoning parsers' and DeepSeek's field
            deltas.append({"reasoning_content": p.text})
        elif isinstance(p, CallStart):
            c = choice.calls[p.index]
            deltas.append({"tool_calls": [{"index": p.index, "id": c.id, "type": "function",
                                           "function": {"name": c.name, "arguments": ""}}]})
        elif isinstance(p, CallArgs):
            deltas.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.delta}}]})
    return deltas


async def chat_completions(svc: Service, request: Request, body: dict):
    model = svc.check_model(body)
    messages = parse_chat_messages(body)
    tools, mode, forced = parse_tools(svc, body)
    n = get_int(body, "n", 1, lo=1, hi=svc.limits.max_n)
    stream = get_bool(body, "stream")
    include_usage = stream_usage_flag(body, stream)
    want_lp = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, lo=0, hi=20)
    if top and not want_lp:
        raise bad_request("top_logprobs", "needs logprobs: true")
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_int(body, max_field, None, lo=1)
    grammar = (svc.tool_grammar(forced, "tool_choice") if forced
               else format_grammar(svc, body.get("response_format"), "response_format"))
    active_tools = tools if mode != "none" else []
    ids = svc.encode_chat(messages, active_tools, body=body, continue_final=continue_final(body))
    budget = svc.budget(len(ids), max_tokens, "messages", max_field)
    params = svc.sampling(body, budget, stop=get_stop(body, "stop"), logprobs=top if want_lp else None)
    jobs = [svc.start(request, ids, svc.for_choice(params, i), grammar) for i in range(n)]
    start = svc.reasoning_start(ids, grammar)
    choices = [Choice(svc, svc.tool_format if active_tools else None, reasoning_start=start) for _ in range(n)]
    rid, created = new_id("chatcmpl-"), int(time.time())

    if not stream:
        await run_to_end(svc, request, jobs, choices)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": i, "message": _message(c), "finish_reason": c.finish_reason(),
                         "logprobs": {"content": [_lp_entry(c, ev) for ev in c.events]} if want_lp else None}
                        for i, c in enumerate(choices)],
            "usage": usage(len(ids), choices)})

    stream_chunk = chunker(rid, "chat.completion.chunk", created, model, include_usage)

    def chunk(i, delta, finish=None, logprobs=None):
        return stream_chunk({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
    content_chunk = TextChunks(stream_chunk, lambda i, text: {"index": i, "delta": {"content": text}, "logprobs": None,
                                                               "finish_reason": None})

    async def body_iter():
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, ev in svc.merged(jobs):
            c = choices[i]
            deltas = _chat_deltas(c.add(ev), c)
            lp = {"content": [_lp_entry(c, ev)]} if want_lp else None
            if lp and not deltas:
                deltas = [{"content": ""}]
            for k, delta in enumerate(deltas):
                if lp is None and len(delta) == 1 and "content" in delta:
                    yield content_chunk(i, delta["content"])
                else:
                    yield chunk(i, delta, logprobs=lp if k == 0 else None)
            if ev.finish_reason:
                yield chunk(i, {}, finish=c.finish_reason())
        if include_usage:
            yield stream_chunk(None, usage(len(ids), choices))

    return event_stream(svc, jobs, body_iter(), error_chunk, DONE)


def _message(c: Choice) -> dict:
    msg = {"role": "assistant", "content": c.text if (c.text or not c.calls) else None, "refusal": None}
    if c.reasoning_text is not None:
        msg["reasoning_content"] = c.reasoning_text or None
    if c.calls:
        msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                             for t in c.calls]
    return msg


# ------------------------------------------------------------------ /v1/completions


def _prompts(svc: Service, body: dict) -> list[tuple[str | None, list[int]]]:
    """Each prompt's (text, ids); the text of a prompt given as ids is None (decoded only for echo: decoding a
    2,000-id prompt took a quarter of a warm prefix-cache request's time to first token)."""
    p = body.get("prompt")
    if p is None:
        raise bad_request("prompt", "this field is required")
    if isinstance(p, str):
        p = [p]
    if not isinstance(p, list) or not p:
        raise bad_request("prompt", "expected a string, an array of strings, or an array of token ids")
    if all(isinstance(x, str) for x in p):
        return [(x, svc.encode_text(x)) for x in p]
    if all(type(x) is int for x in p):              # (type, not isinstance: a bool is not a token id)
        p = [p]
    vocab = svc.engine.bundle.spec.vocab_size
    out = []
    for i, ids in enumerate(p):
        if not isinstance(ids, list) or not all(type(x) is int for x in ids):
            raise bad_request(f"prompt[{i}]", "expected a string or an array of token ids")
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise bad_request(f"prompt[{i}]", f"token ids must be in [0, {vocab})")
        out.append((None, ids))
    return out


async def completions(svc: Service, request: Request, body: dict):
    model = svc.check_model(body)
    prompts = _prompts(svc, body)
    n = get_int(body, "n", 1, lo=1, hi=svc.limits.max_n)
    if len(prompts) * n > svc.limits.max_n:
        raise bad_request("n", f"{len(prompts)} prompts x n={n} exceed {svc.limits.max_n} completions per request")
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise bad_request("best_of", "best_of other than n is not supported")
    if get_str(body, "suffix"):
        raise bad_request("suffix", "suffix (fill-in-the-middle) is not supported")
    stream = get_bool(body, "stream")
    include_usage = stream_usage_flag(body, stream)
    echo = get_bool(body, "echo")
    lp_n = get_int(body, "logprobs", None, lo=0, hi=20)
    if echo and lp_n is not None:
        raise bad_request("logprobs", "logprobs of an echoed prompt are not supported")
    max_tokens = get_int(body, "max_tokens", 16, lo=1)
    grammar = format_grammar(svc, body.get("response_format"), "response_format")
    stop = get_stop(body, "stop")
    # every prompt is checked before any generation starts, so a bad one wastes no work
    plans = [(ids, svc.sampling(body, svc.budget(len(ids), max_tokens, f"prompt[{pi}]" if len(prompts) > 1
                                                 else "prompt", "max_tokens"), stop=stop, logprobs=lp_n))
             for pi, (_, ids) in enumerate(prompts)]
    jobs, choices, index = [], [], []
    for pi, (ids, params) in enumerate(plans):
        for j in range(n):
            jobs.append(svc.start(request, ids, svc.for_choice(params, j), grammar))
            choices.append(Choice(svc, None))
            index.append(pi)
    n_prompt = sum(len(prompts[i][1]) for i in sorted(set(index)))
    if echo:        # prompts given as ids: their text now
        prompts = [(text if text is not None else svc.engine.tokenizer.decode(ids, skip_special_tokens=False), ids)
                   for text, ids in prompts]
    rid, created = new_id("cmpl-"), int(time.time())

    def logprobs(c: Choice, events, offset: int):
        if lp_n is None:
            return None
        tokens, offsets = [], []
        for ev in events:
            tokens.append(c.token_text(ev.token_id))
            offsets.append(offset)
            offset += len(ev.text)
        return {"tokens": tokens, "token_logprobs": [ev.logprob for ev in events],
                "top_logprobs": [{c.token_text(t): lp for t, lp in ev.top_logprobs} for ev in events],
                "text_offset": offsets}

    if not stream:
        await run_to_end(svc, request, jobs, choices)
        out = []
        for i, c in enumerate(choices):
            head = prompts[index[i]][0] if echo else ""
            out.append({"index": i, "text": head + c.text, "logprobs": logprobs(c, c.events, len(head)),
                        "finish_reason": c.finish_reason()})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "system_fingerprint": None, "choices": out, "usage": usage(n_prompt, choices)})

    stream_chunk = chunker(rid, "text_completion", created, model, include_usage)

    def chunk(i, text, finish=None, lp=None):
        return stream_chunk({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
    text_chunk = TextChunks(stream_chunk, lambda i, text: {"index": i, "text": text, "logprobs": None,
                                                           "finish_reason": None})

    async def body_iter():
        offsets = [len(prompts[index[i]][0]) if echo else 0 for i in range(len(choices))]
        if echo:
            for i in range(len(choices)):
                yield chunk(i, prompts[index[i]][0])
        async for i, ev in svc.merged(jobs):
            c = choices[i]
            c.add(ev)
            lp = logprobs(c, [ev], offsets[i])
            offsets[i] += len(ev.text)
            if lp is None and not ev.finish_reason:
                if ev.text:
                    yield text_chunk(i, ev.text)
            elif ev.text or lp or ev.finish_reason:
                yield chunk(i, ev.text, c.finish_reason() if ev.finish_reason else None, lp)
        if include_usage:
            yield stream_chunk(None, usage(n_prompt, choices))

    return event_stream(svc, jobs, body_iter(), error_chunk, DONE)


# ------------------------------------------------------------------ /v1/models


def model_card(svc: Service, name: str) -> dict:
    return {"id": name, "object": "model", "created": svc.created, "owned_by": "imp",
            "max_model_len": svc.engine.max_context}


async def list_models(svc: Service, request: Request):
    return JSONResponse({"object": "list", "data": [model_card(svc, n) for n in svc.served.names]})


async def get_model(svc: Service, request: Request):
    name = request.path_params["model"]
    if not svc.serves(name):
        raise svc.unknown_model(name)
    return JSONResponse(model_card(svc, name))
