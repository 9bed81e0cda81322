"""A stack started with `deepinfer up --detach` (tiny preset, remote-cache mode, JSON logs), looked at and
stopped the way an operator does: `deepinfer status`, request ids in every service's log, a second
`up` that must refuse, `deepinfer stop`. Real CLI processes and real HTTP; the tests run in file order
and the last one stops the stack.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from services.run_file import RunFile, pid_alive
from tests.stack_probes import http
from tests.test_operator_start import deepinfer, flag_value, port_flags, port_is_free, refused

# > 2 blocks of 64 tokens, so the first request saves blocks through the kvstore and the second reads them.
PROMPT = "The operator reads the dashboard before the pager rings. " * 30


@pytest.fixture(scope="module")
def detached(tmp_path_factory):
    data = tmp_path_factory.mktemp("detached")
    args = ["--preset", "tiny", "--data-dir", str(data), "--remote-cache", "--log-format", "json", *port_flags()]
    result = deepinfer("up", "--detach", *args, timeout_s=600)
    assert result.returncode == 0, result.stdout + result.stderr
    yield data, args, result.stdout
    if RunFile.read(data) is not None:
        deepinfer("stop", "--data-dir", str(data))


def chat(gateway: str, request_id: str | None) -> tuple[int, dict, dict]:
    body = json.dumps({"model": "deepseek-chat", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    headers = {"Content-Type": "application/json"} | ({"X-Request-Id": request_id} if request_id else {})
    reply = http("POST", gateway + "/v1/chat/completions", body, headers)
    return reply.status, reply.headers, reply.json()


def log_lines(data: Path, service: str) -> list[dict]:
    lines = (data / "logs" / f"{service}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def wait_saved(run: RunFile) -> None:
    import time
    deadline = time.monotonic() + 60
    def pending() -> int:
        reply = http("GET", run.services["engine0"].url + "/admin/stats",
                     headers={"Authorization": f"Bearer {run.admin_token}"})
        assert reply.status == 200, reply
        return reply.json()["pending_saves"]

    while pending():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_detached_up_returns_once_ready_with_a_private_run_file(detached):
    data, args, said = detached
    assert "DeepInfer is up: http://127.0.0.1:" in said and f"deepinfer stop --data-dir {data}" in said
    run = RunFile.read(data)
    assert run is not None and pid_alive(run.launcher_pid)
    assert stat.S_IMODE(os.stat(RunFile.path(data)).st_mode) == 0o600
    assert set(run.services) == {"valkey", "kvstore", "engine0", "gateway"}
    assert all(run.is_ours(name) for name in run.services)
    assert run.services["gateway"].url == f"http://127.0.0.1:{flag_value(args, '--gateway-port')}"


def test_a_second_up_on_a_running_stacks_ports_refuses_and_says_no_ready(detached, tmp_path):
    data, args, _ = detached
    ports = [a for a in args if a.startswith("--") and a.endswith("-port")]
    problems = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path), *args[args.index(ports[0]):]))
    assert len(problems) == 4 and all(" is in use (another DeepInfer? see deepinfer status)" in p for p in problems)
    assert [p.split("choose one with ")[1].split(",")[0] for p in problems] == ports
    same_dir = refused(deepinfer("up", *args))
    assert same_dir[0].startswith(f"a DeepInfer stack from data dir {data} is running")


def test_a_request_id_travels_gateway_engine_kvstore_and_comes_back(detached):
    data, _, _ = detached
    run = RunFile.read(data)
    gateway = run.services["gateway"].url
    status, headers, first = chat(gateway, "ops-test-save-1")
    assert status == 200 and headers["X-Request-Id"] == "ops-test-save-1"
    wait_saved(run)
    dropped = http("POST", run.services["engine0"].url + "/admin/memory-tier/drop", b"",
                   {"Authorization": f"Bearer {run.admin_token}"})
    assert dropped.status == 200, dropped  # so the next hit is read from disk, through the kvstore service
    status, headers, second = chat(gateway, "ops-test-hit-2")
    assert status == 200 and headers["X-Request-Id"] == "ops-test-hit-2"
    assert second["usage"]["prompt_cache_hit_tokens"] > 0
    for service in ("gateway", "engine0", "kvstore"):
        ids = {line["request_id"] for line in log_lines(data, service)}
        assert {"ops-test-save-1", "ops-test-hit-2"} <= ids, (service, ids)
    kvstore = log_lines(data, "kvstore")
    assert any(line["message"].startswith("saved ") for line in kvstore if line["request_id"] == "ops-test-save-1")
    assert any(line["message"].startswith("reading a hit") for line in kvstore if line["request_id"] == "ops-test-hit-2")
    _, generated, _ = chat(gateway, None)
    _, replaced, _ = chat(gateway, "two words")  # not a token: the gateway makes its own
    for made in (generated["X-Request-Id"], replaced["X-Request-Id"]):
        assert len(made) == 32 and int(made, 16) >= 0


def test_status_names_each_process_and_the_numbers(detached):
    data, _, _ = detached
    result = deepinfer("status", "--data-dir", str(data))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    run = RunFile.read(data)
    for name in ("gateway", "kvstore", "engine0"):
        line = next(line for line in lines if line.strip().startswith(name + " "))
        assert f"pid {run.services[name].pid}" in line and line.endswith(" ready"), line
    assert any(line.strip().startswith("valkey") and line.endswith(" running") for line in lines)
    requests = next(line for line in lines if line.startswith("requests"))
    assert int(requests.split()[1]) >= 4  # the four chat requests above
    assert any(line.startswith("tokens") and "from the cache" in line for line in lines)


def test_stop_stops_every_process_and_frees_every_port(detached):
    data, args, _ = detached
    run = RunFile.read(data)
    result = deepinfer("stop", "--data-dir", str(data))
    assert result.returncode == 0, result.stdout + result.stderr
    assert not pid_alive(run.launcher_pid)
    assert not any(pid_alive(record.pid) for record in run.services.values())
    assert all(port_is_free(flag_value(args, f)) for f in ("--gateway-port", "--kvstore-port", "--engine-port",
                                                           "--redis-port"))
    assert not RunFile.path(data).exists()
    assert deepinfer("status", "--data-dir", str(data)).returncode == 3
