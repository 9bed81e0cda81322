"""README.md's newcomer path, run as written: `make up`, the curl, the openai client, a second request that hits.

The commands are read from README.md's first 60 lines and run unchanged, except that the stack gets free ports
(127.0.0.1:8000 in a command becomes the test's gateway port), the tiny preset and a temporary data dir, all
through `deepinfer up`'s environment variables, so `make up` itself is the README's command.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import free_port, free_ports

ROOT = Path(__file__).resolve().parents[1]
NEWCOMER_LINES = 60


def quick_start_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block within README.md's first 60 lines."""
    head = "\n".join(ROOT.joinpath("README.md").read_text().splitlines()[:NEWCOMER_LINES])
    return [(lang, text) for lang, text in re.findall(r"^```(\w*)\n(.*?)^```", head, re.S | re.M)]


def test_the_newcomers_path_is_in_the_first_60_lines():
    blocks = quick_start_blocks()
    assert [lang for lang, _ in blocks] == ["sh", "sh", "python"], blocks
    assert blocks[0][1].strip() == "make up"
    assert blocks[1][1].strip().startswith("curl ") and "127.0.0.1:8000/v1/chat/completions" in blocks[1][1]
    assert "from openai import OpenAI" in blocks[2][1] and 'base_url="http://127.0.0.1:8000/v1"' in blocks[2][1]


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"make up exited {process.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the gateway was not ready in {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_quick_start_as_written(tmp_path):
    (make_up, _), (curl, _), (client, _) = [(text.strip(), lang) for lang, text in quick_start_blocks()]
    port = free_port()
    env = dict(os.environ, DEEPINFER_UP_PRESET="tiny", DEEPINFER_UP_DATA_DIR=str(tmp_path / "data"),
               DEEPINFER_UP_GATEWAY_PORT=str(port), DEEPINFER_UP_KVSTORE_PORT=str(free_port()),
               DEEPINFER_UP_ENGINE_PORT=str(free_ports(1)), DEEPINFER_UP_REDIS_PORT=str(free_port()))
    local = lambda text: text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")  # noqa: E731
    log = tmp_path / "make_up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(["bash", "-c", make_up], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", up, log)
        said = subprocess.run(["bash", "-c", local(curl)], capture_output=True, text=True, timeout=120)
        assert said.returncode == 0, said.stderr
        answer = json.loads(said.stdout)
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] >= 1

        ran = subprocess.run([sys.executable, "-c", local(client)], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr
        (first_prompt, first_cached), (second_prompt, second_cached) = [
            tuple(map(int, line.split())) for line in ran.stdout.splitlines()]
        assert first_cached == 0  # a fresh stack: nothing cached yet
        assert second_cached > 0 and second_cached % 64 == 0 and second_cached < second_prompt  # the shared prefix
    finally:
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C, as the README says
        up.wait(timeout=120)
    assert "DeepInfer is up" in log.read_text()
