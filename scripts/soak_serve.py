#!/usr/bin/env python
"""Sustained load on a running server, with the checks a soak needs beyond "no errors":
- N clients, each sending streaming /v1/completions back to back (no synchronised waves) for M minutes,
  prompts of random token ids of random length, `ignore_eos` so each runs to its max_tokens;
- a canary: one fixed prompt, greedy, sent alone before the load and again every --canary-every seconds under
  it; every answer must be the first answer's text (a garbled or batch-dependent stream fails it);
- afterwards: /health answers, and /metrics says no KV page is held by a generation (imp_kv_pages_in_use 0).
Prints one JSON line: requests, failures, output tokens, canary checks and mismatches, pages in use, and
output tok/s per minute (to see a slowdown over time).

Usage: python scripts/soak_serve.py URL [--minutes 10] [--clients 64] [--prompt-len 512] [--output-len 256]"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import httpx


def stream_completion(client: httpx.Client, url: str, model: str, prompt, max_tokens: int, greedy: bool) -> tuple[str, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": not greedy,
            "temperature": 0.0 if greedy else 1.0, "seed": 0, "stream_options": {"include_usage": True}}
    text, n = [], 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(f"error event: {d['error']}")
            for c in d.get("choices") or []:
                text.append(c.get("text", ""))
            if d.get("usage"):
                n = d["usage"].get("completion_tokens", 0)
    return "".join(text), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--canary-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    url = a.url.rstrip("/")
    http = httpx.Client(timeout=600)
    models = http.get(url + "/v1/models").json()["data"]
    model = models[0]["id"]
    vocab = 1000
    canary_prompt = [random.Random(1234).randrange(3, vocab) for _ in range(64)]
    canary_text, _ = stream_completion(http, url, model, canary_prompt, 32, greedy=True)
    stats = {"requests": 0, "failures": 0, "output_tokens": 0, "canary_checks": 0, "canary_mismatches": 0}
    errors: list[str] = []
    per_minute: list[int] = []
    lock = threading.Lock()
    t0 = time.time()
    stop = t0 + a.minutes * 60

    def worker(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        with httpx.Client(timeout=600) as c:
            while time.time() < stop:
                n = max(1, int(a.prompt_len * rng.uniform(0.5, 1.5)))
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                try:
                    _, toks = stream_completion(c, url, model, prompt, a.output_len, greedy=False)
                    ok = toks == a.output_len
                except Exception as e:  # noqa: BLE001 - counted and reported
                    ok, toks = False, 0
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}"[:200])
                with lock:
                    stats["requests"] += 1
                    stats["failures"] += 0 if ok else 1
                    stats["output_tokens"] += toks
                    m = int((time.time() - t0) // 60)
                    while len(per_minute) <= m:
                        per_minute.append(0)
                    per_minute[m] += toks

    def canary() -> None:
        with httpx.Client(timeout=600) as c:
            while time.time() + a.canary_every < stop:
                time.sleep(a.canary_every)
                try:
                    text, _ = stream_completion(c, url, model, canary_prompt, 32, greedy=True)
                    same = text == canary_text
                except Exception as e:  # noqa: BLE001
                    same = False
                    errors.append(f"canary: {type(e).__name__}: {e}"[:200])
                with lock:
                    stats["canary_checks"] += 1
                    stats["canary_mismatches"] += 0 if same else 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(a.clients)]
    threads.append(threading.Thread(target=canary, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.0)
    health = http.get(url + "/health").status_code
    pages = None
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith("imp_kv_pages_in_use "):
            pages = float(line.split()[1])
    out = {"minutes": a.minutes, "clients": a.clients, **stats, "health": health, "kv_pages_in_use_after": pages,
           "output_tok_s_per_minute": [round(x / 60, 1) for x in per_minute], "errors": errors[:5]}
    print(json.dumps(out))
    ok = stats["failures"] == 0 and stats["canary_mismatches"] == 0 and health == 200 and pages == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
