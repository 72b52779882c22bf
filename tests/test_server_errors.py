"""Bad requests and auth, in both dialects: every one a 4xx in the dialect's error shape naming the field,
answered promptly; never a 500, never a hang."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest_server import API_KEY, MAX_BODY, MAX_N, server  # noqa: F401

OK_MSGS = [{"role": "user", "content": "Hi"}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]},
              "then": {"required": ["a"]}}
LONG = "hello " * 2500          # > the test bundle's 2048-token context
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def post(server, path, body, headers=None, raw: bytes | None = None):
    h = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json", **(headers or {})}
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, headers=h, timeout=30)


def chat(**kw):
    return {"messages": OK_MSGS, "max_tokens": 2, **kw}


# (case id, path, body or raw bytes, status, field the message must name)
OPENAI_CASES = [
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', 400, "body"),
    ("body-not-object", "/v1/chat/completions", b"[1, 2]", 400, "body"),
    ("messages-missing", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages-wrong-type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("role-unknown", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content-wrong-type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("content-image", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0].type"),
    ("temperature-type", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("temperature-range", "/v1/chat/completions", chat(temperature=7), 400, "temperature"),
    ("top-p-type", "/v1/chat/completions", chat(top_p=[1]), 400, "top_p"),
    ("seed-type", "/v1/chat/completions", chat(seed="abc"), 400, "seed"),
    ("stop-type", "/v1/chat/completions", chat(stop=123), 400, "stop"),
    ("stream-type", "/v1/chat/completions", chat(stream="yes"), 400, "stream"),
    ("model-unknown", "/v1/chat/completions", chat(model="gpt-5"), 404, "model"),
    ("max-tokens-zero", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/chat/completions", chat(max_tokens=-3), 400, "max_tokens"),
    ("max-completion-tokens-zero", "/v1/chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max-tokens-beyond-context", "/v1/chat/completions", chat(max_tokens=100000), 400, "max_tokens"),
    ("prompt-beyond-context", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("n-too-large", "/v1/chat/completions", chat(n=MAX_N + 1), 400, "n"),
    ("n-zero", "/v1/chat/completions", chat(n=0), 400, "n"),
    ("top-logprobs-alone", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("stream-options-no-stream", "/v1/chat/completions", chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("tool-bad-name", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
     400, "tools[0].function.name"),
    ("tool-params-not-object", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), 400, "tools[0].function.parameters"),
    ("tool-schema-unsupported", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": BAD_SCHEMA}}]), 400, "tools[0].function.parameters"),
    ("tool-wrong-kind", "/v1/chat/completions", chat(tools=[{"type": "code_interpreter"}]), 400, "tools[0].type"),
    ("tool-choice-unknown", "/v1/chat/completions", chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool-choice-without-tools", "/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("format-unsupported-keyword", "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}), 400, "response_format.json_schema.schema"),
    ("format-type", "/v1/chat/completions", chat(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("format-bad-regex", "/v1/chat/completions", chat(response_format={"type": "regex", "regex": "[a-"}), 400,
     "response_format.regex"),
    ("completions-prompt-missing", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("completions-bad-token-ids", "/v1/completions", {"prompt": [1, -4]}, 400, "prompt[0]"),
    ("completions-max-tokens", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("completions-prompt-beyond-context", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("responses-input-missing", "/v1/responses", {}, 400, "input"),
    ("responses-previous-id", "/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400,
     "previous_response_id"),
    ("responses-max-output", "/v1/responses", {"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    # numbers JSON does not have (Python's reader takes them), strings no encoder takes, absurd nesting
    ("temperature-nan", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
     b'"temperature": NaN}', 400, "temperature"),
    ("top-p-infinity", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
     b'"top_p": -Infinity}', 400, "top_p"),
    ("penalty-overflow", "/v1/completions", b'{"prompt": "a", "presence_penalty": 1e999}', 400, "presence_penalty"),
    ("temperature-huge-int", "/v1/chat/completions", chat(temperature=10**400), 400, "temperature"),
    ("lone-surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     400, "messages[0].content"),
    ("lone-surrogate-prompt", "/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt[1]"),
    ("nested-too-deep", "/v1/chat/completions", b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "messages"),
    ("nested-past-recursion", "/v1/completions", b"[" * 50000 + b"]" * 50000, 400, "body"),
    ("seed-beyond-int64", "/v1/chat/completions", chat(seed=2**63), 400, "seed"),
    ("seed-below-int64", "/v1/chat/completions", chat(seed=-2**63 - 1), 400, "seed"),
    ("top-k-huge", "/v1/chat/completions", chat(top_k=10**30), 400, "top_k"),
    ("format-regex-cannot-run", "/v1/chat/completions", chat(response_format={"type": "regex", "regex": "a{99999999}"}),
     400, "response_format.regex"),
]

ANTHROPIC_CASES = [
    ("malformed-json", "/v1/messages", b"{nope", 400, "body"),
    ("max-tokens-missing", "/v1/messages", {"messages": OK_MSGS}, 400, "max_tokens"),
    ("max-tokens-zero", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-type", "/v1/messages", {"messages": OK_MSGS, "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-beyond-context", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 100000}, 400, "max_tokens"),
    ("messages-empty", "/v1/messages", {"messages": [], "max_tokens": 2}, 400, "messages"),
    ("role-system", "/v1/messages", {"messages": [{"role": "system", "content": "x"}], "max_tokens": 2}, 400,
     "messages[0].role"),
    ("block-unsupported", "/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}], "max_tokens": 2}, 400, "messages[0].content[0].type"),
    ("model-unknown", "/v1/messages", {"model": "claude-x", "messages": OK_MSGS, "max_tokens": 2}, 404, "model"),
    ("temperature-range", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "temperature": 1.5}, 400, "temperature"),
    ("top-k-type", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "top_k": "many"}, 400, "top_k"),
    ("stop-sequences-type", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "stop_sequences": "x"}, 400,
     "stop_sequences"),
    ("prompt-beyond-context", "/v1/messages", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2}, 400,
     "messages"),
    ("tool-schema-missing", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "tools": [{"name": "f"}]}, 400,
     "tools[0].input_schema"),
    ("tool-schema-unsupported", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2,
                                                 "tools": [{"name": "f", "input_schema": BAD_SCHEMA}]}, 400,
     "tools[0].input_schema"),
    ("tool-choice-unknown", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}}, 400,
     "tool_choice.name"),
    ("metadata-type", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "metadata": "me"}, 400, "metadata"),
    ("format-unsupported-keyword", "/v1/messages", {"messages": OK_MSGS, "max_tokens": 2, "output_config": {
        "format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, 400, "output_config.format.schema"),
    ("count-tokens-empty", "/v1/messages/count_tokens", {"messages": []}, 400, "messages"),
    ("temperature-nan", "/v1/messages", b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
     b'"temperature": NaN}', 400, "temperature"),
    ("lone-surrogate-system", "/v1/messages", b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
     b'"system": "\\ud83d"}', 400, "system"),
    ("nested-too-deep", "/v1/messages", b'{"metadata": ' + b'{"a": ' * 80 + b"1" + b"}" * 80 + b"}", 400, "metadata"),
]


def check_openai_error(r, status, field):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    assert field in err["message"]
    return err


def check_anthropic_error(r, status, field, kind="invalid_request_error"):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and isinstance(body["error"]["message"], str)
    assert field in body["error"]["message"]


@pytest.mark.parametrize("case,path,body,status,field", OPENAI_CASES, ids=[c[0] for c in OPENAI_CASES])
def test_openai_bad_request(server, case, path, body, status, field):
    r = post(server, path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    err = check_openai_error(r, status, field)
    assert err["param"] == field


@pytest.mark.parametrize("case,path,body,status,field", ANTHROPIC_CASES, ids=[c[0] for c in ANTHROPIC_CASES])
def test_anthropic_bad_request(server, case, path, body, status, field):
    r = post(server, path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    check_anthropic_error(r, status, field, "not_found_error" if status == 404 else "invalid_request_error")


def test_unsupported_keyword_is_named(server):
    r = post(server, "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}))
    m = re.search(r"unsupported JSON schema keywords? (.+?) \(", r.json()["error"]["message"])
    # if/then are the keywords llguidance does not implement; properties and type, which it does, are not named
    assert m and {k.strip() for k in m.group(1).split(",")} == {"if", "then"}, r.json()


def test_body_must_be_declared_json(server):
    """Like vLLM and llama.cpp's server: a body that is not declared JSON is a 415, in the dialect's shape."""
    body = json.dumps(chat()).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        h = {"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY}
        if ctype:
            h["content-type"] = ctype
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=h, timeout=30)
        assert check_openai_error(r, 415, "Content-Type")["code"] == "unsupported_media_type"
        r = httpx.post(server.url + "/v1/messages", content=body, headers=h, timeout=30)
        check_anthropic_error(r, 415, "Content-Type")
    r = post(server, "/v1/chat/completions", chat(max_tokens=1), headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_negative_seed_is_a_seed(server):
    """Any signed 64-bit seed is taken (as OpenAI and vLLM do) and reproduces its draw; -1 and 1 differ."""
    def draw(seed):
        r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.5,
                                             "seed": seed})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    first = draw(-1)
    assert draw(-1) == first
    assert draw(-2**63)                # the int64 range's end is a seed too
    assert draw(1) != first            # -1 is not read as 1 (nor as "no seed": then the first check fails)


def test_oversized_body(server):
    big = {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}], "max_tokens": 2}
    check_openai_error(post(server, "/v1/chat/completions", big), 413, "body")
    check_anthropic_error(post(server, "/v1/messages", big), 413, "body", "request_too_large")


def test_unknown_route_is_json(server):
    r = httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 405 and "error" in r.json()


def test_sdk_raises_typed_errors(server):
    import anthropic
    import openai

    oc = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    assert e.value.param == "messages"
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="nope", messages=OK_MSGS, max_tokens=2)
    ac = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=server.model, messages=OK_MSGS, max_tokens=0)
    assert "max_tokens" in str(e.value)


# ------------------------------------------------------------------ auth


def test_auth_required_and_accepted(server):
    body = json.dumps({"messages": OK_MSGS, "max_tokens": 1, "temperature": 0})
    for path in ("/v1/chat/completions", "/v1/messages"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                        {"Authorization": API_KEY}, {"x-api-key": API_KEY[:-1]}):
            r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json", **headers})
            if path == "/v1/messages":
                check_anthropic_error(r, 401, "API key", "authentication_error")
            else:
                assert check_openai_error(r, 401, "API key")["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    ok_body = json.dumps({"messages": OK_MSGS, "max_tokens": 1, "temperature": 0})
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {"x-api-key": API_KEY},
                    {"authorization": f"bearer {API_KEY}"}):
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200
        r = httpx.post(server.url + "/v1/messages/count_tokens", content=ok_body, timeout=60,
                       headers={"content-type": "application/json", **headers})
        assert r.status_code == 200, r.text


def test_health_needs_no_key(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_sdk_auth_errors(server):
    import anthropic
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=server.model, messages=OK_MSGS, max_tokens=1)
