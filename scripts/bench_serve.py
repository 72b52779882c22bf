#!/usr/bin/env python3
"""Served-load benchmark: N concurrent streaming clients against an OpenAI-style /v1/completions.

    python scripts/bench_serve.py http://127.0.0.1:8080 --clients 8 --requests 32 \
        --prompt-len 512 --output-len 128 [--shared-prefix 1500] [--api-key KEY] [--json out.json]

Prompts are random token ids (the endpoint takes a prompt as an array of ids, so lengths are exact
with no tokenizer here); prompt and output lengths are drawn from a seeded distribution (uniform within
+-jitter of the mean), and --shared-prefix N starts every prompt with the same N tokens (a system
prompt, for the prefix cache). Reports requests/s, output tokens/s, time to first token and
inter-token latency p50/p99, and failures. Needs only the standard library and httpx, so it runs on a
machine with few packages.

The clients are threads spread over --procs processes (default: half this machine's cores, at most one a
client), so one interpreter lock does not hold back tokens that arrived (64 threads in one process read them
in bursts), and every client's connection is made before the clock starts (building 64 httpx clients takes
~1.4 s of one core: counted, it understated 64 streams' tokens/s by ~15%). The window runs from the start
signal to the last response's end.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Spec:
    index: int
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    index: int
    prompt_tokens: int
    max_tokens: int
    t_start: float = 0.0
    t_end: float = 0.0
    t_first: float | None = None
    stamps: list[float] = field(default_factory=list)      # arrival of each streamed token
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start


def make_specs(a) -> list[Spec]:
    rng = random.Random(a.seed)
    lo, hi = a.token_range
    shared = [rng.randrange(lo, hi) for _ in range(a.shared_prefix)]

    def draw(mean: int, jitter: float) -> int:
        return max(1, round(mean * (1 + rng.uniform(-jitter, jitter))))

    return [Spec(i, shared + [rng.randrange(lo, hi) for _ in range(draw(a.prompt_len, a.prompt_jitter))],
                 draw(a.output_len, a.output_jitter)) for i in range(a.requests)]


def run_one(client: httpx.Client, a, spec: Spec) -> Result:
    r = Result(spec.index, len(spec.prompt), spec.max_tokens)
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": a.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if a.model:
        body["model"] = a.model
    if a.ignore_eos:
        body["ignore_eos"] = True
    if a.frequency_penalty:
        body["frequency_penalty"] = a.frequency_penalty
    if a.repetition_penalty != 1.0:
        body["repetition_penalty"] = a.repetition_penalty
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    r.t_start = time.perf_counter()
    try:
        return _stream(client, a, body, headers, r)
    finally:
        r.t_end = time.perf_counter()


def _stream(client: httpx.Client, a, body: dict, headers: dict, r: Result) -> Result:
    try:
        with client.stream("POST", a.url.rstrip("/") + "/v1/completions", json=body, headers=headers,
                           timeout=a.timeout) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:200]}"
                return r
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    r.error = f"stream error: {json.dumps(d['error'])[:200]}"
                    return r
                if d.get("choices"):
                    now = time.perf_counter()
                    r.stamps.append(now)
                    if r.t_first is None:
                        r.t_first = now
                if d.get("usage"):
                    u = d["usage"]
                    r.output_tokens = u.get("completion_tokens", 0)
                    r.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (httpx.HTTPError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.output_tokens = r.output_tokens or len(r.stamps)
    if r.t_first is None:
        r.error = "no token came back"
    return r


def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def _client_process(a, specs: list[Spec], clients: int, next_spec, start, out) -> None:
    """`clients` client threads, each with its own connection, taking the next request (a counter shared by the
    processes) until none is left; the results go back in one message."""
    conns = [httpx.Client() for _ in range(clients)]
    results: list[Result] = []
    lock = threading.Lock()

    def client_loop(conn: httpx.Client) -> None:
        while True:
            with next_spec.get_lock():
                i = next_spec.value
                if i >= len(specs):
                    return
                next_spec.value = i + 1
            res = run_one(conn, a, specs[i])
            with lock:
                results.append(res)

    try:
        start.wait()
    except threading.BrokenBarrierError:        # the parent gave up waiting for a process
        return
    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    out.put(results)


def bench(a) -> dict:
    specs = make_specs(a)
    procs = min(a.clients, a.procs or max(1, (os.cpu_count() or 2) // 2))
    ctx = mp.get_context("fork")
    next_spec, start, out = ctx.Value("i", 0), ctx.Barrier(procs + 1), ctx.Queue()
    shares = [a.clients // procs + (i < a.clients % procs) for i in range(procs)]
    children = [ctx.Process(target=_client_process, args=(a, specs, n, next_spec, start, out), daemon=True)
                for n in shares]
    for c in children:
        c.start()
    try:
        start.wait(timeout=120)     # every client's connection object is built
    except threading.BrokenBarrierError:
        for c in children:
            c.terminate()
        raise SystemExit("bench_serve: a client process did not start within 120 s")
    cpu0 = cpu_seconds(a.server_pid)
    t0 = time.perf_counter()
    results: list[Result] = []
    got = 0
    while got < procs:
        try:
            results += out.get(timeout=1.0)
            got += 1
        except queue.Empty:
            if not any(c.is_alive() for c in children):
                break               # a client process died: its requests are missing (counted as failures)
    server_cpu = None if cpu0 is None else cpu_seconds(a.server_pid) - cpu0
    wall = max([r.t_end for r in results], default=time.perf_counter()) - t0
    for c in children:
        c.join(timeout=5)
    seen = {r.index for r in results}
    results += [Result(s.index, len(s.prompt), s.max_tokens, error="its client process died")
                for s in specs if s.index not in seen]
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok]
    # gaps between tokens as the client sees them (a burst of tokens shows as near-zero gaps)
    itls = [b - a_ for r in ok for a_, b in zip(r.stamps, r.stamps[1:])]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = lambda x: None if x is None else round(1000 * x, 1)  # noqa: E731
    return {
        "url": a.url, "clients": a.clients, "requests": len(results), "failures": len(results) - len(ok),
        "wall_s": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3),
        "output_tok_per_s": round(out_tokens / wall, 2), "output_tokens": out_tokens,
        "server_cpu_s": None if server_cpu is None else round(server_cpu, 2),
        "output_tok_per_server_cpu_s": round(out_tokens / server_cpu, 2) if server_cpu else None,
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in results) / max(len(results), 1), 1),
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)), "itl_ms_p99": ms(percentile(itls, 99)),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "per_request": [{"index": r.index, "ttft_ms": ms(r.ttft), "output_tokens": r.output_tokens,
                         "cached_tokens": r.cached_tokens, "error": r.error}
                        for r in sorted(results, key=lambda r: r.index)],
        "args": {k: v for k, v in vars(a).items() if k not in ("api_key",)},
    }


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), threads included: throughput per CPU-second
    of the server is steadier than per wall-second on a machine that other work also loads."""
    if pid is None:
        return None
    import os
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default 4 per client)")
    p.add_argument("--prompt-len", type=int, default=512, help="mean prompt tokens after the shared prefix")
    p.add_argument("--prompt-jitter", type=float, default=0.0, help="prompt length spread, a fraction (0.25: +-25%%)")
    p.add_argument("--output-len", type=int, default=128, help="mean max_tokens")
    p.add_argument("--output-jitter", type=float, default=0.0)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--token-range", type=lambda s: tuple(int(x) for x in s.split("-")), default=(1000, 20000),
                   help="token ids are drawn from LO-HI (default 1000-20000)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency_penalty of every request")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="repetition_penalty of every request")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (if it supports it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help="also write the result as JSON to this file")
    p.add_argument("--per-request", action="store_true", help="print each request's TTFT and tokens")
    p.add_argument("--procs", type=int, default=0,
                   help="client processes (default: half this machine's cores, at most one a client)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's process id, on this machine: also report output tokens per CPU-second it used")
    a = p.parse_args(argv)
    if a.requests is None:
        a.requests = 4 * a.clients
    if a.clients < 1 or a.requests < 1 or a.procs < 0:
        p.error("--clients and --requests must be at least 1, --procs at least 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    r = bench(a)
    print(f"{r['requests']} requests, {r['clients']} clients, prompts ~{r['prompt_tokens_mean']:.0f} tokens: "
          f"{r['requests_per_s']} req/s, {r['output_tok_per_s']} output tok/s over {r['wall_s']} s, "
          f"{r['failures']} failed")
    if r["server_cpu_s"] is not None:
        print(f"server CPU {r['server_cpu_s']} s: {r['output_tok_per_server_cpu_s']} output tok per CPU-second")
    print(f"TTFT p50 {r['ttft_ms_p50']} ms, p99 {r['ttft_ms_p99']} ms; "
          f"inter-token p50 {r['itl_ms_p50']} ms, p99 {r['itl_ms_p99']} ms")
    for e in r["errors"]:
        print(f"error: {e}", file=sys.stderr)
    if a.per_request:
        for q in r["per_request"]:
            print(f"  request {q['index']}: TTFT {q['ttft_ms']} ms, {q['output_tokens']} tokens, "
                  f"cached {q['cached_tokens']}" + (f", error {q['error']}" if q["error"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
