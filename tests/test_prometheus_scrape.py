"""Debian's `prometheus` scrapes a real stack with the scrape config the project ships
(deploy/prometheus.yml) and answers a query about each service; every query of the Grafana dashboard
(deploy/grafana/deepinfer.json) is valid PromQL on it.

The shipped config finds services by their compose names (gateway:8000, DNS for the engine
replicas); here only those discovery blocks are replaced by this stack's addresses. Job names,
paths, intervals and everything else are the shipped file's.
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.ci_tools import require_tool
from tests.conftest import free_port
from tests.stack_probes import http, start_tiny_stack, wait_for_saves

ROOT = Path(__file__).resolve().parents[1]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus.yml"
GRAFANA_DASHBOARD = ROOT / "deploy" / "grafana" / "deepinfer.json"
PROMPT = "Prometheus scrapes every DeepInfer service, and Grafana draws what it stored. " * 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_tiny_stack(tmp_path_factory.mktemp("prometheus-stack"), api_keys="")
    yield running
    running.stop()


def address(url: str) -> str:
    return urlsplit(url).netloc


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = require_tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    targets = {"deepinfer-gateway": [address(stack.gateway_url)], "deepinfer-kvstore": [address(stack.kvstore_url)],
               "deepinfer-engine": [address(url) for url in stack.engine_urls]}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    for job in config["scrape_configs"]:
        for discovery in [key for key in job if key.endswith("_sd_configs") or key == "static_configs"]:
            del job[discovery]
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        assert job["authorization"]["credentials_file"] == "/run/secrets/admin_token"  # compose's secret
        job["authorization"]["credentials_file"] = str(work / "admin_token")
    (work / "admin_token").write_text(stack.admin_token)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _ready(url):
        assert process.poll() is None, (work / "prometheus.log").read_text()
        assert time.monotonic() < deadline, "prometheus did not become ready"
        time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(30)


def _ready(url: str) -> bool:
    try:
        return http("GET", url + "/-/ready", timeout=2).status == 200
    except OSError:  # not listening yet
        return False


def query(prometheus: str, promql: str) -> dict:
    reply = http("GET", prometheus + "/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    body = reply.json()
    assert reply.status == 200 and body["status"] == "success", (promql, body)
    return body["data"]


def scalar(prometheus: str, promql: str) -> float | None:
    result = query(prometheus, promql)["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(prometheus: str, promql: str, expected: float, timeout_s: float = 90.0) -> None:
    """The stack's counters no longer move; wait until a scrape has brought `expected` in."""
    deadline = time.monotonic() + timeout_s
    while (value := scalar(prometheus, promql)) != expected:
        assert time.monotonic() < deadline, f"{promql} = {value}, expected {expected}"
        time.sleep(0.5)


def chat(stack) -> dict:
    body = json.dumps({"model": "deepseek-chat", "max_tokens": 5, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    reply = http("POST", stack.gateway_url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert reply.status == 200, reply
    return reply.json()


def test_the_shipped_scrape_config_is_valid_as_shipped(tmp_path):
    """promtool checks that the token file exists: here the compose secret's path becomes a local file."""
    shipped = SCRAPE_CONFIG.read_text()
    assert shipped.count("credentials_file: /run/secrets/admin_token") == 3
    (tmp_path / "admin_token").write_text("a token")
    (tmp_path / "prometheus.yml").write_text(shipped.replace("/run/secrets/admin_token", str(tmp_path / "admin_token")))
    checked = subprocess.run([require_tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_prometheus_reads_one_metric_of_each_service_back(stack, prometheus):
    first, second = chat(stack), chat(stack)
    wait_for_saves(stack)
    assert second["usage"]["prompt_cache_hit_tokens"] > 0
    completion = first["usage"]["completion_tokens"] + second["usage"]["completion_tokens"]
    for job in ("deepinfer-gateway", "deepinfer-kvstore", "deepinfer-engine"):
        wait_for(prometheus, f'sum(up{{job="{job}"}})', 1.0)
    wait_for(prometheus, 'sum(gateway_requests_total{job="deepinfer-gateway",endpoint="/v1/chat/completions"})', 2.0)
    wait_for(prometheus, 'sum(deepinfer_engine_generated_tokens_total{job="deepinfer-engine"})', float(completion))
    wait_for(prometheus, 'count(kvstore_volume_used_bytes{job="deepinfer-kvstore"})', float(len(stack.volumes)))
    wait_for(prometheus, 'gateway_prefix_index_up{job="deepinfer-gateway"}', 1.0)


def test_every_grafana_query_is_valid_promql_on_this_prometheus(prometheus):
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        query(prometheus, expr)  # a parse or evaluation error fails here
    assert all(panel["datasource"]["uid"] == "deepinfer-prometheus" for panel in dashboard["panels"])
