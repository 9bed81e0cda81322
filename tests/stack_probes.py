"""Looking into a running stack from a test: admin stats, metrics, stored blocks, process memory.

Shared by the whole-stack tests (bad input, security, load); each starts its own tiny stack with
`start_tiny_stack` and reads it only through HTTP, Redis and the file system, as an operator would.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import redis

from services.launcher import Stack, StackConfig
from tests.conftest import free_port, free_ports

ADMIN_TOKEN = "test-admin-token"


def start_tiny_stack(data_dir: Path, engines: int = 1, api_keys: str = "key-a:tenant-a,key-b:tenant-b",
                     **flags) -> Stack:
    """`flags`: other StackConfig fields (as `deepinfer up`'s flags), e.g. admit_after=2."""
    replicas = engines + flags.get("prefill_engines", 0) + flags.get("decode_engines", 0)
    cfg = StackConfig(preset="tiny", data_dir=str(data_dir), engines=engines, gateway_port=free_port(),
                      kvstore_port=free_port(), engine_port=free_ports(replicas), redis_port=free_port(),
                      api_keys=api_keys, admin_token=ADMIN_TOKEN, ready_timeout_s=400, **flags)
    return Stack(cfg, quiet=True).start()


class Reply(NamedTuple):
    status: int
    body: bytes
    headers: dict

    def json(self):
        return json.loads(self.body)


def http(method: str, url: str, data: bytes | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> Reply:
    """One real HTTP request; 4xx and 5xx come back as a Reply, not an exception."""
    request = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, response.read(), dict(response.headers))
    except urllib.error.HTTPError as error:
        return Reply(error.code, error.read(), dict(error.headers))


def admin_stats(url: str) -> dict:
    reply = http("GET", url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status == 200, reply
    return reply.json()


def wait_for_saves(stack: Stack, timeout_s: float = 60.0) -> None:
    """Engines save blocks after the response; wait until none has a save pending."""
    deadline = time.monotonic() + timeout_s
    while sum(admin_stats(url)["pending_saves"] for url in stack.engine_urls):
        assert time.monotonic() < deadline, "engine saves still pending"
        time.sleep(0.05)


def wait_until_idle(stack: Stack, timeout_s: float = 30.0) -> None:
    """No generation in flight or waiting on any engine, none in flight in the gateway."""
    deadline = time.monotonic() + timeout_s
    while True:
        engines = [admin_stats(url) for url in stack.engine_urls]
        busy = sum(e["in_flight"] + e["waiting"] for e in engines) + admin_stats(stack.gateway_url)["in_flight"]
        if not busy:
            return
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {engines}"
        time.sleep(0.1)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample from a service's /metrics, e.g. metric(engine, "x_total", 'source="loaded"'),
    read as an operator's scraper does: with the admin token."""
    reply = http("GET", url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert reply.status == 200, reply
    text = reply.body.decode()
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def loaded_tokens(stack: Stack) -> float:
    """Prompt tokens all engines have loaded from the cache instead of prefilling."""
    return sum(metric(url, "deepinfer_engine_prefill_tokens_total", 'source="loaded"')
               for url in stack.engine_urls)


class Stored(NamedTuple):
    files: frozenset[tuple[str, int]]  # (path, size) of every file under the volumes
    keys: frozenset[bytes]             # every key in the prefix index's Redis


def stored(stack: Stack) -> Stored:
    files = set()
    for volume in stack.volumes:
        for root, _, names in os.walk(volume):
            files |= {(os.path.join(root, n), os.path.getsize(os.path.join(root, n))) for n in names}
    client = redis.Redis.from_url(stack.redis_url, password=stack.secrets.redis_password)
    try:
        keys = frozenset(client.scan_iter(count=1000))
    finally:
        client.close()
    return Stored(frozenset(files), keys)


def vm_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
