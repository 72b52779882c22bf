"""A live imp server for the server tests: SmolLM2 compiled once (cpu-only bundle), served by uvicorn in
a background thread on a free port, with an API key. One server per test session, shared by every
module that imports `server` (module-level cache: pytest would otherwise make one per module)."""
from __future__ import annotations

import atexit
import socket
from contextlib import contextmanager
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "test-key-7f3a"
MAX_N = 4
MAX_BODY = 256 * 1024


@dataclass
class LiveServer:
    url: str              # http://127.0.0.1:PORT
    model: str
    bundle: Path
    service: object       # imp_runtime.server.Service, for white-box checks (the engine's tokenizer is not used as an oracle)


_cache: dict[str, LiveServer] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bundle() -> Path:
    from tests.conftest import compiled_smollm2
    return compiled_smollm2("nvfp4")


def start_server() -> LiveServer:
    if "srv" in _cache:
        return _cache["srv"]
    import uvicorn

    from imp_runtime.server import Limits, build_app

    bundle = _bundle()
    app, svc = build_app(bundle, device="cpu", api_key=API_KEY,
                         limits=Limits(max_n=MAX_N, max_body_bytes=MAX_BODY, max_running=8))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=5)
    atexit.register(stop)
    _cache["srv"] = LiveServer(f"http://127.0.0.1:{port}", svc.model, bundle, svc)
    return _cache["srv"]


@pytest.fixture(scope="session")
def server() -> LiveServer:
    return start_server()


@pytest.fixture(scope="session")
def hf_tokenizer(server):
    """The oracle for token counts: transformers' own tokenizer and chat template over the bundle's files."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(server.bundle / "tokenizer.json"))
    tok.chat_template = (server.bundle / "chat_template.jinja").read_text()
    return tok


@contextmanager
def chat_template_swapped(server: LiveServer, source: str):
    """The live engine renders chat prompts with the template `source` (a jinja2 chat template, the bundle's special
    tokens) inside the block, its own again after it, whatever the block raises."""
    from imp_runtime.chat_template import ChatTemplate
    engine = server.service.engine
    own = engine.chat
    engine.chat = ChatTemplate(source, own.special["bos_token"], own.special["eos_token"])
    try:
        yield
    finally:
        engine.chat = own


def chat_prompt_tokens(tok, messages) -> int:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def serve_process(*args: str):
    """`impc serve` of the cpu-only SmolLM2 bundle as a process of its own with extra options: (process, url)."""
    import subprocess
    import sys
    from tests.conftest import compiled_smollm2
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from impc.cli import main; sys.exit(main())",
                             "serve", str(compiled_smollm2("nvfp4")), "--device", "cpu", "--port", str(port),
                             "--log-level", "warning", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc, url: str, limit_s: float = 120) -> None:
    """Until the process's /health answers (its output shown if it exits first)."""
    import httpx
    deadline = time.time() + limit_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.2)
