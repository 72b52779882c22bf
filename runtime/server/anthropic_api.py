"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Shapes follow https://docs.anthropic.com/en/api/messages and its streaming page: message_start,
content_block_start, ping, content_block_delta (text_delta / input_json_delta), content_block_stop,
message_delta (stop_reason, usage), message_stop; errors as {"type": "error", "error": {...}}.
Structured output: `output_config: {"format": {"type": "json_schema", "schema": ...}}`.
"""
from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse

from imp_runtime.server.dialect import (block_events, check_tool_set, event_stream, messages_of, named_sse,
                                         run_to_end, text_of)
from imp_runtime.server.errors import anthropic_error_body, bad_request
from imp_runtime.server.fields import get_bool, get_int, get_list, get_obj, get_stop
from imp_runtime.server.reasoning import ReasoningPart
from imp_runtime.server.service import Choice, Service, new_id
from imp_runtime.server.structured import Grammar
from imp_runtime.server.tools import CallArgs, CallStart, Part, TextPart, Tool, ToolCall, check_tool


def anthropic_usage(n_prompt: int, choice) -> dict:
    """Anthropic counts prompt tokens read from the prefix cache apart from the rest (input_tokens +
    cache_read_input_tokens = the prompt)."""
    cached = choice.cached_tokens
    return {"input_tokens": n_prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": choice.n_tokens}


def parse_messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for w, m, role in messages_of(body, ("user", "assistant")):
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{w}.content", "expected a string or an array of content blocks")
        texts, calls = [], []
        for j, b in enumerate(content):
            bw = f"{w}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(bw, "a tool_use block needs a name and an input object")
                calls.append(ToolCall(b["name"], json.dumps(b.get("input", {}), ensure_ascii=False), str(b.get("id", ""))))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                pass        # an earlier turn's reasoning, sent back as Anthropic's clients do: not part of the prompt
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                out.append({"role": "tool", "content": text_of(result, f"{bw}.content"),
                            "tool_call_id": str(b.get("tool_use_id", ""))})
            else:
                raise bad_request(f"{bw}.type", f"content blocks of type {json.dumps(kind)} are not supported "
                                                f"in a {role} message")
        if texts or calls:
            msg = {"role": role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def parse_tools(svc: Service, body: dict) -> tuple[list[Tool], str, list[Tool]]:
    tools, where = [], []
    for i, t in enumerate(get_list(body, "tools", [])):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(w, "expected a tool object")
        if t.get("type", "custom") != "custom":
            raise bad_request(f"{w}.type", f"only custom (client) tools are supported, got {json.dumps(t.get('type'))}")
        if t.get("input_schema") is None:
            raise bad_request(f"{w}.input_schema", "this field is required")
        tools.append(check_tool(t.get("name"), t.get("description"), t.get("input_schema"), w))
        where.append(f"{w}.input_schema")
    check_tool_set(svc, tools, where)
    choice = get_obj(body, "tool_choice", None)
    if choice is None:
        return tools, ("auto" if tools else "none"), []
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type", f"expected auto, any, tool or none, got {json.dumps(kind)}")
    if kind in ("any", "tool") and not tools:
        raise bad_request("tool_choice", f"tool_choice {kind} needs tools")
    if kind == "tool":
        forced = [t for t in tools if t.name == choice.get("name")]
        if not forced:
            raise bad_request("tool_choice.name", f"no tool named {json.dumps(choice.get('name'))} in tools")
        return tools, "required", forced
    return tools, {"any": "required"}.get(kind, kind), (tools if kind == "any" else [])


def _prompt(svc: Service, body: dict):
    messages = parse_messages(body)
    tools, mode, forced = parse_tools(svc, body)
    active = tools if mode != "none" else []
    # a final assistant message is a prefill: the answer continues it (and holds only what follows it)
    prefill = (bool(messages) and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
               and bool(messages[-1]["content"]))
    if prefill and messages[-1]["content"] != messages[-1]["content"].rstrip():
        raise bad_request(f"messages[{len(body['messages']) - 1}].content",
                          "a final assistant message cannot end in whitespace")
    return svc.encode_chat(messages, active, continue_final=prefill), active, forced


async def count_tokens(svc: Service, request: Request, body: dict):
    svc.check_model(body)
    ids, _, _ = _prompt(svc, body)
    return JSONResponse({"input_tokens": len(ids)})


class Blocks:
    """Content blocks from a Choice's parts, and the stream events that build them."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking            # the request enabled thinking: reasoning as thinking blocks, else dropped
        self.blocks: list[dict] = []
        self.open: dict | None = None
        self.events: list[tuple[str, dict]] = []
        self.by_call: dict[int, dict] = {}
        self.partial: dict[int, str] = {}

    def _start(self, block: dict) -> None:
        self._stop()
        self.blocks.append(block)
        self.open = block
        shown = (dict(block, input={}) if block["type"] == "tool_use" else dict(block, thinking="")
                 if block["type"] == "thinking" else dict(block, text=""))
        self.events.append(("content_block_start", {"index": len(self.blocks) - 1, "content_block": shown}))
        if len(self.blocks) == 1:
            self.events.append(("ping", {}))

    def _stop(self) -> None:
        if self.open is not None:
            i = self.blocks.index(self.open)
            if self.open["type"] == "thinking":     # Anthropic's stream signs a thinking block before it stops
                self.events.append(("content_block_delta", {"index": i, "delta": {
                    "type": "signature_delta", "signature": self.open["signature"]}}))
            self.events.append(("content_block_stop", {"index": i}))
            self.open = None

    def add(self, parts: list[Part], choice: Choice) -> None:
        for p in parts:
            if isinstance(p, ReasoningPart):
                if not self.thinking:
                    continue
                if self.open is None or self.open["type"] != "thinking":
                    self._start({"type": "thinking", "thinking": "", "signature": ""})   # (no signature: not Claude)
                self.open["thinking"] += p.text
                self.events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                            "delta": {"type": "thinking_delta", "thinking": p.text}}))
            elif isinstance(p, TextPart):
                if self.open is None or self.open["type"] != "text":
                    self._start({"type": "text", "text": ""})
                self.open["text"] += p.text
                self.events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                            "delta": {"type": "text_delta", "text": p.text}}))
            elif isinstance(p, CallStart):
                c = choice.calls[p.index]
                self._start({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                self.by_call[p.index] = self.open
                self.partial[p.index] = ""
            elif isinstance(p, CallArgs):
                self.partial[p.index] += p.delta
                self.events.append(("content_block_delta", {"index": self.blocks.index(self.by_call[p.index]),
                                                            "delta": {"type": "input_json_delta",
                                                                      "partial_json": p.delta}}))

    def finish(self) -> None:
        if not any(b["type"] != "thinking" for b in self.blocks):   # an empty answer is still one (empty) text block
            self._start({"type": "text", "text": ""})
        self._stop()
        for i, block in self.by_call.items():
            try:
                args = json.loads(self.partial[i] or "{}")
            except ValueError:              # cut short by max_tokens: what parsed is all there is
                args = {}
            block["input"] = args if isinstance(args, dict) else {"value": args}

    def take_events(self) -> list[tuple[str, dict]]:
        ev, self.events = self.events, []
        return ev


def _thinking(body: dict) -> bool:
    """Whether the request enabled extended thinking (`thinking: {"type": "enabled", "budget_tokens": N}`): then a
    thinking model's reasoning comes back as thinking blocks (the budget is not enforced: max_tokens bounds both)."""
    t = get_obj(body, "thinking", None)
    if t is None:
        return False
    kind = t.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("thinking.type", f"expected enabled, disabled or adaptive, got {json.dumps(kind)}")
    return kind != "disabled"


def _format_grammar(svc: Service, body: dict) -> Grammar | None:
    """Structured output: `output_config.format` (current API) or `output_format` (the beta's spelling)."""
    where = "output_format"
    fmt = get_obj(body, "output_format", None)
    if fmt is None:
        where = "output_config.format"
        fmt = get_obj(get_obj(body, "output_config", {}), "format", None, label=where)
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise bad_request(f"{where}.type", f"expected json_schema, got {json.dumps(fmt.get('type'))}")
    return svc.grammars.json_schema(fmt.get("schema"), f"{where}.schema")


async def messages(svc: Service, request: Request, body: dict):
    model = svc.check_model(body)
    ids, tools, forced = _prompt(svc, body)
    max_tokens = get_int(body, "max_tokens", None, lo=1, required=True)
    stream = get_bool(body, "stream")
    meta = get_obj(body, "metadata", None)
    if meta is not None and meta.get("user_id") is not None and not isinstance(meta["user_id"], str):
        raise bad_request("metadata.user_id", "expected a string")
    stops = get_stop(body, "stop_sequences", most=64, allow_string=False)
    grammar = None
    if forced:
        grammar = svc.tool_grammar(forced, "tool_choice")
    else:
        grammar = _format_grammar(svc, body)
    budget = svc.budget(len(ids), max_tokens, "messages", "max_tokens")
    params = svc.sampling(body, budget, temperature_max=1.0, stop=stops)
    job = svc.start(request, ids, params, grammar)
    choice = Choice(svc, svc.tool_format if tools else None, call_id_prefix="toolu_",
                    reasoning_start=svc.reasoning_start(ids, grammar))
    mid = new_id("msg_")

    def stop_info() -> tuple[str, str | None]:
        if choice.finish == "length":
            return "max_tokens", None
        if choice.calls:
            return "tool_use", None
        seq = choice.stop_sequence(stops)
        return ("stop_sequence", seq) if seq else ("end_turn", None)

    blocks = Blocks(thinking=_thinking(body))
    if not stream:
        await run_to_end(svc, request, [job], [choice], blocks)
        blocks.finish()
        reason, seq = stop_info()
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model,
                             "content": blocks.blocks, "stop_reason": reason, "stop_sequence": seq,
                             "usage": anthropic_usage(len(ids), choice)})

    def event(kind: str, data: dict) -> str:
        return named_sse(kind, {"type": kind, **data})

    async def body_iter():
        yield event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
        async for kind, data in block_events(svc, job, choice, blocks):
            yield event(kind, data)
        reason, seq = stop_info()
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                      "usage": anthropic_usage(len(ids), choice)})
        yield event("message_stop", {})
    return event_stream(svc, [job], body_iter(), lambda e: named_sse("error", anthropic_error_body(e)))
