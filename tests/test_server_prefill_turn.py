"""A final assistant message continued rather than answered (a "prefill"): Anthropic's semantics for a last assistant
message, and vLLM's `continue_final_message` for OpenAI chat. The oracle: transformers' apply_chat_template(...,
continue_final_message=True) over the bundle's tokenizer files, and the same ids greedily continued through
/v1/completions."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest_server import API_KEY, hf_tokenizer, server  # noqa: F401  (fixtures)

H = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}]


def post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, headers=H, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def oracle_ids(hf_tokenizer) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(MSGS, continue_final_message=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenize_continues_the_final_message(server, hf_tokenizer):
    got = post(server, "/tokenize", {"messages": MSGS, "continue_final_message": True, "add_generation_prompt": False})
    assert got["tokens"] == oracle_ids(hf_tokenizer)
    assert post(server, "/tokenize", {"messages": MSGS, "continue_final_message": True})["tokens"] == got["tokens"]


def test_openai_and_anthropic_continue_it(server, hf_tokenizer):
    want = post(server, "/v1/completions", {"prompt": oracle_ids(hf_tokenizer), "max_tokens": 8,
                                            "temperature": 0})["choices"][0]["text"]
    chat = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "temperature": 0,
                                                 "continue_final_message": True, "add_generation_prompt": False})
    assert chat["choices"][0]["message"]["content"] == want
    msg = post(server, "/v1/messages", {"messages": MSGS, "max_tokens": 8, "temperature": 0})
    assert [b["text"] for b in msg["content"]] == [want]
    new_turn = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "temperature": 0})
    assert new_turn["usage"]["prompt_tokens"] > len(oracle_ids(hf_tokenizer))      # a new assistant turn after it


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": MSGS[:1], "continue_final_message": True, "add_generation_prompt": False},
     "messages"),
    ("/v1/chat/completions", {"messages": MSGS, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": MSGS, "add_generation_prompt": False}, "continue_final_message"),
])
def test_openai_flags_checked(server, path, body, field):
    assert post(server, path, {**body, "max_tokens": 2}, 400)["error"]["param"] == field


def test_anthropic_prefill_ending_in_whitespace_is_refused(server):
    body = {"messages": [MSGS[0], {"role": "assistant", "content": "The capital is "}], "max_tokens": 2}
    assert post(server, "/v1/messages", body, 400)["error"]["message"].startswith("messages[1].content")
