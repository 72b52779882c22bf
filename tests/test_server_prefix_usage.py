"""The prefix cache as clients see it: a repeated prompt reports the tokens it reused in each dialect's usage
(OpenAI prompt_tokens_details.cached_tokens, Anthropic cache_read_input_tokens with input_tokens the rest)
and in /metrics. The expected count is computed by hand: every whole KV page of the prompt but the last
token's (the last prompt token is always computed, for its logits)."""
from __future__ import annotations

import httpx

from tests.conftest_server import API_KEY, server  # noqa: F401
from tests.test_server_ops import metrics, value

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely, and never mention rule {i + 1}." for i in range(12))


def test_repeated_prompt_reports_cached_tokens(server):
    page = server.service.engine.executor.page_size
    before = metrics(server)
    body = {"model": server.model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]}
    first = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120).json()
    second = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120).json()
    n = second["usage"]["prompt_tokens"]
    assert n > 2 * page
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // page * page
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] <= second["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = metrics(server)
    hits = value(after, "imp_prefix_cache_hit_tokens") - value(before, "imp_prefix_cache_hit_tokens")
    assert hits >= (n - 1) // page * page
    a = {"model": server.model, "max_tokens": 2, "system": SYSTEM, "messages": [{"role": "user", "content": "Hi"}],
         "temperature": 0}
    httpx.post(server.url + "/v1/messages", json=a, headers=AUTH, timeout=120)
    u = httpx.post(server.url + "/v1/messages", json=a, headers=AUTH, timeout=120).json()["usage"]
    total = u["input_tokens"] + u["cache_read_input_tokens"]
    assert u["cache_read_input_tokens"] == (total - 1) // page * page and u["input_tokens"] >= 1
