"""Tool-call formats without a model: the streaming parser (any split of the text reads the same as the
whole), forced-call grammars (a random walk through llguidance's masks always yields a call that parses
and validates), and history rendering through a Hermes-style template."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from imp_runtime.chat_template import ChatTemplate
from imp_runtime.server.tools import (HermesFormat, JsonListFormat, Llama3Format, Tool, ToolCall, collect,
                                      detect_format, parse_all)
from tests.conftest_server import server  # noqa: F401

ARGS1 = {"city": "Pa}ris \"x\"", "days": [1, {"a": 2}]}
ARGS2 = {}
CASES = [
    (JsonListFormat(), f'Sure. <tool_call>[{{"name": "get_weather", "arguments": {json.dumps(ARGS1)}}}, '
                       f'{{"name": "noop", "arguments": {json.dumps(ARGS2)}}}]</tool_call>',
     "Sure. ", [("get_weather", ARGS1), ("noop", ARGS2)]),
    (HermesFormat(), f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(ARGS1)}}}\n</tool_call>\n'
                     f'<tool_call>\n{{"arguments": {{}}, "name": "noop"}}\n</tool_call>',
     "", [("get_weather", ARGS1), ("noop", ARGS2)]),
    (Llama3Format(), f' {{"name": "get_weather", "parameters": {json.dumps(ARGS1)}}}', "", [("get_weather", ARGS1)]),
    (Llama3Format(), 'Paris is {"not": "a call"}', 'Paris is {"not": "a call"}', []),
    (JsonListFormat(), "A <tool_ca and a <tool_call> that is no call", "A <tool_ca and a <tool_call> that is no call", []),
    (JsonListFormat(), "Just text.", "Just text.", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_parser_reads_any_split_the_same(fmt, text, content, calls):
    got_content, got_calls = parse_all(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    rng = random.Random(0)
    for _ in range(30):
        parser, events, i = fmt.parser(), [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            events += parser.feed(text[i:i + k])
            i += k
        events += parser.finish()
        streamed = collect(events)
        assert streamed[0] == got_content
        assert [(c.name, c.arguments) for c in streamed[1]] == [(c.name, c.arguments) for c in got_calls]


def test_truncated_call_still_reports_what_it_has():
    content, calls = parse_all(JsonListFormat(), '<tool_call>[{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "" and calls[0].name == "get_weather" and calls[0].arguments == '{"city": "Pa'


def test_detect_format():
    assert isinstance(detect_format("{% if tools %}<tool_call>{% endif %}"), HermesFormat)
    assert isinstance(detect_format("{{- '<|python_tag|>' }} ipython"), Llama3Format)
    assert isinstance(detect_format("{% for m in messages %}<|im_start|>{% endfor %}"), JsonListFormat)


TOOLS = [Tool("get_weather", "weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}),
    Tool("noop", "", {"type": "object", "properties": {}})]


@pytest.mark.parametrize("fmt", [JsonListFormat(), HermesFormat(), Llama3Format()], ids=lambda f: f.name)
def test_forced_grammar_always_yields_a_valid_call(server, fmt):
    """Walk llguidance's masks with random choices: whatever is drawn, the result is one call of one of
    the tools, in the format, whose arguments validate against that tool's schema."""
    svc = server.service
    eos = svc.engine.tokenizer.eos_ids
    grammar = svc.grammars.lark(fmt.grammar(TOOLS), "tool_choice")
    rng = np.random.default_rng(1)
    for _ in range(3):
        c = svc.grammars.constraint(grammar)
        ids = []
        for _ in range(300):
            allowed = np.flatnonzero(c.allowed())
            assert allowed.size
            tok = int(rng.choice(allowed))
            c.advance(tok)
            if tok in eos:
                break
            ids.append(tok)
            if c.is_done():
                break
        assert c.is_done()
        text = svc.engine.tokenizer.decode(ids)
        content, calls = parse_all(fmt, text)
        assert content.strip() == "" and len(calls) == 1, text
        tool = {t.name: t for t in TOOLS}[calls[0].name]
        jsonschema.validate(json.loads(calls[0].arguments), tool.parameters)


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- endif %}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>"
    "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": "", "tool_calls": [ToolCall("get_weather", '{"city": "Oslo"}', "c1")]},
           {"role": "tool", "content": "Snow", "tool_call_id": "c1"}]


def test_hermes_history_renders_arguments_as_objects():
    fmt = detect_format(HERMES_TEMPLATE)
    msgs, tools = fmt.prepare(HISTORY, TOOLS[:1])
    text = ChatTemplate(HERMES_TEMPLATE).render(msgs, tools=tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nSnow\n</tool_response>" in text
    assert json.loads(text.split("<tools>")[1].split("</tools>")[0])["function"]["name"] == "get_weather"


def test_json_list_history_and_prompt():
    msgs, tools = JsonListFormat().prepare(HISTORY, TOOLS[:1])
    assert tools is None and msgs[0]["role"] == "system" and '"get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nSnow\n</tool_response>"}
