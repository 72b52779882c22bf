"""`impc serve` options, on a server process of their own:
- `--served-model-name`: the names a server answers to (vLLM's option), '*' for any name (llama.cpp's server's
  behaviour, which agent stacks sending their own model names need). The default, the bundle's name only, is
  tests/test_server_errors.py's `model-unknown` case and tests/test_server_openai.py's model list;
- `--allowed-origins`: CORS for browser pages of other origins (none by default: tests/test_server_tokenize.py)."""
from __future__ import annotations


import httpx
import pytest

from imp_runtime.server.service import ModelNames
from tests.conftest_server import serve_process as serve, wait_up


def test_model_names_of_the_option():
    assert ModelNames.of((), "bundle") == ModelNames(("bundle",), False)
    named = ModelNames.of(("local", "gpt-4o-mini", "local"), "bundle")
    assert named == ModelNames(("local", "gpt-4o-mini"), False)
    assert named.serves("gpt-4o-mini") and named.serves("local")
    assert not named.serves("bundle") and not named.serves("claude-sonnet-4-5")
    anyname = ModelNames.of(("*",), "bundle")
    assert anyname.names == ("bundle",) and anyname.serves("claude-sonnet-4-5") and anyname.serves("")


def test_served_names_any_name_and_allowed_origins():
    proc, url = serve("--served-model-name", "local", "gpt-4o-mini", "*", "--allowed-origins", "https://app.example",
                      "--reasoning-parser", "none")
    try:
        wait_up(proc, url)
        ask = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        pre = httpx.options(url + "/v1/chat/completions", headers=ask, timeout=10)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        other = httpx.options(url + "/v1/chat/completions", headers={**ask, "Origin": "https://evil.example"},
                              timeout=10)
        assert other.headers.get("access-control-allow-origin") is None
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["local", "gpt-4o-mini"]
        assert httpx.get(url + "/health").json()["model"] == "local"
        assert httpx.get(url + "/v1/models/claude-sonnet-4-5").json()["id"] == "claude-sonnet-4-5"
        r = httpx.post(url + "/v1/messages", timeout=60, json={
            "model": "claude-sonnet-4-5", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "local"
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "gpt-4o-mini", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "local"
        r = httpx.post(url + "/tokenize", json={"prompt": "Hi"}, headers={"Origin": "https://app.example"}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("args", [["--served-model-name", ""], ["--served-model-name", " "]])
def test_empty_names_are_refused(args):
    proc, _ = serve(*args)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--served-model-name: give non-empty names" in out and "Traceback" not in out
