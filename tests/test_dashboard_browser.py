"""The dashboard in a real browser (issue 18, item 4): headless Chromium, driven by Selenium, loads
GET /dashboard from a running server (the key passed as `?api_key=`) while a background thread
keeps it busy with concurrent generations. The page must keep up with the feed (it takes most of
the snapshots the server numbers, and draws while it updates: counts, not rates, so a busy machine
does not fail it), its live numbers must move and match /get_server_info, its script must log no
error (a CSP violation included), and a screenshot is saved: under the test's tmp_path, and also
as $TEST_OUTPUT_DIR/dashboard.png when that variable is set.

Needs Debian's `chromium` and `chromium-driver` (`make setup-browser`); skipped without them.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.server_helpers import get_json, tiny_model_dir  # noqa: F401 (fixture)
from tests.test_dashboard import AUTH, KEY, dashboard_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
NO_CHROMIUM = "no Chromium: apt-get install chromium chromium-driver (see make setup-browser)"
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=NO_CHROMIUM)]
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1440,1400",
)
PREFIX = "You are a helpful assistant. Answer briefly and cite the operator manual. "


@pytest.fixture
def driver(tmp_path) -> Iterator:
    from selenium import webdriver  # the test extra has it: with Chromium there, its absence is an error

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    drv = webdriver.Chrome(options=options, service=service)
    drv.set_script_timeout(10)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture
def server(request, tiny_model_dir):
    return dashboard_server(request, tiny_model_dir)


def server_state(url: str) -> dict:
    return get_json(url + "/get_server_info", headers=AUTH)["internal_states"][0]


def generate(url: str, i: int) -> None:
    long = "Some context for the question. " * (12 if i % 4 == 0 else 0)  # several prefill chunks
    params = {"max_new_tokens": 32 + 16 * (i % 5), "temperature": 0.0, "ignore_eos": True}
    body = {"text": PREFIX + long + f"Question {i}: " + "why? " * (i % 7), "sampling_params": params}
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {**AUTH, "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def start_load(url: str, requests: int, workers: int) -> threading.Thread:
    """Concurrent generations from a background thread (the test keeps driving the browser)."""

    def run() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda i: generate(url, i), range(requests)))  # re-raises a failure

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def value(drv, element_id: str) -> float:
    """A live number as the page holds it (`data-value`; the text is formatted for people)."""
    return float(drv.find_element("id", element_id).get_attribute("data-value"))


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def counts(drv) -> tuple[int, int, int]:
    """The page's snapshots taken, the server's number of the latest one, and draws made."""
    el = drv.find_element("id", "updates")
    return tuple(int(el.get_attribute(a) or 0) for a in ("data-value", "data-seq", "data-draws"))


def test_dashboard_in_chromium(server, driver, tmp_path):
    url = server.url
    driver.get(f"{url}/dashboard?api_key={KEY}")
    wait_for(lambda: "live" in driver.find_element("id", "conn").get_attribute("class"), 60, "the feed to connect")
    wait_for(lambda: value(driver, "updates") > 0, 60, "the first update")
    assert value(driver, "total-tokens") == server_state(url)["total_tokens"]
    start_gen = value(driver, "generated-tokens")

    load = start_load(url, requests=160, workers=12)  # about 5 s of work for the tiny model
    wait_for(lambda: value(driver, "running") > 0, 60, "running requests on the page")
    (u0, seq0, d0), samples, seen_rate = counts(driver), [], 0.0

    def sample() -> bool:
        nonlocal seen_rate
        samples.append((value(driver, "updates"), value(driver, "generated-tokens")))
        seen_rate = max(seen_rate, value(driver, "tokens-per-s"))
        return samples[-1][0] >= u0 + 20

    wait_for(sample, 60, "20 updates under load")
    u1, seq1, d1 = counts(driver)
    screenshot(driver, tmp_path)  # under load: the plots and the timeline have something to show
    load.join(timeout=240)
    assert not load.is_alive(), "the load did not finish"

    # Keeping up: a page too slow for the feed sees its frames replaced (seq jumps), and one whose
    # updates hog its thread stops drawing; draws coalesce to one per animation frame, so fewer.
    assert u1 - u0 >= (seq1 - seq0) // 2, (u0, u1, seq0, seq1)
    assert d1 - d0 >= (u1 - u0) // 3, (d0, d1, u0, u1)
    assert samples[-1][0] > samples[0][0] and samples[-1][1] > samples[0][1], samples  # live numbers move
    assert seen_rate > 0

    # Idle: the first snapshot taken after /get_server_info answered shows exactly its numbers.
    wait_for(lambda: server_state(url)["running_requests"] == 0, 60, "the server to go idle")
    state = server_state(url)
    seen = value(driver, "updates")
    wait_for(lambda: value(driver, "updates") >= seen + 2, 30, "the next update")  # +1 may predate the read
    expected = {
        "generated-tokens": state["generated_tokens"],
        "retractions": state["num_retractions"],
        "total-tokens": state["total_tokens"],
        "max-running": state["max_running_requests"],
        "cache-hit-rate": state["cache_hit_rate"],
        "running": 0,
        "waiting": 0,
    }
    assert {k: value(driver, k) for k in expected} == expected
    assert driver.find_element("id", "spec-accept").text == "off"  # no --speculative-algorithm
    assert state["generated_tokens"] > start_gen
    assert len(driver.find_elements("css selector", "#radix tbody td.text")) >= 1  # the radix table is filled
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def screenshot(drv, tmp_path: Path) -> Path:
    path = tmp_path / "dashboard.png"
    assert drv.save_screenshot(str(path)), "no screenshot"
    if out := os.environ.get("TEST_OUTPUT_DIR"):
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / "dashboard.png")
    print(f"dashboard screenshot: {path}")
    return path
