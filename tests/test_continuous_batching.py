"""Continuous batching through the server: concurrent requests share one executor decode call per step,
and each still gets exactly the answer it gets alone (the oracle: the same request served by itself)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from imp_runtime.executor_cpu import decode_attention

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


def _attention_float64(q, k, v, n: int, scale: float, window: int) -> np.ndarray:
    """The definition for one query at position n - 1 over keys 0 .. n - 1, in float64 loops over heads."""
    h, kv = q.shape[0], k.shape[1]
    out = np.zeros(q.shape)
    for head in range(h):
        kh = head // (h // kv)
        visible = [j for j in range(n) if not window or (n - 1) - j < window]
        s = np.array([q[head].astype(np.float64) @ k[j, kh] for j in visible]) * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        out[head] = sum(pj * v[j, kh].astype(np.float64) for pj, j in zip(p, visible))
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_batched_decode_attention_matches_the_definition_row_by_row(window):
    """One batched product over rows of different lengths (GQA, 6 query heads on 2 KV heads): each row
    sees only its own keys, whatever the padding past its length holds, and the sliding window."""
    rng = np.random.default_rng(7)
    lengths = np.array([1, 9, 4, 16])
    q = rng.standard_normal((4, 6, 8)).astype(np.float32)
    k = rng.standard_normal((4, 16, 2, 8)).astype(np.float32)
    v = rng.standard_normal((4, 16, 2, 8)).astype(np.float32)
    for b, n in enumerate(lengths):           # padding: large values that would dominate if they leaked
        k[b, n:], v[b, n:] = 50.0, 1e4
    got = decode_attention(q, k, v, lengths, 0.35, window)
    for b, n in enumerate(lengths):
        want = _attention_float64(q[b], k[b], v[b], int(n), 0.35, window)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)
