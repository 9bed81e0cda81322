"""/dashboard in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by selenium)
on a real stack under a short load: the page's numbers are the ones /metrics reports, and its charts
drew the load (requests per second, prompt tokens served from the disk tier).

.ci/run installs the browser (see tests/ci_tools.py): in CI a missing browser fails this test.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.ci_tools import require_tool
from tests.stack_probes import http, metric, start_tiny_stack, wait_for_saves

SYSTEM = "You answer questions about the DeepInfer dashboard, briefly and with numbers. " * 12


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = require_tool("chromium"), require_tool("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1250", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_tiny_stack(tmp_path_factory.mktemp("dashboard"), api_keys="")
    yield running
    running.stop()


def chat(stack, question: str) -> dict:
    import json
    body = json.dumps({"model": "deepseek-chat", "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    reply = http("POST", stack.gateway_url + "/v1/chat/completions", body.encode(),
                 {"Content-Type": "application/json"})
    assert reply.status == 200, reply
    return reply.json()


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def number(driver, element_id: str) -> float:
    return float(text(driver, element_id).replace(",", ""))


def generation_requests(stack) -> float:
    return sum(metric(stack.gateway_url, "gateway_requests_total", f'endpoint="{e}",status="200"')
               for e in ("/v1/chat/completions", "/v1/completions"))


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"after {timeout_s} s: {what}"
        time.sleep(0.2)


def test_the_dashboard_shows_what_metrics_reports_under_load(stack, browser, tmp_path):
    browser.get(f"{stack.gateway_url}/dashboard#token={stack.admin_token}")
    # A first snapshot before any request: every later request falls between two snapshots.
    wait_until(lambda: text(browser, "requests-total") == "0", 30, "the page never showed its first snapshot")
    assert "token" not in browser.current_url  # the fragment is dropped from the address bar once read
    chat(stack, "What does the hit ratio mean?")  # a miss that saves the system prompt's blocks
    wait_for_saves(stack)
    dropped = http("POST", stack.engine_urls[0] + "/admin/memory-tier/drop", b"",
                   {"Authorization": f"Bearer {stack.admin_token}"})
    assert dropped.status == 200, dropped  # the next hit comes from disk, the ones after it from memory
    for i in range(6):
        assert chat(stack, f"Question {i}: what is TTFT?")["usage"]["prompt_cache_hit_tokens"] > 0
    requests = generation_requests(stack)
    hit_tokens = metric(stack.gateway_url, "gateway_prompt_tokens_total", 'cache="hit"')
    assert requests == 7 and hit_tokens > 0
    # No more load: the page's next refresh must show exactly what /metrics says.
    wait_until(lambda: number(browser, "requests-total") == requests, 30,
               f"requests: page {text(browser, 'requests-total')}, /metrics {requests}")
    wait_until(lambda: number(browser, "hit-tokens-total") == hit_tokens, 30,
               f"hit tokens: page {text(browser, 'hit-tokens-total')}, /metrics {hit_tokens}")
    rates = browser.execute_script("return window.dashboardSeries('rates')")
    hits = browser.execute_script("return window.dashboardSeries('hits')")
    assert max(v or 0 for _, v in rates["requests/s"]) > 0
    for tier in ("memory", "disk"):  # each tier's share of prompt tokens was drawn
        assert max(v or 0 for _, v in hits[tier]) > 0, tier
    tiers = {tier: metric(stack.engine_urls[0], "deepinfer_engine_prefix_hit_tokens_total", f'tier="{tier}"')
             for tier in ("memory", "disk")}
    engine_row = [cell.text for cell in browser.find_elements("css selector", "#engines tr.row td")]
    assert engine_row[4] == f"{tiers['memory']:,.0f} / {tiers['disk']:,.0f}" and min(tiers.values()) > 0
    assert text(browser, "redis-health") == "redis ok" and text(browser, "kvstore-health") == "kvstore up"
    assert text(browser, "engines-health") == "engines 1/1 up"
    assert text(browser, "ttft") != "- / -"
    volumes = browser.find_elements("css selector", "#volumes tr.row")
    assert len(volumes) == len(stack.volumes)
    shot = Path(os.environ.get("DEEPINFER_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    assert browser.save_screenshot(str(shot))


def test_the_dashboards_data_needs_the_admin_token(stack):
    assert http("GET", stack.gateway_url + "/admin/dashboard.json").status == 401
    wrong = http("GET", stack.gateway_url + "/admin/dashboard.json", headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    page = http("GET", stack.gateway_url + "/dashboard")
    assert page.status == 200 and b"http://" not in page.body and b"https://" not in page.body  # no CDN
