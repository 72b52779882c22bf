"""Continuous batching through the server: concurrent requests share one executor decode call per step,
and each still gets exactly the answer it gets alone (the oracle: the same request served by itself)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest_server import API_KEY, server  # noqa: F401 - the session fixture

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["Name a color.", "What is 2+2?", "Say hi in French."]


def ask(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_concurrent_requests_share_decode_steps_and_match_solo_answers(server):  # noqa: F811
    engine = server.service.engine
    ex = engine.executor
    batch_sizes: list[int] = []
    real_decode = ex.decode

    def spy(rows):
        batch_sizes.append(len(rows))
        return real_decode(rows)

    solo = [ask(server.url, p) for p in PROMPTS]
    ex.decode = spy
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: ask(server.url, p), PROMPTS))
    finally:
        del ex.decode          # back to the class's method
    assert together == solo
    assert max(batch_sizes) >= 2, batch_sizes
    assert not getattr(ex, "_seqs", {})          # every sequence's slot freed
    assert engine.blocks.in_use() == 0           # and every KV page back (cached ones are reclaimable)
