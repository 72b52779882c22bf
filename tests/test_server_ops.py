"""Operations: /metrics counts what the clients saw, a client that disconnects cancels its generation
and frees its KV, and concurrent clients all make progress."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest_server import API_KEY, chat_prompt_tokens, hf_tokenizer, server  # noqa: F401

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def metrics(server) -> dict[tuple, float]:
    r = httpx.get(server.url + "/metrics")      # no key needed
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(server, timeout=20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if value(m, "imp_running_requests") == 0 and value(m, "imp_queue_depth") == 0:
            return m
        if time.time() > deadline:
            pytest.fail("generations still running after the clients left")
        time.sleep(0.1)


def test_metrics_count_a_request(server):
    before = wait_idle(server)
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}).json()
    bad = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={"messages": []})
    assert bad.status_code == 400
    after = metrics(server)
    u = r["usage"]
    d = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731
    assert d("imp_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert d("imp_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert d("imp_prompt_tokens_total") == u["prompt_tokens"]
    assert d("imp_generation_tokens_total") == u["completion_tokens"]
    assert d("imp_time_to_first_token_seconds_count") == 1
    assert d("imp_inter_token_latency_seconds_count") == u["completion_tokens"] - 1
    assert value(after, "imp_kv_pages_in_use") == 0
    for name in ("imp_queue_depth", "imp_running_requests", "imp_kv_pages_in_use"):
        assert (name, ()) in after


def _kv_sequences(server) -> int:
    return len(getattr(server.service.engine.executor, "_seqs", {}))


def _page_size(server) -> int:
    # the executor's own page size where it has one (paged KV), else the server's reporting unit
    return getattr(server.service.engine.executor, "page_size", None) or server.service.limits.page_size


def test_stream_disconnect_cancels_and_frees_kv(server, hf_tokenizer):
    before = wait_idle(server)
    messages = [{"role": "user", "content": "Write a long story about a dragon."}]
    body = {"messages": messages, "max_tokens": 400, "temperature": 0, "stream": True}
    n_prompt, page = chat_prompt_tokens(hf_tokenizer, messages), _page_size(server)
    seen = 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content": "' in line:
                seen += 1
                if seen == 3:
                    m = metrics(server)
                    # the pages that hold the prompt and the tokens so far: at least the 3 seen (less the
                    # one not yet decoded), and not more than the generation can have run ahead meanwhile
                    pages = value(m, "imp_kv_pages_in_use")
                    assert -(-(n_prompt + seen - 1) // page) <= pages <= -(-(n_prompt + seen + 40) // page), pages
                    assert value(m, "imp_running_requests") == 1
                    assert _kv_sequences(server) == 1
                    break               # closes the connection mid-stream
    after = wait_idle(server)
    assert value(after, "imp_kv_pages_in_use") == 0 and _kv_sequences(server) == 0
    assert value(after, "imp_cancelled_requests_total") - value(before, "imp_cancelled_requests_total") == 1
    assert value(after, "imp_generation_tokens_total") - value(before, "imp_generation_tokens_total") < 100


def test_non_stream_disconnect_cancels(server):
    before = wait_idle(server)
    body = {"messages": [{"role": "user", "content": "Write a long story about a cat."}], "max_tokens": 400,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=2.0)
    after = wait_idle(server)
    assert _kv_sequences(server) == 0
    assert value(after, "imp_cancelled_requests_total") - value(before, "imp_cancelled_requests_total") == 1
    assert value(after, "imp_generation_tokens_total") - value(before, "imp_generation_tokens_total") < 200


def test_concurrent_clients_all_progress(server):
    wait_idle(server)
    stamps: dict[int, list[float]] = {0: [], 1: []}

    def client(i: int):
        body = {"messages": [{"role": "user", "content": ["Count to ten.", "Name some animals."][i]}],
                "max_tokens": 10, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content": "' in line:
                    stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    a, b = stamps[0], stamps[1]
    assert len(a) >= 5 and len(b) >= 5
    # interleaved, not one after the other: each got tokens before the other finished
    assert a[0] < b[-1] and b[0] < a[-1]
    assert sum(1 for t in b if a[0] < t < a[-1]) >= 3


def test_the_async_backend_is_loaded_before_the_first_request():
    """anyio imports its asyncio backend on first use (the first streamed response): ~50 ms of the first request's
    time to first token unless the app loads it at creation. A fresh interpreter, so nothing loaded it before."""
    import subprocess
    import sys
    code = ("import sys, types\nfrom imp_runtime.server.app import create_app\n"
            "before = 'anyio._backends._asyncio' in sys.modules\n"
            "create_app(types.SimpleNamespace(limits=types.SimpleNamespace(allowed_origins=())))\n"
            "print(before, 'anyio._backends._asyncio' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True"]


def test_load_generator_counts_what_it_asked_for(server, tmp_path):
    """scripts/bench_serve.py (clients over two processes) against the live server: every request streams the
    max_tokens it asked for (ignore_eos), so the output tokens are requests x max_tokens, each request's TTFT and the
    run's window are positive; with a wrong key every request fails and the exit status says so."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_serve.py"
    base = [sys.executable, str(script), server.url, "--clients", "3", "--requests", "5", "--prompt-len", "12",
            "--output-len", "6", "--ignore-eos", "--procs", "2", "--token-range", "100-2000"]
    out = tmp_path / "run.json"
    p = subprocess.run(base + ["--api-key", API_KEY, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["failures"] == 0 and r["requests"] == 5
    assert r["output_tokens"] == 5 * 6
    assert sorted(q["index"] for q in r["per_request"]) == [0, 1, 2, 3, 4]
    assert all(q["output_tokens"] == 6 and q["ttft_ms"] > 0 for q in r["per_request"])
    assert r["wall_s"] > 0 and r["itl_ms_p50"] is not None
    bad = subprocess.run(base + ["--api-key", "wrong-key"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert "5 requests, 3 clients" in bad.stdout and "5 failed" in bad.stdout and "HTTP 401" in bad.stderr
