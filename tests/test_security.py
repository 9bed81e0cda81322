"""Security of the real stack: admin endpoints need the admin token, every service binds loopback by
default and listens nowhere else, and one tenant can never observe another tenant's cache: not in
usage, not in what the engine loads, not in time to first token."""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
import urllib.request

import numpy as np
import pytest

from services.engine.app import build_app
from services.engine.config import EngineConfig
from services.gateway.app import create_app as create_gateway_app
from services.gateway.config import GatewayConfig
from services.gateway.tenants import tenant_salt
from services.kvstore.app import create_app as create_kvstore_app
from services.kvstore.config import KvstoreConfig
from services.launcher import StackConfig
from tests.stack_probes import (ADMIN_TOKEN, http, loaded_tokens, metric, start_tiny_stack, stored,
                                wait_for_saves)

B = 64
PROMPT_TOKENS = 2048  # long enough that a hit (a few blocks of latents) is clearly faster than a miss
ROUNDS = 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_tiny_stack(tmp_path_factory.mktemp("security"))
    yield running
    running.stop()


def _admin_routes(app) -> list[tuple[str, str]]:
    return sorted({(route.method, route.resource.canonical) for route in app.router.routes()
                   if route.resource is not None and route.resource.canonical.startswith("/admin/")
                   and route.method != "HEAD"})


def _service_admin_routes(stack) -> dict[str, list[tuple[str, str]]]:
    """Every /admin/ route each service registers, read from the apps the processes run."""
    kvstore = KvstoreConfig(fingerprint="f", num_layers=1, volumes=["unused"])
    return {stack.gateway_url: _admin_routes(create_gateway_app(GatewayConfig())),
            stack.kvstore_url: _admin_routes(create_kvstore_app(kvstore)),
            stack.engine_urls[0]: _admin_routes(build_app(EngineConfig()))}


def test_every_admin_endpoint_refuses_missing_or_wrong_tokens(stack):
    routes = _service_admin_routes(stack)
    assert all(routes.values()), routes
    assert ("POST", "/admin/evict") in routes[stack.kvstore_url]
    wait_for_saves(stack)
    chat = {"model": "deepseek-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "x " * 200}]}
    assert http("POST", stack.gateway_url + "/v1/chat/completions", json.dumps(chat).encode(),
                {"Authorization": "Bearer key-a", "Content-Type": "application/json"}).status == 200
    wait_for_saves(stack)
    before = stored(stack)
    assert before.files, "something to evict, so that a refused evict is visible"
    refused = [None, "Bearer", "Bearer ", "Bearer wrong-token", f"Bearer {ADMIN_TOKEN}x",
               f"Bearer {ADMIN_TOKEN[:-1]}", f"Basic {ADMIN_TOKEN}", ADMIN_TOKEN, "Bearer key-a",
               f"Bearer {ADMIN_TOKEN.upper()}"]
    for url, service_routes in routes.items():
        for method, path in service_routes:
            body = b'{"all": true}' if method == "POST" else None
            for authorization in refused:
                headers = {"Content-Type": "application/json"}
                if authorization is not None:
                    headers["Authorization"] = authorization
                reply = http(method, url + path, body, headers)
                assert reply.status in (401, 403), (url, method, path, authorization, reply)
            if method == "GET":  # and the right token opens it
                reply = http(method, url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                assert reply.status == 200, (url, path, reply)
    assert stored(stack) == before  # the refused evict and sweep did nothing


def test_services_bind_loopback_by_default():
    assert StackConfig().host == "127.0.0.1"
    assert GatewayConfig().host == "127.0.0.1"
    assert EngineConfig().host == "127.0.0.1"
    assert KvstoreConfig(fingerprint="f", num_layers=1, volumes=["v"]).host == "127.0.0.1"


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_running_processes_listen_only_on_loopback(stack):
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    valkey = getattr(stack.valkey, "_process", None)
    if valkey is not None:
        pids["valkey"] = valkey.pid
    for name, pid in pids.items():
        sockets = _listening(pid)
        assert sockets, f"{name} listens nowhere?"
        assert all(address == "127.0.0.1" for address, _ in sockets), (name, sockets)


# -- tenants --

def _ttft(stack, key: str, tokens: list[int], extra: dict | None = None) -> tuple[float, int]:
    """Seconds to the first streamed token of a /v1/completions request, and its cache-hit tokens."""
    body = {"model": "deepseek-chat", "prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}} | (extra or {})
    request = urllib.request.Request(stack.gateway_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.readline()  # the gateway answers once the engine has the first token
        first = time.monotonic() - start
        events = [line[len(b"data: "):] for line in response.read().split(b"\n\n") if line]
    usage = [json.loads(e)["usage"] for e in events if e.startswith(b"{") and json.loads(e).get("usage")]
    return first, usage[-1]["prompt_cache_hit_tokens"]


def test_one_tenant_never_observes_anothers_cache(stack):
    """Tenant B sends exactly the prompts tenant A has cached. B's requests must be misses in every
    way that matters: usage says 0 hit tokens, the index lookup found nothing, the engine loaded no
    token (the mechanism), and B's time to first token is that of a fresh miss (the side channel).
    A's own repeats, measured in between, show that the test would see a hit."""
    rng = np.random.default_rng(6)
    prompt = lambda: rng.integers(100, 100_000, PROMPT_TOKENS).tolist()
    a_prompts, fresh_prompts = [prompt() for _ in range(ROUNDS)], [prompt() for _ in range(ROUNDS)]
    warm = prompt()
    for key in ("key-a", "key-a", "key-b"):  # compile the miss and the hit shapes before timing
        _ttft(stack, key, warm)
        wait_for_saves(stack)
    for tokens in a_prompts:
        assert _ttft(stack, "key-a", tokens)[1] == 0
    wait_for_saves(stack)
    full_hit = (PROMPT_TOKENS - 1) // B * B
    times: dict[str, list[float]] = {"fresh miss": [], "B on A's prompt": [], "A's hit": []}
    seen: dict[str, list[tuple[int, float, float]]] = {kind: [] for kind in times}  # (usage, loaded, found)
    for i in range(ROUNDS):  # interleaved, so that a slow spell of the machine hits every kind
        for kind, key, tokens in (("fresh miss", "key-b", fresh_prompts[i]),
                                  ("B on A's prompt", "key-b", a_prompts[i]),
                                  ("A's hit", "key-a", a_prompts[i])):
            wait_for_saves(stack)
            loaded, found = loaded_tokens(stack), metric(stack.gateway_url, "gateway_prefix_lookup_hit_tokens_total")
            seconds, hit = _ttft(stack, key, tokens)
            times[kind].append(seconds)
            seen[kind].append((hit, loaded_tokens(stack) - loaded,
                               metric(stack.gateway_url, "gateway_prefix_lookup_hit_tokens_total") - found))
    medians = {kind: statistics.median(t) for kind, t in times.items()}
    print("TTFT medians (s):", {k: round(v, 3) for k, v in medians.items()},
          {k: [round(x, 3) for x in v] for k, v in times.items()}, "(usage, loaded, found):", seen)
    # The mechanism: B's requests found nothing in the index, loaded nothing, were billed no hit.
    assert all(s == (0, 0, 0) for s in seen["fresh miss"] + seen["B on A's prompt"]), seen
    # A's found its prefix every time; usage reports what the engine loaded (the engine may
    # recompute part of a hit whose disk read is slow, so most, not all, rounds loaded all of it).
    assert all(found == full_hit and usage == loaded for usage, loaded, found in seen["A's hit"]), seen
    assert sum(usage == full_hit for usage, _, _ in seen["A's hit"]) > ROUNDS // 2, seen
    # The side channel, with generous margins for a noisy shared machine (a hit is ~5x faster here).
    assert medians["A's hit"] < 0.5 * medians["fresh miss"], medians  # the test can see a hit
    assert medians["B on A's prompt"] > 0.5 * medians["fresh miss"], medians  # B sees none


def test_tenant_cannot_claim_another_tenant_in_the_body(stack):
    """Only the API key picks the tenant: body fields naming tenant A (or A's salt) are ignored."""
    tokens = np.random.default_rng(7).integers(100, 100_000, 300).tolist()
    _ttft(stack, "key-a", tokens)
    wait_for_saves(stack)
    assert _ttft(stack, "key-a", tokens)[1] == 256
    before = loaded_tokens(stack)
    salt_a = tenant_salt(stack.secrets.salt_key, "tenant-a")
    spoof = {"tenant": "tenant-a", "tenant_salt": salt_a, "user": "tenant-a"}
    assert _ttft(stack, "key-b", tokens, spoof)[1] == 0
    assert loaded_tokens(stack) == before
