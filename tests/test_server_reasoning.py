"""A thinking model's reasoning apart from its answer (runtime/server/reasoning.py), through the live server: the chat
template swapped for a thinking model's for the test (SmolLM2's has no <think>), and the generated text fixed by a
regex grammar, so the oracle is the text the grammar forces. OpenAI chat returns the reasoning as reasoning_content
(whole and streamed), Anthropic as a thinking block where the request enables thinking and not at all otherwise; the
Responses API's text leaves it out; /v1/completions is raw text."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest_server import API_KEY, chat_template_swapped as template, server  # noqa: F401  (fixture)

H = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "Capital of France?"}]
# a thinking model's template (Qwen3's shape): `opened` puts the generation prompt inside <think>, as DeepSeek-R1's does
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if opened %}<think>\n{% endif %}{% endif %}"
            "{# </think> #}")


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    return r


def forced(text: str) -> dict:
    return {"type": "regex", "regex": "".join("\\" + c if c in ".?*+()[]{}|\\^$" else c for c in text)}


def test_openai_chat_reasoning_content(server):
    out = "<think>\nIt is Paris.\n</think>\n\nParis."
    body = {"messages": MSGS, "max_tokens": 40, "temperature": 0, "response_format": forced(out)}
    with template(server, THINKING):
        msg = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("It is Paris.\n", "Paris.")
        lines = post(server, "/v1/chat/completions", {**body, "stream": True}).text.splitlines()
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines if x.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "It is Paris.\n"
        assert "".join(d.get("content") or "" for d in deltas) == "Paris."
        raw = post(server, "/v1/completions", {"prompt": "Q", "max_tokens": 40, "temperature": 0,
                                                "response_format": forced(out)}).json()["choices"][0]["text"]
        assert raw == out


def test_a_grammar_after_an_opened_think_is_the_answer(server):
    """The prompt opened <think> and a grammar constrains the answer: the grammar's text is the content."""
    out = "Paris."
    with template(server, THINKING):
        msg = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 10, "temperature": 0,
                                                    "response_format": forced(out),
                                                    "chat_template_kwargs": {"opened": True}}).json()
    assert msg["choices"][0]["message"]["content"] == out
    assert "reasoning_content" not in msg["choices"][0]["message"]


def test_no_split_without_a_thinking_template(server):
    out = "<think>x</think>y"
    msg = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 20, "temperature": 0,
                                               "response_format": forced(out)}).json()["choices"][0]["message"]
    assert msg["content"] == out and "reasoning_content" not in msg


def test_anthropic_thinking_blocks(server):
    """The prompt opens <think> and SmolLM2 never closes it: its whole greedy answer is reasoning, which the OpenAI
    chat of the same prompt returns as reasoning_content (the oracle here)."""
    body = {"messages": MSGS, "max_tokens": 12, "temperature": 0}
    with template(server, THINKING.replace("{% if opened %}<think>\n{% endif %}", "<think>\n")):
        reasoning = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["reasoning_content"]
        assert reasoning and "</think>" not in reasoning
        assert post(server, "/v1/messages", body).json()["content"] == [{"type": "text", "text": ""}]
        think = {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}
        assert post(server, "/v1/messages", think).json()["content"] == [
            {"type": "thinking", "thinking": reasoning, "signature": ""}, {"type": "text", "text": ""}]
        events = [json.loads(x[6:]) for x in post(server, "/v1/messages", {**think, "stream": True}).text.splitlines()
                  if x.startswith("data: ")]
        kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events]
        assert kinds[1] == ("content_block_start", "thinking")
        assert ("content_block_delta", "signature_delta") in kinds
        assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta") == reasoning
        earlier = {**body, "messages": MSGS + [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Paris."}]},
            {"role": "user", "content": "And Spain?"}]}
        assert post(server, "/v1/messages", earlier).status_code == 200      # earlier thinking blocks are taken


def test_reasoning_parser_none_keeps_the_text(server, monkeypatch):
    """`impc serve --reasoning-parser none` (Limits.reasoning False): the thinking template's answer as generated."""
    from dataclasses import replace
    out = "<think>\nIt is Paris.\n</think>\n\nParis."
    monkeypatch.setattr(server.service, "limits", replace(server.service.limits, reasoning=False))
    with template(server, THINKING):
        msg = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 40, "temperature": 0,
                                                    "response_format": forced(out)}).json()["choices"][0]["message"]
    assert msg["content"] == out and "reasoning_content" not in msg
