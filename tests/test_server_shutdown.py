"""`impc serve` stopped with SIGTERM while generating: a stream ends with the dialect's error event and
`[DONE]` (a complete response, not a cut connection), a request waiting for a whole answer gets a 503 in
its dialect, and the process exits promptly: within a second of the last stream's end, even while the
generation worker is in the middle of a long prompt's prefill chunk (seconds on a CPU)."""
from __future__ import annotations

import json
import signal
import threading
import time

import asyncio

import httpx

from imp_runtime.engine import Engine
from imp_runtime.sampler import SamplingParams
from imp_runtime.server.metrics import Metrics
from imp_runtime.server.queue import FairQueue
from tests.conftest_server import serve_process, wait_up

LONG = [{"role": "user", "content": "Write a long story about a dragon."}]


def test_sigterm_ends_generations_cleanly():
    proc, url = serve_process()
    try:
        wait_up(proc, url)

        waiting: dict = {}

        def ask_whole_answer():
            waiting["r"] = httpx.post(url + "/v1/messages", timeout=60, json={
                "messages": LONG, "max_tokens": 400, "temperature": 0})
        asker = threading.Thread(target=ask_whole_answer)
        asker.start()

        def ask_long_prompt():       # 1,900 tokens: four 512-token prefill chunks, about a second each
            waiting["long"] = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": list(range(1000, 2900)), "max_tokens": 4, "temperature": 0})
        long_asker = threading.Thread(target=ask_long_prompt)

        lines, t_term = [], None
        body = {"messages": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():     # raises if the connection is cut before the body is complete
                if line.startswith("data: "):
                    lines.append(line[6:])
                if len(lines) == 2 and not long_asker.is_alive() and "long" not in waiting:
                    long_asker.start()
                # SIGTERM once all three generations run (the long prompt's admission takes a step or more;
                # under a loaded machine more than two of this stream's tokens)
                if len(lines) >= 4 and t_term is None:
                    if httpx.get(url + "/health").json()["running"] == 3:
                        t_term = time.time()
                        proc.send_signal(signal.SIGTERM)
                    else:
                        assert len(lines) < 200, "the long prompt was never admitted alongside the two answers"
        t_stream_end = time.time()
        asker.join(timeout=30)
        long_asker.join(timeout=30)
        proc.wait(timeout=30)
        t_exit = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert lines[-1] == "[DONE]"
    err = json.loads(lines[-2])["error"]
    assert err["code"] == "server_shutdown" and "shutting down" in err["message"]
    assert all("error" not in json.loads(x) for x in lines[:-2])
    r = waiting["r"]
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    # the long prompt was still being prefilled (4 tokens after it would have been a 200)
    r = waiting["long"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text
    # the stream ended at once, not when the 3 s grace period ran out and uvicorn cut what was left; the
    # process then exits without waiting for the prefill chunk in progress
    assert t_stream_end - t_term < 2.0, t_stream_end - t_term
    assert t_exit - t_stream_end < 1.0 and proc.returncode in (0, -signal.SIGTERM), (t_exit - t_stream_end, proc.returncode)


def test_closing_the_queue_does_not_wait_for_a_long_step_and_its_pages_come_back(bundles):
    """The queue's close (the server's shutdown) returns while the worker is inside a prefill that takes
    seconds; when that step ends, the worker frees the cancelled request's pages and stops."""
    engine = Engine(bundles("llama_tied", "bf16"), device="cpu")
    ex = engine.executor
    in_prefill, real_prefill = threading.Event(), ex.prefill

    def slow_prefill(*args, **kwargs):           # a long prompt's chunk on a CPU
        in_prefill.set()
        time.sleep(2.0)
        return real_prefill(*args, **kwargs)
    ex.prefill = slow_prefill
    queue = FairQueue(engine, Metrics())

    async def submit_then_shut_down() -> float:
        job = queue.submit(list(range(10, 60)), SamplingParams(max_tokens=8, temperature=0.0), None)
        assert await asyncio.to_thread(in_prefill.wait, 30)
        queue.cancel(job)                        # what Service.end_all does to every live job
        t = time.perf_counter()
        queue.close()
        return time.perf_counter() - t
    took = asyncio.run(submit_then_shut_down())
    assert took < 0.5, took
    queue.thread.join(timeout=10)
    assert not queue.thread.is_alive()
    assert engine.blocks.in_use() == 0 and not ex._seqs
