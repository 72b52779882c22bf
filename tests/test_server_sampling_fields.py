"""Request fields beyond the basic sampling ones, through the live server (cpu executor); the oracle for token ids is
transformers' tokenizer over the bundle's files:
- OpenAI's `logit_bias`: a token biased by +100 is what greedy decoding picks, one biased by -100 is never picked,
  malformed maps are 400s naming the entry (on the GPU a biased request samples on the host, as a request with
  logprobs or a grammar does: runtime/engine.py Generation.host_sampled);
- vLLM's `stop_token_ids`: generation ends at the first such token, whose text is not returned (as the EOS's is not);
- vLLM's `chat_template_kwargs`: variables for the model's chat template (Qwen3's `enable_thinking`)."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest_server import API_KEY, chat_template_swapped, hf_tokenizer, server  # noqa: F401  (fixtures)

H = {"Authorization": f"Bearer {API_KEY}"}
ASK = {"messages": [{"role": "user", "content": "What colour is the sky?"}], "temperature": 0}


def chat(server, **kw):
    r = httpx.post(server.url + "/v1/chat/completions", json={**ASK, **kw}, headers=H, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def first_ids(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_positive_bias_forces_the_token(server, hf_tokenizer):
    (blue,) = first_ids(hf_tokenizer, " blue")
    got = chat(server, max_tokens=3, logit_bias={str(blue): 100}, ignore_eos=True)
    assert first_ids(hf_tokenizer, got["message"]["content"]) == [blue] * 3


def test_negative_bias_bans_the_greedy_token(server, hf_tokenizer):
    plain = chat(server, max_tokens=4, logprobs=True)
    first = plain["logprobs"]["content"][0]["token"]
    (tid,) = first_ids(hf_tokenizer, first)            # (one token's text: one id again)
    biased = chat(server, max_tokens=4, logprobs=True, logit_bias={str(tid): -100})
    assert biased["logprobs"]["content"][0]["token"] != first
    assert tid not in first_ids(hf_tokenizer, biased["message"]["content"])[:1]


@pytest.mark.parametrize("bias,field", [
    ({"blue": 1}, 'logit_bias["blue"]'),
    ({"-1": 1}, 'logit_bias["-1"]'),
    ({"99999999": 1}, 'logit_bias["99999999"]'),
    ({"5": 101}, 'logit_bias["5"]'),
    ({"5": "up"}, 'logit_bias["5"]'),
    ({"5": None}, 'logit_bias["5"]'),
    ([5], "logit_bias"),
])
def test_malformed_bias_is_a_400_naming_it(server, bias, field):
    r = httpx.post(server.url + "/v1/chat/completions", json={**ASK, "max_tokens": 1, "logit_bias": bias},
                   headers=H, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_stop_token_ids_end_the_generation_at_the_token(server, hf_tokenizer):
    plain = chat(server, max_tokens=6, logprobs=True, ignore_eos=True)
    toks = [e["token"] for e in plain["logprobs"]["content"]]
    ids = [first_ids(hf_tokenizer, t) for t in toks]
    assert all(len(i) == 1 for i in ids)
    k = next(j for j in range(1, 6) if ids[j][0] not in (x[0] for x in ids[:j]))    # first token not seen before it
    r = httpx.post(server.url + "/v1/chat/completions", headers=H, timeout=120, json={
        **ASK, "max_tokens": 6, "ignore_eos": True, "stop_token_ids": [ids[k][0]]})
    got = r.json()
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["choices"][0]["message"]["content"] == "".join(toks[:k])
    assert got["usage"]["completion_tokens"] == k + 1


@pytest.mark.parametrize("value", [[True], [-1], [10**9], "5", [1] * 65])
def test_malformed_stop_token_ids_are_a_400(server, value):
    r = httpx.post(server.url + "/v1/chat/completions", json={**ASK, "max_tokens": 1, "stop_token_ids": value},
                   headers=H, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text


def test_chat_template_kwargs_reach_the_template(server):
    with chat_template_swapped(server, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                                       "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"):
        def ids(**kw):
            r = httpx.post(server.url + "/tokenize", headers=H, timeout=60, json={"messages": ASK["messages"], **kw})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]
        off = ids(chat_template_kwargs={"enable_thinking": False})
        assert ids() == ids(chat_template_kwargs={"enable_thinking": True}) != off
        assert httpx.post(server.url + "/tokenize", headers=H, json={"prompt": "What colour is the sky?\n/no_think"}
                          ).json()["tokens"][-3:] == off[-3:]


@pytest.mark.parametrize("kw,field", [({"messages": []}, "chat_template_kwargs.messages"),
                                      ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                                      ({"not a name": 1}, "chat_template_kwargs.not a name")])
def test_chat_template_kwargs_the_server_sets_are_refused(server, kw, field):
    r = httpx.post(server.url + "/v1/chat/completions", json={**ASK, "max_tokens": 1, "chat_template_kwargs": kw},
                   headers=H, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
