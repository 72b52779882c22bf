"""OpenAI's `logit_bias` through the live server (cpu executor): a token biased by +100 is what greedy decoding
picks, one biased by -100 is never picked, and malformed maps are 400s naming the entry. The oracle for token ids:
transformers' tokenizer over the bundle's files. (On the GPU a biased request samples on the host, as a request with
logprobs or a grammar does: runtime/engine.py Generation.host_sampled.)"""
from __future__ import annotations

import httpx
import pytest

from tests.conftest_server import API_KEY, hf_tokenizer, server  # noqa: F401  (fixtures)

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
