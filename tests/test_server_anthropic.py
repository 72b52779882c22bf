"""The server through the official `anthropic` SDK: messages (streamed and not, equal at temperature 0),
the exact SSE event sequence, count_tokens against transformers' count, stop sequences, forced tool use
(streamed tool_use input equals the OpenAI dialect's non-streamed arguments)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.conftest_server import API_KEY, chat_prompt_tokens, hf_tokenizer, server  # noqa: F401

anthropic = pytest.importorskip("anthropic")

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


GREEDY = {"temperature": 0}     # this SDK version has no temperature argument; the API still takes it


def prompt_total(usage) -> int:
    """The prompt's tokens in Anthropic's usage: those computed plus those read from the prefix cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(client, server):
    return client.messages.create(model=server.model, max_tokens=12, extra_body=GREEDY, messages=QUESTION)


def test_message_usage_matches_tokenizer(reference, client, server, hf_tokenizer):
    r = reference
    assert r.role == "assistant" and r.content[0].type == "text" and r.content[0].text
    expected = chat_prompt_tokens(hf_tokenizer, QUESTION)
    assert prompt_total(r.usage) == expected and r.usage.input_tokens >= 1
    assert client.messages.count_tokens(model=server.model, messages=QUESTION).input_tokens == expected
    assert r.stop_reason in ("end_turn", "max_tokens")
    if r.stop_reason == "max_tokens":
        assert r.usage.output_tokens == 12


def test_system_prompt_counts(client, server, hf_tokenizer):
    msgs = [{"role": "system", "content": "You are terse."}] + QUESTION
    n = client.messages.count_tokens(model=server.model, system="You are terse.", messages=QUESTION).input_tokens
    assert n == chat_prompt_tokens(hf_tokenizer, msgs)


def test_stream_equals_non_stream_with_exact_events(reference, server):
    """Raw SSE, so the event names and their order are checked exactly as sent."""
    body = {"model": server.model, "max_tokens": 12, "temperature": 0, "messages": QUESTION, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    kinds = [e["type"] for e in events]
    n_deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * n_deltas + \
        ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert all(e["delta"]["type"] == "text_delta" for e in events if e["type"] == "content_block_delta")
    assert text == reference.content[0].text
    delta = events[-2]
    assert delta["delta"]["stop_reason"] == reference.stop_reason
    assert delta["usage"]["output_tokens"] == reference.usage.output_tokens
    u = events[0]["message"]["usage"]
    assert u["input_tokens"] + u.get("cache_read_input_tokens", 0) == prompt_total(reference.usage)
    d = delta["usage"]
    assert d["input_tokens"] + d["cache_read_input_tokens"] == prompt_total(reference.usage)


def test_sdk_stream_helper(reference, client, server):
    with client.messages.stream(model=server.model, max_tokens=12, extra_body=GREEDY, messages=QUESTION) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == reference.content[0].text == final.content[0].text


def test_stop_sequence(reference, client, server):
    text = reference.content[0].text
    stop = text.split()[min(2, len(text.split()) - 1)]
    r = client.messages.create(model=server.model, max_tokens=12, extra_body=GREEDY, messages=QUESTION,
                               stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[:text.index(stop)]


def test_forced_tool_use_streams_and_matches_openai(client, server):
    msgs = [{"role": "user", "content": "What is the weather like in Tokyo?"}]
    with client.messages.stream(model=server.model, max_tokens=40, extra_body=GREEDY, messages=msgs, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        partial = "".join(ev.delta.partial_json for ev in s
                          if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta")
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    (block,) = [b for b in final.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])
    assert json.loads(partial) == block.input
    # the same request in the OpenAI dialect, not streamed, gives the same call
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": server.model, "max_tokens": 40, "temperature": 0, "messages": msgs,
                         "tools": [{"type": "function", "function": {"name": WEATHER["name"],
                                    "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
                         "tool_choice": "required"}).json()
    call = r["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and call["arguments"] == partial


def test_tool_result_round_trip(client, server, hf_tokenizer):
    """A tool_use / tool_result history renders with the result in the prompt verbatim, and the model
    answers in text. The oracle: two results differ in prompt length by exactly their own token counts
    (transformers' tokenizer), so a result dropped, truncated or rendered twice fails."""
    def history(result: str):
        return [{"role": "user", "content": "Weather in Tokyo?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Tokyo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]

    short, long = "Sunny, 21 C", "Heavy snow, -5 C, wind 80 km/h from the north"
    r = client.messages.create(model=server.model, max_tokens=4, extra_body=GREEDY, messages=history(short),
                               tools=[WEATHER])
    assert r.content[0].type == "text" and r.content[0].text and r.stop_reason in ("end_turn", "max_tokens")
    n_long = client.messages.count_tokens(model=server.model, messages=history(long), tools=[WEATHER]).input_tokens
    own = lambda s: len(hf_tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert n_long - prompt_total(r.usage) == own(long) - own(short) > 0


def test_json_schema_output_validates(client, server):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    r = client.messages.create(model=server.model, max_tokens=24, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Pick a colour and a count, as JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)
