"""Property-based requests against the live server (cpu executor, SmolLM2): for each endpoint, hypothesis
draws a valid request from the endpoint's schema, then mutates it (wrong types, values out of range,
numbers JSON does not have, lone surrogates, deep nesting, oversized bodies, broken bytes, headers).
Whatever comes in: no 5xx, no hang, a mutation that makes the request invalid gets a 4xx, every error is
in the endpoint's dialect, every stream parses and ends properly, and the server stays healthy with
nothing left running. Derandomized, with a fixed number of examples, so `make test` stays quick."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest_server import API_KEY, MAX_BODY, MAX_N, server  # noqa: F401

# no shrinking: a failure prints its example at once (shrinking against a live server can take minutes)
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIMEOUT = 60                       # a request that takes longer has hung
MAX_GENERATED = 2                  # valid requests ask for at most this many tokens each

# ------------------------------------------------------------------ valid requests, from each API's schema

text = st.text(st.characters(codec="utf-8"), max_size=24)
few_tokens = st.integers(1, MAX_GENERATED)
stop = st.one_of(text, st.lists(text, max_size=3))
seed = st.integers(-2**63, 2**63 - 1)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def unit(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False)


sampling = {"temperature": unit(0, 2), "top_p": unit(0, 1), "top_k": st.integers(-1, 100), "min_p": unit(0, 1),
            "presence_penalty": unit(-2, 2), "frequency_penalty": unit(-2, 2),
            "repetition_penalty": unit(0.5, 2), "seed": seed, "stop": stop, "stream": st.booleans()}
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)
chat_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                      "content": st.one_of(text, text_parts)})
response_format = st.sampled_from([
    {"type": "text"}, {"type": "json_object"}, {"type": "regex", "regex": "(yes|no)[0-9]?"},
    {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}])
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(chat_message, min_size=1, max_size=3), "max_tokens": few_tokens},
    optional={**sampling, "n": st.integers(1, MAX_N), "logprobs": st.booleans(), "response_format": response_format,
              "tools": st.just([{"type": "function", "function": WEATHER}]),
              "tool_choice": st.sampled_from(["auto", "none"]), "user": text})
completion_body = st.fixed_dictionaries(
    {"prompt": st.one_of(text.filter(bool), st.lists(text.filter(bool), min_size=1, max_size=2),
                         st.lists(st.integers(0, 49151), min_size=1, max_size=8)),
     "max_tokens": few_tokens},
    optional={**sampling, "n": st.integers(1, 2), "logprobs": st.integers(0, 5), "echo": st.booleans()})
responses_body = st.fixed_dictionaries(
    {"input": st.one_of(text.filter(bool), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": text}), min_size=1, max_size=2)),
     "max_output_tokens": few_tokens},
    optional={"temperature": unit(0, 2), "top_p": unit(0, 1), "instructions": text, "stream": st.booleans(),
              "text": st.just({"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}),
              "tools": st.just([{"type": "function", **WEATHER}]), "metadata": st.dictionaries(text, text, max_size=2)})
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.one_of(text, text_parts)})
messages_body = st.fixed_dictionaries(
    {"messages": st.lists(anthropic_message, min_size=1, max_size=3), "max_tokens": few_tokens},
    optional={"system": text, "temperature": unit(0, 1), "top_p": unit(0, 1), "top_k": st.integers(0, 100),
              "stop_sequences": st.lists(text, max_size=2), "stream": st.booleans(),
              "metadata": st.fixed_dictionaries({"user_id": text}),
              "tools": st.just([{"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}])})
count_body = st.fixed_dictionaries({"messages": st.lists(anthropic_message, min_size=1, max_size=3)},
                                   optional={"system": text})


@dataclass
class Endpoint:
    path: str
    dialect: str                               # openai | anthropic
    body: st.SearchStrategy
    budget: str | None                         # the max-tokens field: never dropped, never set large
    answer: Callable[[dict], bool]             # whether a 200's body is this endpoint's answer
    # numeric fields and the range the reference API allows: a value outside it must be refused
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)


OPENAI_RANGES = {"temperature": (0, 2), "top_p": (0, 1), "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2),
                 "min_p": (0, 1), "seed": (-2**63, 2**63 - 1), "top_k": (-1, 2**31 - 1)}
ENDPOINTS = {
    "chat": Endpoint("/v1/chat/completions", "openai", chat_body, "max_tokens",
                     lambda out: out["object"] == "chat.completion" and len(out["choices"]) >= 1,
                     {**OPENAI_RANGES, "n": (1, MAX_N), "top_logprobs": (0, 20), "max_tokens": (1, 2047)}),
    "completions": Endpoint("/v1/completions", "openai", completion_body, "max_tokens",
                            lambda out: out["object"] == "text_completion" and len(out["choices"]) >= 1,
                            {**OPENAI_RANGES, "logprobs": (0, 20), "max_tokens": (1, 2047)}),
    "responses": Endpoint("/v1/responses", "openai", responses_body, "max_output_tokens",
                          lambda out: out["object"] == "response" and out["error"] is None,
                          {"temperature": (0, 2), "top_p": (0, 1), "max_output_tokens": (1, 2047)}),
    "messages": Endpoint("/v1/messages", "anthropic", messages_body, "max_tokens",
                         lambda out: out["type"] == "message" and len(out["content"]) >= 1,
                         {"temperature": (0, 1), "top_p": (0, 1), "max_tokens": (1, 2047)}),
    "count_tokens": Endpoint("/v1/messages/count_tokens", "anthropic", count_body, None,
                             lambda out: isinstance(out["input_tokens"], int) and out["input_tokens"] > 0),
}

# ------------------------------------------------------------------ mutations

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False,
                      allow_infinity=False), text)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                          max_leaves=6)
# what a max-tokens field may become: never a valid large budget, which would make the suite slow
bad_budget = st.sampled_from([0, -1, "3", 2.5, 10**6, [], {}, True, 2**64])


def _paths(node, prefix=()) -> list[tuple]:
    """Every place in the body a mutation can touch: (key or index, ...)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out


def _set(body, path, value):
    node = body
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _get(body, path):
    for k in path:
        body = body[k]
    return body


@dataclass
class Request:
    body: dict
    headers: dict
    raw: bytes | None = None                  # sent instead of the body when set
    must_fail: list[str] = field(default_factory=list)   # mutations that make the request invalid


def mutate(draw, ep: Endpoint, body: dict) -> Request:
    """Up to two mutations that may or may not leave the request valid, then at most one that makes it
    invalid (last, so nothing undoes it)."""
    req = Request(body, {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    for _ in range(draw(st.integers(0, 2))):
        paths = [p for p in _paths(body) if p[0] != ep.budget]
        kind = draw(st.sampled_from(["retype", "drop", "extra", "charset", "x-api-key", "noise-header"]))
        if kind == "retype" and paths:
            _set(body, draw(st.sampled_from(paths)), draw(json_value))
        elif kind == "drop" and paths:
            path = draw(st.sampled_from(paths))
            parent = _get(body, path[:-1])
            if isinstance(parent, dict):
                del parent[path[-1]]
        elif kind == "extra":
            body[draw(text)] = draw(json_value)
        elif kind == "charset":
            req.headers["content-type"] = "application/json; charset=utf-8"
        elif kind == "x-api-key":
            req.headers.pop("Authorization", None)
            req.headers["x-api-key"] = API_KEY
        elif kind == "noise-header":
            req.headers["x-" + draw(st.text("abcdefgh", min_size=1, max_size=8))] = draw(
                st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40))

    kinds = ["valid", "nonfinite", "surrogate", "deep", "big", "bytes", "no-type", "text/plain", "no-key",
             "wrong-key"] + (["range"] if ep.ranges else []) + (["budget"] if ep.budget else [])
    kind = draw(st.sampled_from(kinds))
    paths = _paths(body) + [("extra",)]
    if kind == "range":
        name = draw(st.sampled_from(sorted(ep.ranges)))
        lo, hi = ep.ranges[name]
        is_int = isinstance(lo, int) and isinstance(hi, int) and name not in ("temperature", "top_p")
        step = 1 if is_int else draw(st.sampled_from([1e-6, 0.5, 1e6]))
        body[name] = draw(st.sampled_from([lo - step, hi + step]))
        req.must_fail.append(f"{name} out of range")
    elif kind == "nonfinite":
        _set(body, draw(st.sampled_from(paths)), draw(st.sampled_from([float("nan"), float("inf"), float("-inf")])))
        req.must_fail.append("a non-finite number")
    elif kind == "surrogate":
        _set(body, draw(st.sampled_from(paths)), draw(text) + chr(draw(st.integers(0xD800, 0xDFFF))))
        req.must_fail.append("a lone surrogate")
    elif kind == "deep":
        depth = draw(st.integers(65, 3000))
        inner = ("[" * depth + "]" * depth) if draw(st.booleans()) else ('{"a": ' * depth + "1" + "}" * depth)
        req.raw = (json.dumps(body)[:-1] + (", " if body else "") + f'"deep": {inner}}}').encode()
        req.must_fail.append("nesting too deep")
    elif kind == "budget":
        body[ep.budget] = draw(bad_budget)
        req.must_fail.append("a bad token budget")
    elif kind == "big":
        body["padding"] = "x" * (MAX_BODY + 1)
        req.must_fail.append("a body over the limit")
    elif kind == "bytes":
        raw = json.dumps(body).encode()
        cut = draw(st.integers(1, len(raw) - 1))
        if draw(st.booleans()):
            req.raw = raw[:cut]
            req.must_fail.append("truncated JSON")
        else:
            req.raw = raw[:cut] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[cut:]
            req.must_fail.append("bytes that are not UTF-8")
    elif kind == "no-type":
        del req.headers["content-type"]
        req.must_fail.append("no Content-Type")
    elif kind == "text/plain":
        req.headers["content-type"] = "text/plain"
        req.must_fail.append("a Content-Type that is not JSON")
    elif kind == "no-key":
        req.headers.pop("Authorization", None)
        req.headers.pop("x-api-key", None)
        req.must_fail.append("no API key")
    elif kind == "wrong-key":
        req.headers.pop("x-api-key", None)
        req.headers["Authorization"] = "Bearer " + draw(st.text("abcdef0123456789", max_size=12))
        req.must_fail.append("a wrong API key")
    return req


# ------------------------------------------------------------------ checks


def check_error_shape(dialect: str, r: httpx.Response) -> None:
    body = r.json()
    if dialect == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert isinstance(err["type"], str) and isinstance(err["message"], str), body
    else:
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), body
    assert "Traceback" not in err["message"] and "\n" not in err["message"], err["message"]


def check_stream(ep: Endpoint, lines: list[str]) -> None:
    """Every data line is JSON, errors are in the dialect's shape, and the stream ends as the API says."""
    events, names, name = [], [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                events.append("[DONE]")
                continue
            data = json.loads(line[6:])
            events.append(data)
            names.append(name)
            if ep.dialect == "anthropic":
                assert data["type"] == name
            if isinstance(data, dict) and "error" in data and ep.dialect == "openai" and ep.path != "/v1/responses":
                assert set(data["error"]) == {"message", "type", "param", "code"}
    assert events, "an empty stream"
    if ep.path == "/v1/responses":
        assert names[-1] in ("response.completed", "response.incomplete", "error"), names[-3:]
    elif ep.dialect == "anthropic":
        assert names[-1] in ("message_stop", "error"), names[-3:]
        if names[-1] == "error":
            assert set(events[-1]["error"]) == {"type", "message"}
    else:
        assert events[-1] == "[DONE]"


def send(server, ep: Endpoint, req: Request) -> None:
    content = req.raw if req.raw is not None else json.dumps(req.body).encode()   # NaN and \ud800 as JSON spells them
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", server.url + ep.path, content=content, headers=req.headers) as r:
            lines = list(r.iter_lines()) if r.headers.get("content-type", "").startswith("text/event-stream") else None
            if lines is None:
                r.read()
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if req.must_fail:
        assert 400 <= r.status_code < 500, f"accepted a request with {req.must_fail}: {r.status_code} {r.text[:200]}"
    if r.status_code >= 400:
        check_error_shape(ep.dialect, r)
    elif lines is not None:
        check_stream(ep, lines)
    else:
        assert ep.answer(r.json()), r.text[:300]


def healthy(server) -> None:
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"


def idle_with_no_pages(server, timeout: float = 30.0) -> None:
    """Every client has its answer: nothing running or queued, and no KV page held."""
    deadline = time.time() + timeout
    while True:
        h = httpx.get(server.url + "/health", timeout=10).json()
        pages = [s.value for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
                 for s in f.samples if s.name == "imp_kv_pages_in_use"]
        if h["running"] == 0 and h["waiting"] == 0 and pages == [0]:
            return
        assert time.time() < deadline, f"still busy after the suite: {h}, pages {pages}"
        time.sleep(0.1)


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
def test_fuzz_endpoint(server, name):
    ep = ENDPOINTS[name]

    @FUZZ
    @given(st.data())
    def run(data):
        body = data.draw(ep.body, label="valid body")
        send(server, ep, mutate(data.draw, ep, body))
        healthy(server)

    run()
    idle_with_no_pages(server)
