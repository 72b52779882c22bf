"""/tokenize and /detokenize (vLLM's and llama.cpp's fields) against transformers' tokenizer and chat template over the
bundle's files (tests/conftest_server.py hf_tokenizer), and CORS for `--allowed-origins` (off by default)."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest_server import API_KEY, server, hf_tokenizer  # noqa: F401  (fixtures)

H = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=H, timeout=60, **kw)


def test_tokenize_text_as_both_servers_ask(server, hf_tokenizer):
    text = "The sky is blue, naïvely speaking: 42 tokens?"
    bos = hf_tokenizer(text)["input_ids"]                                  # the tokenizer's post-processor's ids
    plain = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    r = post(server, "/tokenize", {"model": server.model, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == bos and r.json()["count"] == len(bos)
    assert r.json()["max_model_len"] == server.service.engine.max_context
    assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == plain
    assert post(server, "/tokenize", {"content": text}).json()["tokens"] == plain           # llama.cpp: no BOS
    assert post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == bos


def test_tokenize_chat_is_the_chat_requests_prompt(server, hf_tokenizer):
    want = hf_tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if hasattr(want, "keys"):                  # (a BatchEncoding in newer transformers)
        want = want["input_ids"]
    r = post(server, "/tokenize", {"messages": CHAT})
    assert r.status_code == 200 and r.json()["tokens"] == list(want)
    usage = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(want)


def test_detokenize_round_trip(server, hf_tokenizer):
    ids = hf_tokenizer("Hello there, world.")["input_ids"]
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200
    want = hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert r.json() == {"prompt": want, "content": want}


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_bad_requests_name_their_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field


def test_key_required(server):
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a"}, timeout=10).status_code == 401


def test_no_cors_by_default(server):
    pre = httpx.options(server.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
