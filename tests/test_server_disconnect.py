"""Clients that leave at any moment: mid-body, right after sending, after the first event, mid-stream,
or while waiting for a non-streamed answer, with a clean close or a reset, on every generating endpoint.
Each time the server stays healthy and, once it notices, nothing is left running: no slot, no queue
entry, no KV page, and the generation stopped well short of its budget."""
from __future__ import annotations

import json
import socket
import struct
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.conftest_server import API_KEY, server  # noqa: F401
from tests.test_server_ops import metrics, value

BUDGET = 300                     # tokens each request may generate: far more than a cut-short one gets
LONG = "Write a long story about a dragon who learns to sing."
ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": BUDGET}),
    "completions": ("/v1/completions", {"prompt": "Once upon a time, in a land far away,", "max_tokens": BUDGET}),
    "responses": ("/v1/responses", {"input": LONG, "max_output_tokens": BUDGET}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": LONG}], "max_tokens": BUDGET}),
}
# (name, streamed, SSE events to read before leaving; None: leave before the body is complete)
MOMENTS = [("mid-body", True, None), ("after-request", True, 0), ("after-first-event", True, 1),
           ("mid-stream", True, 6), ("waiting-for-answer", False, 0)]


def request_bytes(server, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    host = urlparse(server.url).netloc
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nx-api-key: {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode() + data


def leave(server, path: str, body: dict, events: int | None, reset: bool) -> None:
    """Send the request over a raw socket, read `events` SSE events, and drop the connection."""
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    raw = request_bytes(server, path, body)
    try:
        if events is None:
            sock.sendall(raw[:len(raw) - 10])          # the body is never finished
            time.sleep(0.2)
        else:
            sock.sendall(raw)
            seen, buf = 0, b""
            while seen < events:
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the stream after {seen} events: {buf[-300:]!r}"
                buf += chunk
                assert buf.startswith(b"HTTP/1.1 200"), buf[:300]
                seen = buf.count(b"\n\n") - 1                 # the first blank line ends the headers
            if events == 0:
                time.sleep(0.3)                               # the request is being served by now
    finally:
        if reset:        # an abrupt reset (RST), as a crashed client or a dropped network gives
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def settled(server, timeout: float = 20.0) -> dict:
    """Waits for the server to have nothing running, queued or held; returns the metrics then."""
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        busy = [value(m, n) for n in ("imp_running_requests", "imp_queue_depth", "imp_kv_pages_in_use")]
        if busy == [0, 0, 0]:
            return m
        if time.time() > deadline:
            pytest.fail(f"still running after the client left: running, queued, KV pages = {busy}")
        time.sleep(0.1)


@pytest.mark.parametrize("moment,stream,events", MOMENTS, ids=[m[0] for m in MOMENTS])
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_client_leaves(server, endpoint, moment, stream, events):
    path, body = ENDPOINTS[endpoint]
    before = settled(server)
    leave(server, path, {**body, "temperature": 0, "stream": stream}, events, reset=(moment == "mid-stream"))
    after = settled(server)
    generated = value(after, "imp_generation_tokens_total") - value(before, "imp_generation_tokens_total")
    assert generated < BUDGET // 2, f"{generated} tokens generated for a client that had left"
    if events is not None:        # the job had started: its cancellation is counted
        cancelled = value(after, "imp_cancelled_requests_total") - value(before, "imp_cancelled_requests_total")
        assert cancelled == 1
    executor = server.service.engine.executor
    assert len(getattr(executor, "_seqs", {})) == 0
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
