"""OpenAI's Responses API (POST /v1/responses): input items in, output items out, and the typed event
stream (response.created ... response.output_text.delta ... response.completed). Stateless: responses
are not stored, so previous_response_id is refused."""
from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from imp_runtime.server.dialect import block_events, event_stream, named_sse, nonempty_list, run_to_end
from imp_runtime.server.errors import APIError, bad_request, openai_error_body
from imp_runtime.server.fields import get_bool, get_int, get_obj, get_str
from imp_runtime.server.openai_api import content_text, format_grammar, parse_tools
from imp_runtime.server.service import Choice, Service, new_id
from imp_runtime.server.tools import CallArgs, CallStart, Part, TextPart, ToolCall


def parse_input(body: dict) -> list[dict]:
    msgs: list[dict] = []
    instructions = get_str(body, "instructions")
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        if not inp:
            raise bad_request("input", "the input is empty")
        return msgs + [{"role": "user", "content": inp}]
    for i, it in enumerate(nonempty_list(body, "input", "input item")):
        w = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(w, "expected an input item object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{w}.role", f"expected user, assistant, system or developer, got {json.dumps(role)}")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": content_text(it.get("content"), f"{w}.content")})
        elif kind == "function_call":
            call = ToolCall(get_str(it, "name", required=True, label=f"{w}.name"),
                            get_str(it, "arguments", "{}", label=f"{w}.arguments"),
                            get_str(it, "call_id", "", label=f"{w}.call_id"))
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "content": out if isinstance(out, str) else json.dumps(out),
                         "tool_call_id": get_str(it, "call_id", "", label=f"{w}.call_id")})
        else:
            raise bad_request(f"{w}.type", f"input items of type {json.dumps(kind)} are not supported")
    return msgs


class OutputItems:
    """Builds output items from a Choice's parts, and the stream events that announce them. A text part
    after a call (or a call after text) closes the open item and opens the next one."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.events: list[tuple[str, dict]] = []
        self.call_items: dict[int, dict] = {}

    def _close(self):
        it = self.open
        if it is None:
            return
        i = self.items.index(it)
        if it["type"] == "message":
            part = it["content"][0]
            self.events += [("response.output_text.done", {"item_id": it["id"], "output_index": i, "content_index": 0,
                                                           "text": part["text"], "logprobs": []}),
                            ("response.content_part.done", {"item_id": it["id"], "output_index": i,
                                                            "content_index": 0, "part": dict(part)})]
        else:
            self.events.append(("response.function_call_arguments.done",
                                {"item_id": it["id"], "output_index": i, "name": it["name"],
                                 "arguments": it["arguments"]}))
        it["status"] = "completed"
        self.events.append(("response.output_item.done", {"output_index": i, "item": _copy(it)}))
        self.open = None

    def add(self, parts: list[Part], choice: Choice) -> None:
        for p in parts:
            if isinstance(p, TextPart):
                if self.open is None or self.open["type"] != "message":
                    self._close()
                    self.open = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                                 "role": "assistant", "content": []}
                    self.items.append(self.open)
                    i = len(self.items) - 1
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    self.events += [("response.output_item.added", {"output_index": i, "item": _copy(self.open)}),
                                    ("response.content_part.added", {"item_id": self.open["id"], "output_index": i,
                                                                     "content_index": 0, "part": dict(part)})]
                    self.open["content"].append(part)
                self.open["content"][0]["text"] += p.text
                self.events.append(("response.output_text.delta",
                                    {"item_id": self.open["id"], "output_index": len(self.items) - 1,
                                     "content_index": 0, "delta": p.text, "logprobs": []}))
            elif isinstance(p, CallStart):
                self._close()
                c = choice.calls[p.index]
                self.open = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                             "call_id": c.id, "name": c.name, "arguments": ""}
                self.items.append(self.open)
                self.call_items[p.index] = self.open
                self.events.append(("response.output_item.added",
                                    {"output_index": len(self.items) - 1, "item": _copy(self.open)}))
            elif isinstance(p, CallArgs):
                it = self.call_items[p.index]
                it["arguments"] += p.delta
                self.events.append(("response.function_call_arguments.delta",
                                    {"item_id": it["id"], "output_index": self.items.index(it), "delta": p.delta}))

    def finish(self) -> None:
        self._close()

    def take_events(self) -> list[tuple[str, dict]]:
        ev, self.events = self.events, []
        return ev


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


async def responses(svc: Service, request: Request, body: dict):
    model = svc.check_model(body)
    if body.get("previous_response_id") is not None:
        raise bad_request("previous_response_id", "this server does not store responses; send the whole "
                                                  "conversation in input")
    messages = parse_input(body)
    tools, mode, forced = parse_tools(svc, body, flat=True)
    stream = get_bool(body, "stream")
    max_tokens = get_int(body, "max_output_tokens", None, lo=1)
    text_opts = get_obj(body, "text", {})
    fmt = get_obj(text_opts, "format", None, label="text.format")
    grammar = svc.tool_grammar(forced, "tool_choice") if forced else format_grammar(svc, fmt, "text.format", flat=True)
    active_tools = tools if mode != "none" else []
    ids = svc.encode_chat(messages, active_tools, "input")
    budget = svc.budget(len(ids), max_tokens, "input", "max_output_tokens")
    params = svc.sampling(body, budget)
    job = svc.start(request, ids, params, grammar)
    choice = Choice(svc, svc.tool_format if active_tools else None, reasoning_start=svc.reasoning_start(ids, grammar))
    rid, created = new_id("resp_"), int(time.time())

    def response(status: str, items: list[dict]) -> dict:
        done = status != "in_progress"
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.get("instructions"), "max_output_tokens": max_tokens, "model": model,
                "output": items, "parallel_tool_calls": True, "previous_response_id": None, "store": False,
                "temperature": params.temperature, "top_p": params.top_p,
                "text": {"format": fmt or {"type": "text"}}, "tool_choice": body.get("tool_choice", mode),
                "tools": body.get("tools", []), "truncation": "disabled", "metadata": body.get("metadata") or {},
                "usage": {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": choice.cached_tokens},
                          "output_tokens": choice.n_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": len(ids) + choice.n_tokens} if done else None}

    def final_status() -> str:
        return "incomplete" if choice.finish == "length" else "completed"

    builder = OutputItems()
    if not stream:
        await run_to_end(svc, request, [job], [choice], builder)
        builder.finish()
        return JSONResponse(response(final_status(), builder.items))

    seq = 0

    def event(kind: str, data: dict) -> str:
        nonlocal seq
        seq += 1
        return named_sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

    def error_event(e: APIError) -> str:
        err = openai_error_body(e)["error"]
        return event("error", {"code": err["code"], "message": err["message"], "param": err["param"]})

    async def body_iter():
        yield event("response.created", {"response": response("in_progress", [])})
        yield event("response.in_progress", {"response": response("in_progress", [])})
        async for kind, data in block_events(svc, job, choice, builder):
            yield event(kind, data)
        status = final_status()
        yield event(f"response.{status}", {"response": response(status, builder.items)})
    return event_stream(svc, [job], body_iter(), error_event)
