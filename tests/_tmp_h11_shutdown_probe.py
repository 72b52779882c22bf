"""`impc serve` stopped with SIGTERM while generating: a stream ends with the dialect's error event and
`[DONE]` (a complete response, not a cut connection), a request waiting for a whole answer gets a 503 in
its dialect, and the process exits well within uvicorn's grace period."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import compiled_smollm2
from tests.conftest_server import _free_port

LONG = [{"role": "user", "content": "Write a long story about a dragon."}]


def test_sigterm_ends_generations_cleanly():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from impc.cli import main; sys.exit(main())",
                             "serve", str(compiled_smollm2("nvfp4")), "--device", "cpu", "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.2)

        waiting: dict = {}

        def ask_whole_answer():
            waiting["r"] = httpx.post(url + "/v1/messages", timeout=60, json={
                "messages": LONG, "max_tokens": 400, "temperature": 0})
        asker = threading.Thread(target=ask_whole_answer)
        asker.start()

        lines, t_term = [], None
        body = {"messages": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():     # raises if the connection is cut before the body is complete
                if line.startswith("data: "):
                    lines.append(line[6:])
                if len(lines) == 4 and t_term is None:
                    assert httpx.get(url + "/health").json()["running"] == 2
                    t_term = time.time()
                    proc.send_signal(signal.SIGTERM)
        t_stream_end = time.time()
        asker.join(timeout=30)
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
    # the stream ended at once, not when the 3 s grace period ran out and uvicorn cut what was left; the
    # process then stops its generation worker and exits
    print("TIMES", t_stream_end - t_term, t_exit - t_term, proc.returncode)
    assert t_exit - t_term < 10.0 and proc.returncode in (0, -signal.SIGTERM), (t_exit - t_term, proc.returncode)
