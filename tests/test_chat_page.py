"""The chat page at / in headless Chromium (Debian's chromium + chromedriver, driven by selenium): it
loads, sends a message, shows the answer growing token by token, and plots inter-token latency."""
from __future__ import annotations

import shutil
import tempfile
import time

import httpx
import pytest

from tests.conftest_server import API_KEY, server  # noqa: F401

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="imp-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def test_chat_page_streams_and_plots(browser, server):
    from selenium.webdriver.common.by import By

    question = "What is the capital of France?"
    browser.get(server.url + "/")
    assert "imp" in browser.title
    for field, value in (("key", API_KEY), ("max", "12"), ("temp", "0")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "input").send_keys(question)
    browser.find_element(By.ID, "send").click()

    lengths, deadline = [], time.time() + 120
    get_answer = "const a = document.querySelectorAll('.msg.assistant, .msg.error'); " \
                 "return a.length ? [a[a.length - 1].className, a[a.length - 1].textContent] : null;"
    while time.time() < deadline:
        state = browser.execute_script(get_answer)
        if state:
            assert "error" not in state[0], state[1]
            if state[1] and (not lengths or lengths[-1] != len(state[1])):
                lengths.append(len(state[1]))
        if state and state[1] and browser.find_element(By.ID, "send").is_enabled():
            break
        time.sleep(0.03)
    else:
        pytest.fail("the page never finished answering")
    answer = browser.execute_script(get_answer)[1]

    # the same request, not streamed, from the API: the page showed exactly its text
    ref = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": API_KEY}, timeout=120, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}).json()
    assert answer == ref["choices"][0]["message"]["content"]
    assert len(lengths) >= 3, f"the answer did not grow token by token: {lengths}"

    points = int(browser.find_element(By.ID, "plot").get_attribute("data-points"))
    assert points >= 2                   # one latency per token after the first
    blue = browser.execute_script("""
        const c = document.getElementById('plot'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 150 && d[i] < 110 && d[i + 3] > 0) n++;
        return n;""")
    assert blue > 50, "no latency line drawn"
    assert "tok/s" in browser.find_element(By.ID, "stats").text


def test_chat_page_stop_drops_the_connection(browser, server):
    """Stop mid-answer: the page keeps the partial answer, marked, and is ready again; the server sees the
    connection close, cancels the generation and frees its KV."""
    from selenium.webdriver.common.by import By

    from tests.test_server_ops import value, wait_idle

    before = wait_idle(server)
    browser.get(server.url + "/")
    for field, value_ in (("key", API_KEY), ("max", "400"), ("temp", "0")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value_)
    browser.find_element(By.ID, "input").send_keys("Write a long story about a dragon.")
    browser.find_element(By.ID, "send").click()
    text = "return document.querySelector('.msg.assistant:last-child, .msg.error:last-child').textContent;"
    deadline = time.time() + 120
    while len(browser.execute_script(text) or "") < 20:
        assert time.time() < deadline, "no answer arrived"
        time.sleep(0.05)
    browser.find_element(By.ID, "stop").click()
    deadline = time.time() + 10
    while not browser.find_element(By.ID, "send").is_enabled():
        assert time.time() < deadline, "the page did not recover after Stop"
        time.sleep(0.05)
    shown = browser.execute_script(text)
    assert shown.endswith("[stopped]") and not shown.startswith("error"), shown
    assert not browser.find_element(By.ID, "stop").is_enabled()
    after = wait_idle(server)
    assert value(after, "imp_kv_pages_in_use") == 0
    assert value(after, "imp_cancelled_requests_total") - value(before, "imp_cancelled_requests_total") == 1
    generated = value(after, "imp_generation_tokens_total") - value(before, "imp_generation_tokens_total")
    assert generated < 200, f"{generated} tokens generated after the page stopped"
