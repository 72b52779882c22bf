"""Tool calls in the model's own format: prompting, parsing (streamed), and forcing.

Three formats, chosen from the chat template's source:
- `hermes` (Qwen, Hermes): the template renders `tools` itself; the model writes
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.
- `llama3`: the template renders `tools` itself; the model writes `{"name": ..., "parameters": {...}}`
  as its whole answer (after `<|python_tag|>`, a special token the detokenizer drops).
- `json_list` (SmolLM2's own form, and the fallback for any template that knows nothing of tools):
  we add SmolLM2's function-calling system prompt; the model writes
  `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`.

Calls are parsed incrementally so both dialects can stream them: a call starts once its name is known
and its arguments stream verbatim as the model writes them (so the streamed arguments equal the
non-streamed ones). A forced tool choice becomes an llguidance grammar of this same format.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from imp_runtime.server.errors import bad_request

_NAME_OK = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CALL_HEAD = re.compile(r'\A\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')

SMOLLM2_TOOL_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, answer the question directly without a tool call.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, the output MUST strictly adhere to the following format, and NO other text MUST be "
    "included. Please make sure the parameter type is correct.\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>")


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ToolCall:
    name: str
    arguments: str          # JSON text, verbatim from the model
    id: str = ""


# ------------------------------------------------------------------ what a streamed answer is made of


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int              # the call's number within the answer
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    delta: str              # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int


Part = TextPart | CallStart | CallArgs | CallEnd


# ------------------------------------------------------------------ tool definitions


def check_tool(name, description, parameters, where: str) -> Tool:
    if not isinstance(name, str) or not _NAME_OK.match(name):
        raise bad_request(f"{where}.name", f"a tool name must match [A-Za-z0-9_.-]{{1,64}}, got {json.dumps(name)}")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description", "expected a string")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters", "expected a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise bad_request(f"{where}.parameters", f"a tool's parameters must be of type object, "
                          f"got {json.dumps(parameters.get('type'))}")
    return Tool(name, description or "", parameters)


def tool_schema(tool: Tool, args_key: str = "arguments") -> dict:
    """The JSON schema of one call of `tool`: the name first, so a streamed call names itself early.
    Arguments not declared are refused unless the schema says otherwise (as OpenAI's strict mode does):
    left open, a small model fills a forced call with invented keys until max_tokens runs out."""
    params = tool.parameters
    if "properties" in params and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


# ------------------------------------------------------------------ formats


class ToolFormat:
    name = ""
    start = ""               # marker opening a block of calls ("" where the answer itself is the call)
    end = ""
    args_key = "arguments"
    native = True            # the template renders `tools` itself

    def prepare(self, messages: list[dict], tools: list[Tool]) -> tuple[list[dict], list[dict] | None]:
        """Internal messages -> the template's messages, and the `tools` argument for the template."""
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                out.append({"role": "assistant", "content": m.get("content") or "",
                            "tool_calls": [{"type": "function", "id": c.id,
                                            "function": {"name": c.name, "arguments": _as_object(c.arguments)}}
                                           for c in m["tool_calls"]]})
            elif m["role"] == "tool":
                out.append({"role": "tool", "content": m["content"], "tool_call_id": m.get("tool_call_id"),
                            "name": m.get("name")})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        spec = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in tools]
        return out, (spec or None)

    def grammar(self, tools: list[Tool]) -> str:
        """A lark grammar (llguidance) for exactly one call of one of `tools`."""
        schema = {"anyOf": [tool_schema(t, self.args_key) for t in tools]} if len(tools) > 1 \
            else tool_schema(tools[0], self.args_key)
        schema["x-guidance"] = JSON_STYLE
        return f"start: {json.dumps(self.start)} call {json.dumps(self.end)}\ncall: %json {json.dumps(schema)}" \
            if self.start else f"start: call\ncall: %json {json.dumps(schema)}"

    def parser(self) -> "ToolCallParser":
        return ToolCallParser(self)


class HermesFormat(ToolFormat):
    name, start, end = "hermes", "<tool_call>\n", "\n</tool_call>"
    marker = "<tool_call>"


class Llama3Format(ToolFormat):
    name, start, end, args_key = "llama3", "", "", "parameters"
    marker = ""


class JsonListFormat(ToolFormat):
    name, start, end, native = "json_list", "<tool_call>[", "]</tool_call>", False
    marker = "<tool_call>"

    def prepare(self, messages, tools):
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments or "{}"}}}'
                                  for c in m["tool_calls"])
                out.append({"role": "assistant", "content": (m.get("content") or "") + f"<tool_call>[{calls}]</tool_call>"})
            elif m["role"] == "tool":       # any template can render a user turn; not every one a tool turn
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if tools:
            listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                                  for t in tools], ensure_ascii=False)
            prompt = SMOLLM2_TOOL_PROMPT.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, None


# The JSON style forced output takes: what json.dumps writes, which is also what models were trained on;
# no free whitespace, so a small model cannot wander into endless newlines.
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def detect_format(template_source: str) -> ToolFormat:
    if "<tool_call>" in template_source and "tools" in template_source:
        return HermesFormat()
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return Llama3Format()
    return JsonListFormat()


def _as_object(arguments: str):
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


# ------------------------------------------------------------------ parsing


@dataclass
class _Call:
    name: str
    args_sent: int = 0          # chars of the arguments text already emitted
    done: bool = False


@dataclass
class ToolCallParser:
    """Feed text deltas; get Parts (text, and each call's start, argument pieces and end). Text that
    might be the start of a tool-call block is held back until it is decided."""
    fmt: ToolFormat
    buf: str = ""               # text mode: undecided text; call mode: the block's body so far
    in_call: bool = False
    decided: bool = False       # llama3: whether the answer is a call was decided at its first character
    calls: list[_Call] = field(default_factory=list)
    block_calls: int = 0        # calls already found in earlier blocks
    trailing_ws: str = ""       # whitespace after a call block, emitted only if more text follows

    def feed(self, delta: str) -> list[Part]:
        self.buf += delta
        out: list[Part] = []
        while True:
            if not self.in_call:
                if not self._text_step(out):
                    return out
            else:
                if not self._call_step(out, final=False):
                    return out

    def finish(self) -> list[Part]:
        out: list[Part] = []
        if self.in_call:
            self._call_step(out, final=True)
        else:
            self._emit_text(out, self.buf)
        self.buf = ""
        return out

    # --- text mode ---

    def _emit_text(self, out, s: str) -> None:
        if not s:
            return
        if self.calls and not s.strip():
            self.trailing_ws += s
            return
        out.append(TextPart(self.trailing_ws + s))
        self.trailing_ws = ""

    def _text_step(self, out) -> bool:
        """Consume text mode input; True when switched into call mode (more to do)."""
        if not self.fmt.marker:                 # llama3: the whole answer is a call, or none of it is
            if not self.decided:
                stripped = self.buf.lstrip()
                if not stripped:
                    return False
                self.decided = True
                if stripped.startswith("{"):
                    self.in_call, self.buf = True, stripped
                    return True
            self._emit_text(out, self.buf)
            self.buf = ""
            return False
        i = self.buf.find(self.fmt.marker)
        if i >= 0:
            self._emit_text(out, self.buf[:i])
            self.in_call, self.buf = True, self.buf[i + len(self.fmt.marker):]
            return True
        keep = next((k for k in range(min(len(self.fmt.marker) - 1, len(self.buf)), 0, -1)
                     if self.buf.endswith(self.fmt.marker[:k])), 0)
        self._emit_text(out, self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    # --- call mode ---

    def _call_step(self, out, final: bool) -> bool:
        end_marker = "</tool_call>" if self.fmt.marker else None
        j = self.buf.find(end_marker) if end_marker else -1
        body = self.buf[:j] if j >= 0 else self.buf
        objects = _top_level_objects(body)
        for k, (start, stop) in enumerate(objects):
            idx = self.block_calls + k
            obj = body[start:stop if stop is not None else len(body)]
            if idx >= len(self.calls):
                m = _CALL_HEAD.match(obj)
                if m:
                    self.calls.append(_Call(json.loads(f'"{m.group(1)}"')))
                    out.append(CallStart(idx, self.calls[idx].name))
                elif stop is not None:          # a complete object whose name does not come first
                    parsed = _parse_call(obj)
                    if parsed is None:
                        continue
                    self.calls.append(_Call(parsed.name, done=True))
                    out += [CallStart(idx, parsed.name), CallArgs(idx, parsed.arguments), CallEnd(idx)]
                    continue
                else:
                    break
            call = self.calls[idx]
            if call.done:
                continue
            m = _CALL_HEAD.match(obj)
            args = obj[m.end():]
            args_end = _value_end(args)
            if args_end is not None:
                args = args[:args_end]
            if len(args) > call.args_sent:
                out.append(CallArgs(idx, args[call.args_sent:]))
                call.args_sent = len(args)
            if args_end is not None and (stop is not None or final):
                call.done = True
                out.append(CallEnd(idx))
        if final:
            for idx, call in enumerate(self.calls):
                if not call.done:
                    call.done = True
                    out.append(CallEnd(idx))
            if not self.calls and body.strip():     # not a tool call after all: give the text back
                self._emit_text(out, (self.fmt.marker or "") + self.buf)
            return False
        if j >= 0:
            self.block_calls = len(self.calls)
            self.in_call, self.buf = False, self.buf[j + len(end_marker):]
            return True
        return False


def _parse_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _scan(text: str):
    """Yield (index, char, depth_before) for structural characters outside JSON strings."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            yield i, ch, depth
            depth += 1
        elif ch in "}]":
            depth -= 1
            yield i, ch, depth


def _top_level_objects(body: str) -> list[tuple[int, int | None]]:
    """Spans of the JSON objects at the outermost level of a block (inside a `[...]` list or bare)."""
    spans: list[tuple[int, int | None]] = []
    base = None
    for i, ch, depth in _scan(body):
        if base is None:
            base = depth + (1 if ch == "[" else 0)
            if ch == "[":
                continue
        if ch == "{" and depth == base:
            spans.append((i, None))
        elif ch == "}" and depth == base and spans and spans[-1][1] is None:
            spans[-1] = (spans[-1][0], i + 1)
    return spans


def _value_end(text: str) -> int | None:
    """Where the JSON value at the start of text ends, if it has ended (objects/arrays only)."""
    for i, ch, depth in _scan(text):
        if ch in "}]" and depth == 0:
            return i + 1
    return None


def parse_all(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """The non-streamed reading of a whole answer: (content, calls), by the same parser as streaming."""
    parser = fmt.parser()
    return collect(parser.feed(text) + parser.finish())


def collect(parts: list[Part]) -> tuple[str, list[ToolCall]]:
    text, calls = [], []
    for p in parts:
        if isinstance(p, TextPart):
            text.append(p.text)
        elif isinstance(p, CallStart):
            calls.append(ToolCall(p.name, ""))
        elif isinstance(p, CallArgs):
            calls[p.index].arguments += p.delta
    return "".join(text), calls
