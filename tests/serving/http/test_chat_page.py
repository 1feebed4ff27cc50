"""The chat page at `/` (serving/http/chat.html) as a person uses it, in headless Chromium
driven by selenium (Debian's chromium and chromium-driver; `make test` installs them when
missing): type a message and press Enter, watch the answer stream in, read the model, TTFT and
tokens/s under it; then a server error (the model warming up: 503) and the request-rate limit
(429) shown as plain messages.  On failure the test saves a screenshot and names it."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.serving.fake_engine import FakeEngine, expected_output
from xlaserve.serving.server_config import ServedModel, ServerConfig, TierLimits

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs Debian's chromium and chromium-driver "
                                       "(`make browser` installs them)")
TOKEN_DELAY = 0.12   # the fake engine's seconds per token: slow enough to watch it stream


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1000,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@contextlib.contextmanager
def screenshot_on_failure(driver, path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        driver.get_screenshot_as_file(str(path))
        print(f"screenshot of the failing page: {path}")
        raise


def wait_until(cond: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not true after {timeout} s: {cond}")


def text_of(driver, css: str) -> list[str]:
    """Exact textContent of every element matching `css` (Selenium's .text folds spaces)."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)", css)


def say(driver, message: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "input")
    box.send_keys(message)
    box.send_keys(Keys.ENTER)


def test_chat_page_streams_an_answer_and_explains_errors(make_server, tokenizer, browser,
                                                         tmp_path):
    config = ServerConfig(models=(ServedModel("fake"),),
                          limits={"internal": TierLimits(requests_per_minute=2)})
    engine = FakeEngine(tokenizer, "fake", token_delay=TOKEN_DELAY)
    srv = make_server(config, {"fake@1": [engine]})
    message = "Tell me about lighthouses."
    answer, _, tokens = expected_output(
        tokenizer, tokenizer.encode_chat([{"role": "user", "content": message}]), 480)
    assert tokens >= 2 and answer

    with screenshot_on_failure(browser, tmp_path / "chat-page.png"):
        browser.get(srv.url + "/")
        wait_until(lambda: browser.execute_script(
            "return document.getElementById('model').value") == "fake")
        sent = time.monotonic()
        say(browser, message)
        seen = []          # (seconds since sent, the assistant bubble's text) at every poll
        def done() -> bool:
            seen.append((time.monotonic() - sent,
                         (text_of(browser, "#log .assistant") or [""])[0]))
            return seen[-1][1] == answer
        wait_until(done, 15)
        first_seen = next(t for t, text in seen if text)
        all_seen = seen[-1][0]
        seen = [text for _, text in seen]
        partial = {t for t in seen if t and t != answer}
        assert partial and all(answer.startswith(t) for t in partial), seen
        assert text_of(browser, "#log .user") == [message]
        stats = wait_until(lambda: "tokens/s" in text_of(browser, "#stats")[0]
                           and text_of(browser, "#stats")[0])
        assert "model fake" in stats and "TTFT" in stats and f"{tokens} tokens" in stats, stats
        ttft_ms = float(stats.split("TTFT ")[1].split(" ms")[0])
        rate = float(stats.split(" tokens/s")[0].rsplit(" ", 1)[1])
        # The page's own clock against the test's: no figure of a loaded machine is asserted,
        # only that the page's TTFT lies between the engine's first delay and the moment the
        # test saw the first text, and its rate is at least what the test's whole wait gives
        # (no upper bound: a loaded box delivers chunks the engine spaced out in bunches).
        assert TOKEN_DELAY * 1e3 <= ttft_ms <= first_seen * 1e3, (stats, first_seen)
        assert (tokens - 1) / all_seen <= rate < float("inf"), stats

        engine.ready = False               # the server's error, said plainly
        say(browser, "Are you there?")
        error = wait_until(lambda: text_of(browser, "#log .error"))
        assert error == ["Error 503: model 'fake@1' is still warming up"], error
        engine.ready = True

        say(browser, "And now?")           # the third request this minute: 429
        busy = wait_until(lambda: len(text_of(browser, "#log .error")) == 2
                          and text_of(browser, "#log .error")[1])
        assert busy.startswith("The server is busy (429): ") and "Try again in" in busy, busy
