"""`python -m services.gateway` as a real process: starts, answers, stops cleanly on SIGTERM."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp

from tests.conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def wait_healthy(base: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert process.poll() is None, process.stdout.read()
            try:
                async with session.get(base + "/healthz") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("gateway did not become healthy")


async def test_process_serves_and_drains_on_sigterm():
    port, engine_port = free_port(), free_port()
    env = {**os.environ, "DEEPINFER_GATEWAY_API_KEYS": "sk-1:acme",
           "DEEPINFER_GATEWAY_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", str(port),
         "--engine", f"http://127.0.0.1:{engine_port}", "--engine-connect-timeout-s", "0.5"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, process)
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-1"}) as session:
            async with session.post(base + "/v1/chat/completions", json={
                    "model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}
                    ) as response:
                assert response.status == 503
                assert (await response.json())["error"]["type"] == "service_unavailable_error"
            async with session.get(base + "/readyz") as response:
                body = await response.json()
                # Neither the engine nor Redis is up: not ready, and the index is reported down.
                assert response.status == 503 and body["prefix_index"] is False
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
