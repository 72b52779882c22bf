"""The server through the official `openai` SDK: chat, completions, responses, models; streaming equals
non-streaming at temperature 0; usage equals transformers' token counts; forced tool calls parse and
validate; JSON-schema output validates; stop strings; logprobs."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from tests.conftest_server import API_KEY, chat_prompt_tokens, hf_tokenizer, server  # noqa: F401

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_answer(client, server):
    """The non-streamed reference answer to QUESTION at temperature 0 (12 tokens)."""
    return client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=12, temperature=0)


def test_models_lists_the_bundle(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [json.loads((server.bundle / "manifest.json").read_text())["name"]]   # the bundle's own name
    assert client.models.retrieve(server.model).id == server.model


def test_chat_usage_matches_tokenizer(greedy_answer, hf_tokenizer):
    r = greedy_answer
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens == chat_prompt_tokens(hf_tokenizer, QUESTION)
    # finish_reason says whether the budget ran out: then exactly max_tokens were generated
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    else:
        assert r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_ignore_eos_runs_to_max_tokens_past_the_end_of_the_answer(client, server):
    """vLLM's ignore_eos: the answer that ended with EOS continues, unchanged up to there, to max_tokens."""
    ended = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=64, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 64   # the premise
    full = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=64, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 64
    assert full.choices[0].message.content.startswith(ended.choices[0].message.content)


def test_chat_stream_equals_non_stream(client, server, greedy_answer):
    chunks, stamps, usage, finish = [], [], None, None
    stream = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                chunks.append(c.delta.content)
                stamps.append(time.perf_counter())
            finish = c.finish_reason or finish
    assert "".join(chunks) == greedy_answer.choices[0].message.content
    assert finish == greedy_answer.choices[0].finish_reason
    assert usage.prompt_tokens == greedy_answer.usage.prompt_tokens
    assert usage.completion_tokens == greedy_answer.usage.completion_tokens
    # flushed per token: the chunks arrive spread out over the generation, not in one burst at the end
    assert len(chunks) >= greedy_answer.usage.completion_tokens - 2
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    assert gaps[len(gaps) // 2] > 0.005, gaps


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(tops[0])  # greedy: the argmax


def test_stop_string_cuts_the_answer(client, server, greedy_answer):
    text = greedy_answer.choices[0].message.content
    words = text.split()
    stop = words[min(3, len(words) - 1)]          # a string the unconstrained answer contains
    r = client.chat.completions.create(model=server.model, messages=QUESTION, max_tokens=12, temperature=0,
                                       stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]


def test_n_choices(client, server):
    """n=2 with seed 7: usage counts both choices' tokens, and choice i draws from seed + i, so choice 1 is
    exactly the single answer to the same request with seed 8."""
    ask = dict(model=server.model, messages=QUESTION, max_tokens=3, temperature=1.0, logprobs=True)
    r = client.chat.completions.create(**ask, seed=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    counts = [len(c.logprobs.content) for c in r.choices]         # one logprob entry per generated token
    for c, k in zip(r.choices, counts):
        assert k == 3 if c.finish_reason == "length" else 1 <= k <= 3
    assert r.usage.completion_tokens == sum(counts)
    alone = [client.chat.completions.create(**ask, seed=s, n=1).choices[0] for s in (7, 8)]
    assert [c.message.content for c in alone] == [c.message.content for c in r.choices]


def test_json_schema_output_validates(client, server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=server.model, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_regex_output_matches(client, server):
    # bounded, so it must be complete well within max_tokens (14 tokens at the very most): a constraint
    # that let the model stop early or wander off fails here
    pattern = r"(Yes|No), [a-z]{1,8}\."
    r = client.chat.completions.create(
        model=server.model, max_tokens=24, temperature=0, messages=[{"role": "user", "content": "Is Paris in France?"}],
        response_format={"type": "regex", "regex": pattern})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content


def test_forced_tool_call_parses_and_validates(client, server):
    r = client.chat.completions.create(
        model=server.model, max_tokens=48, temperature=0, tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    # streamed: the call's name first, then its arguments in pieces that add up to the same text
    names, args, finish = [], [], None
    for ch in client.chat.completions.create(
            model=server.model, max_tokens=48, temperature=0, tools=[WEATHER_TOOL], stream=True,
            messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for d in ch.choices[0].delta.tool_calls or []:
            assert d.index == 0
            if d.function.name:
                names.append(d.function.name)
            args.append(d.function.arguments or "")
        finish = ch.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert len([a for a in args if a]) > 1 and "".join(args) == call.function.arguments


def test_completions_stream_equals_non_stream(client, server, hf_tokenizer):
    prompt = "The three primary colours are"
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    assert full.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    parts = [ch.choices[0].text for ch in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=8, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == full.choices[0].text
    assert len(parts) > 1


def test_responses_stream_equals_non_stream(client, server, hf_tokenizer):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    full = client.responses.create(model=server.model, input="Name a fruit.", max_output_tokens=8, temperature=0)
    assert full.usage.input_tokens == chat_prompt_tokens(hf_tokenizer, msgs)
    kinds, deltas, done = [], [], None
    for ev in client.responses.create(model=server.model, input="Name a fruit.", max_output_tokens=8,
                                      temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    assert "".join(deltas) == full.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert done.usage.output_tokens == full.usage.output_tokens
