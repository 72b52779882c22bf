"""Structured output's edges: JSON response formats take the whitespace JSON allows (capped), a grammar
llguidance accepts but cannot run is refused up front, and one that fails mid-generation ends the request
with an error naming the field, never a normal stop."""
from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer

from imp_runtime.server.structured import ConstraintError
from tests.conftest_server import API_KEY, server  # noqa: F401

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PERSON = {"name": "Ann", "tags": ["a", {"b": 1}], "age": 31, "ok": True}
# passes the up-front probe (the digits come first), fails when generation reaches the a{...} part
FAILS_LATER = "[0-9]{8}a{99999999}"


@pytest.fixture(scope="module")
def tok(server):
    """The bundle's tokenizer through the `tokenizers` library, not the server's wrapper of it."""
    return Tokenizer.from_file(str(server.bundle / "tokenizer.json"))


def accepts(server, grammar, tok, text: str) -> bool:
    """Whether the grammar lets a generation write exactly `text` and then stop."""
    c = server.service.grammars.constraint(grammar)
    try:
        for t in tok.encode(text, add_special_tokens=False).ids:
            if not c.allowed()[t]:
                return False
            c.advance(t)
        eos = sorted(server.service.engine.tokenizer.eos_ids)
        return c.is_done() or bool(c.allowed()[eos].any())
    except ConstraintError:
        return False


@pytest.mark.parametrize("text,ok", [
    (json.dumps(PERSON), True),
    (json.dumps(PERSON, separators=(",", ":")), True),
    (json.dumps(PERSON, indent=2), True),
    (json.dumps(PERSON, indent=4), True),
    (json.dumps(PERSON, indent="\t"), True),
    (json.dumps(PERSON, indent=2).replace("\n", "\r\n"), True),
    ('{' + " " * 32 + '"a": 1}', True),
    ('{' + " " * 33 + '"a": 1}', False),         # the cap: a model cannot loop on spaces
    ('{\n\n"a": 1}', False),                       # nor on blank lines
    ('{"a": 1', False),
], ids=["dumps", "compact", "indent2", "indent4", "tabs", "crlf", "32-spaces", "33-spaces", "blank-line", "unclosed"])
def test_json_object_takes_json_whitespace(server, tok, text, ok):
    grammar = server.service.grammars.json_schema({"type": "object"}, "response_format")
    assert accepts(server, grammar, tok, text) == ok


def test_json_schema_takes_json_whitespace(server, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = server.service.grammars.json_schema(schema, "response_format.json_schema.schema")
    assert accepts(server, grammar, tok, json.dumps({"name": "Bo", "age": 3}, indent=2))
    assert not accepts(server, grammar, tok, json.dumps({"name": "Bo", "age": "3"}, indent=2))


def test_constraint_raises_when_its_grammar_fails(server):
    grammar = server.service.grammars.regex(FAILS_LATER, "response_format.regex")   # the probe passes
    c = server.service.grammars.constraint(grammar)
    with pytest.raises(ConstraintError, match="lexer"):
        for _ in range(40):
            assert not c.is_done()
            c.advance(int(c.allowed().nonzero()[0][0]))
    assert c.failure is not None


def _chat(stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": "A number?"}], "max_tokens": 16, "temperature": 0,
            "stream": stream, "response_format": {"type": "regex", "regex": FAILS_LATER}}


def test_grammar_failing_mid_generation_is_an_error(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=_chat(False), headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.regex" and "during generation" in err["message"]
    # streamed: the digits arrive, then an error event, and no chunk claims a normal finish
    text, errors, finishes = "", [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=_chat(True), headers=AUTH, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                errors.append(data["error"])
                continue
            for c in data["choices"]:
                text += c["delta"].get("content") or ""
                finishes += [c["finish_reason"]] if c["finish_reason"] else []
    assert len(text) == 8 and text.isdigit()
    assert finishes == [] and len(errors) == 1 and errors[0]["param"] == "response_format.regex"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
