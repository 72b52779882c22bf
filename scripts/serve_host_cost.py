#!/usr/bin/env python
"""The served host cost without a GPU: `impc serve`'s app over HTTP on a simulated device.

The real app (runtime/server: starlette on uvicorn, the queue's worker thread, the scheduler, the cuda
executor's step-value writes, detokenizing, server-sent events) over scripts/host_step_cost.py's
SimulatedGpu, whose decode step takes --gpu-ms of wall time; N streaming clients of /v1/completions in a
separate process (raw asyncio sockets: a client as light as can be, so the figure is the server's).
Prints output tokens/s against the rate the simulated device allows (rows / step time) and the
scheduler's split of a step: what the event loop's per-token work and the worker's host work leave of
the device's time when both share one interpreter lock.

Usage: scripts/serve_host_cost.py BUNDLE [--clients 64] [--gpu-ms 5] [--seconds 8]
                                  [--loop auto|asyncio|uvloop] [--http auto|h11|httptools]
BUNDLE: a bundle with a GPU target's program and the served tokenizer (build/syn-qwen3-8b-P).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


async def _client_main(port: int, clients: int, seconds: float, warm: float, prompt_len: int, vocab: int,
                       max_tokens: int) -> None:
    """Each client streams completions back to back; prints the tokens received after the warm-up."""
    import random
    rng = random.Random(1)
    counts = [0]
    t_end = time.perf_counter() + seconds
    t_warm = time.perf_counter() + warm
    errors = [0]
    gaps: list[float] = []          # ms between a stream's consecutive tokens as they arrive (0: in the same read)

    async def one(i: int) -> None:
        while time.perf_counter() < t_end:
            body = json.dumps({"prompt": [rng.randrange(vocab) for _ in range(prompt_len)], "max_tokens": max_tokens,
                               "temperature": 0.8, "stream": True, "ignore_eos": True}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            buf = b""
            last = None
            while time.perf_counter() < t_end:
                data = await reader.read(65536)
                if not data:
                    break
                buf += data
                n = buf.count(b"\ndata: {")
                if n:
                    now = time.perf_counter()
                    if now >= t_warm:
                        counts[0] += n
                        if last is not None:
                            gaps.append(1e3 * (now - last))
                        gaps.extend([0.0] * (n - 1))
                    last = now
                    buf = buf[buf.rfind(b"\ndata: {") + 1:]
                if b"[DONE]" in buf or b'"error"' in buf:
                    errors[0] += b'"error"' in buf
                    break
            writer.close()

    await asyncio.gather(*(one(i) for i in range(clients)))
    from bench_serve import percentile      # the served-load harness's rule, so the two scripts' figures compare
    pct = lambda p: None if not gaps else round(percentile(gaps, p), 2)      # noqa: E731
    print(json.dumps({"tokens": counts[0], "seconds": seconds - warm, "errors": errors[0], "gap_ms_p50": pct(50),
                      "gap_ms_p99": pct(99), "together": round(sum(g == 0.0 for g in gaps) / max(len(gaps), 1), 3)}))


async def _prefix_client(port: int, prefix: int, new: int, requests: int, vocab: int) -> None:
    """Requests one after another, each a shared prefix of `prefix` ids and `new` ids of its own, one output
    token: the time from sending each to its first streamed token (the first request prefills the prefix)."""
    import random
    rng = random.Random(2)
    shared = [rng.randrange(vocab) for _ in range(prefix)]
    ttfts = []
    for _ in range(requests):
        body = json.dumps({"prompt": shared + [rng.randrange(vocab) for _ in range(new)], "max_tokens": 1,
                           "temperature": 0.0, "stream": True}).encode()
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        buf = b""
        while b"\ndata: {" not in buf:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
        ttfts.append(1e3 * (time.perf_counter() - t0))
        while await reader.read(65536):
            pass
        writer.close()
    print(json.dumps({"ttft_ms": ttfts}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--gpu-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=8.0, help="the load's length (the first 3 s not counted)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--prefix", type=int, default=0, help="instead: one client, requests sharing a prefix of this "
                    "many ids plus --prompt-len of their own, one output token each: the host's time to first token")
    ap.add_argument("--max-tokens", type=int, default=256, help="each streaming request's output tokens (default 256, "
                    "at most what the bundle's context leaves)")
    ap.add_argument("--requests", type=int, default=8, help="with --prefix: how many (default 8)")
    ap.add_argument("--client", nargs=2, type=int, metavar=("PORT", "VOCAB"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        if a.prefix:
            asyncio.run(_prefix_client(a.client[0], a.prefix, a.prompt_len, a.requests, a.client[1]))
        else:
            asyncio.run(_client_main(a.client[0], a.clients, a.seconds, 3.0, a.prompt_len, a.client[1], a.max_tokens))
        return
    if not a.bundle:
        ap.error("give a bundle")

    import uvicorn
    from host_step_cost import SimulatedGpu
    from imp_runtime import engine as engine_module
    from imp_runtime.bundle import load_bundle
    from imp_runtime.scheduler import StepTimes
    from imp_runtime.server import Limits, build_app
    from imp_runtime.tokenizer import Tokenizer

    bundle = load_bundle(a.bundle, verify=False)
    vocab = Tokenizer(bundle.tokenizer_json(), bundle.manifest["tokenizer"]).vocab_size
    engine_module.make_executor = lambda b, device, kv_pages: SimulatedGpu(b, a.gpu_ms / 1e3, vocab)
    sys.setswitchinterval(float(os.environ.get("IMP_SWITCH_INTERVAL", "0.0005")))   # as impc serve
    app, svc = build_app(a.bundle, limits=Limits(max_running=a.clients))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=a.port, log_level="warning",
                                           loop=a.loop, http=a.http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = subprocess.Popen([sys.executable, __file__, "--client", str(a.port), str(vocab), "--clients",
                               str(a.clients), "--seconds", str(a.seconds), "--prompt-len", str(a.prompt_len),
                               "--prefix", str(a.prefix), "--requests", str(a.requests), "--max-tokens",
                               str(min(a.max_tokens, svc.engine.max_context - a.prompt_len - 1))], stdout=subprocess.PIPE, text=True)
    if a.prefix:
        out, _ = client.communicate()
        server.should_exit = True
        thread.join(timeout=5)
        ms = json.loads(out.strip().splitlines()[-1])["ttft_ms"]
        print(f"time to first token, a {a.prefix}-token shared prefix + {a.prompt_len} new tokens, simulated device "
              f"(prefill takes no time): first {ms[0]:.2f} ms, then {', '.join(f'{x:.2f}' for x in ms[1:])} ms")
        return
    time.sleep(3.0)
    sched = svc.engine.scheduler
    sched.times = StepTimes()
    gpu = svc.engine.executor
    gpu.idle_s = 0.0
    out, _ = client.communicate()
    t = sched.times
    r = json.loads(out.strip().splitlines()[-1])
    server.should_exit = True
    thread.join(timeout=5)
    ceiling = a.clients * 1e3 / a.gpu_ms
    rate = r["tokens"] / r["seconds"]
    print(f"{a.clients} clients, simulated step {a.gpu_ms} ms, loop {a.loop}, http {a.http}: {rate:.0f} output tok/s "
          f"({100 * rate / ceiling:.0f}% of the {ceiling:.0f} the device allows), {r['errors']} errors; the device "
          f"idle {1e3 * gpu.idle_s / max(t.steps, 1):.2f} ms a step; inter-token gaps at the clients p50 "
          f"{r['gap_ms_p50']} / p99 {r['gap_ms_p99']} ms, {100 * r['together']:.0f}% of tokens in the same read as the "
          f"one before\n  scheduler: {t.line()}")


if __name__ == "__main__":
    main()
