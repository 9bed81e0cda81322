"""Security of the real stack (API keys, tiny model): admin endpoints need the admin token, every
service binds loopback by default and listens nowhere else, one tenant can never observe another
tenant's cache (not in usage, not in what the engine loads, not in time to first token), and each
attack of issue 10 is repeated and refused: the internal plane without the service token, forged
and corrupt segments, NaN latents, Valkey without the password, secrets in argv, the shared token
cache, /metrics on the public port, oversized bodies, malformed engine jobs."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import stat
import statistics
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import msgpack
import numpy as np
import pytest
import redis

from kvstore import BlockStore, CacheGeometry, PrefixIndex, block_hashes, open_redis
from kvstore.segment import decode_header

from services.engine.app import build_app
from services.engine.config import EngineConfig
from services.gateway.app import create_app as create_gateway_app
from services.gateway.chat_template import ChatMessage, render_chat
from services.gateway.config import GatewayConfig
from services.gateway.tenants import tenant_salt
from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import shared_tokenizer
from services.kvstore.app import create_app as create_kvstore_app
from services.kvstore.config import KvstoreConfig
from services.launcher import StackConfig
from tests.stack_probes import (ADMIN_TOKEN, Stored, admin_stats, http, loaded_tokens, metric, start_tiny_stack,
                                stored, vm_rss_bytes, wait_for_saves)

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
            path = re.sub(r"\{[^}]+\}", "some-tenant", path)  # a route's variable parts, filled in
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
    valkey = stack.valkey.process
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
    """Only the API key picks the tenant: body fields naming tenant A (or A's salt) are refused as
    unknown fields (400 naming them), and `user` (OpenAI's end-user id) is only logged."""
    tokens = np.random.default_rng(7).integers(100, 100_000, 300).tolist()
    _ttft(stack, "key-a", tokens)
    wait_for_saves(stack)
    assert _ttft(stack, "key-a", tokens)[1] == 256
    before = loaded_tokens(stack)
    salt_a = tenant_salt(stack.secrets.salt_key, "tenant-a")
    for field, value in (("tenant", "tenant-a"), ("tenant_salt", salt_a)):
        body = {"model": "deepseek-chat", "prompt": tokens, "max_tokens": 1, field: value}
        reply = http("POST", stack.gateway_url + "/v1/completions", json.dumps(body).encode(),
                     {"Authorization": "Bearer key-b", "Content-Type": "application/json"})
        assert reply.status == 400 and reply.json()["error"]["param"] == field, reply
    assert _ttft(stack, "key-b", tokens, {"user": "tenant-a"})[1] == 0
    assert loaded_tokens(stack) == before


# -- the attacks of issue 10, each repeated against the running stack and shown refused --

def _completion(stack, key: str, tokens: list[int], max_tokens: int = 6, **extra) -> dict:
    """A greedy /v1/completions over token ids: the JSON reply (its text and usage)."""
    body = {"model": "deepseek-chat", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0} | extra
    reply = http("POST", stack.gateway_url + "/v1/completions", json.dumps(body).encode(),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert reply.status == 200, reply
    return reply.json()


def _victim_prefix(stack, seed: int) -> tuple[list[int], dict, list[bytes]]:
    """Tenant A's prompt, cached: its tokens, its first answer, and its block hashes (computed here
    with the deployment's salt key, which an attacker does not have)."""
    tokens = np.random.default_rng(seed).integers(100, 100_000, 5 * B + 10).tolist()
    first = _completion(stack, "key-a", tokens)
    wait_for_saves(stack)
    fingerprint = admin_stats(stack.engine_urls[0])["fingerprint"]
    hashes = block_hashes(tokens, fingerprint, tenant_salt(stack.secrets.salt_key, "tenant-a"), B)
    return tokens, first, hashes[:(len(tokens) - 1) // B]


def _no_credential_headers() -> list[dict]:
    return [{}, {"Authorization": "Bearer"}, {"Authorization": "Bearer key-a"},
            {"Authorization": f"Bearer {ADMIN_TOKEN}"}, {"Authorization": "Bearer " + "0" * 64}]


def test_kvstore_data_endpoints_refuse_callers_without_the_service_token(stack):
    """Lookup (did someone send this prompt?), read (its latents), save (poison) and delete, as a
    local attacker would send them, even with the victim's real block hashes: 401/403, and the
    victim's next answer and hit count are unchanged."""
    tokens, first, hashes = _victim_prefix(stack, 11)
    model = {"fingerprint": admin_stats(stack.engine_urls[0])["fingerprint"],
             "geometry": {k: admin_stats(stack.engine_urls[0])[k2] for k, k2 in
                          (("num_layers", "num_layers"), ("latent_dim", "latent_dim"),
                           ("block_tokens", "block_tokens"), ("dtype", "cache_dtype"))}}
    geometry = model["geometry"]
    poison = np.full((len(hashes) * B, geometry["latent_dim"]), 10.0, np.float32).astype(
        CacheGeometry(**geometry).np_dtype).view(np.uint8).tobytes()
    attacks = [("POST", "/v1/lookup", msgpack.packb({"hashes": hashes})),
               ("POST", "/v1/read", msgpack.packb(model | {"root": hashes[0], "hashes": hashes, "layer": 0,
                                                          "runs": []})),
               ("POST", "/v1/segments", msgpack.packb(model | {"hashes": hashes, "start_block": 0, "tenant": "x",
                                                              "retention": "chat", "ttl_s": None,
                                                              "layers": [poison] * geometry["num_layers"]})),
               ("DELETE", "/v1/segments/" + "ab" * 16, None)]
    before = stored(stack)
    for method, path, body in attacks:
        for headers in _no_credential_headers():
            reply = http(method, stack.kvstore_url + path, body, headers | {"Content-Type": "application/msgpack"})
            assert reply.status in (401, 403), (method, path, headers, reply)
    assert stored(stack) == before
    again = _completion(stack, "key-a", tokens)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_cache_hit_tokens"] == len(hashes) * B


def test_engine_internal_endpoints_refuse_callers_without_the_service_token(stack):
    job = json.dumps({"tokens": [5, 6, 7], "max_tokens": 2, "tenant": "tenant-a",
                      "tenant_salt": tenant_salt(stack.secrets.salt_key, "tenant-a")}).encode()
    for url in stack.engine_urls:
        for headers in _no_credential_headers():
            for method, path, body in (("POST", "/internal/generate", job), ("GET", "/metrics", None)):
                if path == "/metrics" and headers.get("Authorization") == f"Bearer {ADMIN_TOKEN}":
                    continue  # an operator's scraper
                reply = http(method, url + path, body, headers | {"Content-Type": "application/json"})
                assert reply.status in (401, 403), (url, path, headers, reply)
        assert http("GET", url + "/healthz").status == 200 and http("GET", url + "/readyz").status == 200
        service = {"Authorization": f"Bearer {stack.secrets.service_token}", "Content-Type": "application/json"}
        assert http("POST", url + "/internal/generate", job, service).status == 200
        for bad in ({"stop_token_ids": [1e400]}, {"seed": 2 ** 64}, {"tokens": [2 ** 70]}):
            reply = http("POST", url + "/internal/generate",
                         json.dumps(json.loads(job) | bad).encode().replace(b"inf", b"1e400"), service)
            assert reply.status == 400, (bad, reply)


def test_a_segment_written_without_the_mac_key_is_never_served(stack):
    """The strongest outsider short of the MAC key: it knows the salts, can write to the volumes and
    to the index (it has the Valkey password), and republishes the victim's blocks pointing at its
    own segment of 10.0 latents. The victim's answer stays the clean one; the forged blocks are
    never loaded (0 hit tokens reported), and the next request caches the prefix again."""
    tokens, first, hashes = _victim_prefix(stack, 12)
    stats = admin_stats(stack.engine_urls[0])
    geometry = CacheGeometry(stats["num_layers"], stats["latent_dim"], stats["block_tokens"], stats["cache_dtype"])
    poison = [np.full((len(hashes) * B, geometry.latent_dim), 10.0, np.float32).astype(geometry.np_dtype)
              for _ in range(geometry.num_layers)]

    async def forge() -> None:
        redis = open_redis(stack.redis_url, password=stack.secrets.redis_password)
        store = await BlockStore.open(stack.volumes, geometry, stats["fingerprint"], PrefixIndex(redis),
                                      mac_key="the attacker's guess", threads=1)
        try:
            await store.save(hashes, poison, tenant="tenant-a")
        finally:
            await store.close()
            await redis.aclose()

    asyncio.run(forge())
    _drop_memory_tiers(stack)  # so the repeat must come from disk, where the forged segment is
    attacked = _completion(stack, "key-a", tokens)
    assert attacked["choices"][0]["text"] == first["choices"][0]["text"]
    assert attacked["usage"]["prompt_cache_hit_tokens"] == 0
    assert sum(admin_stats(url)["store"]["forged_segments"] for url in stack.engine_urls) >= 1
    wait_for_saves(stack)
    assert _completion(stack, "key-a", tokens)["usage"]["prompt_cache_hit_tokens"] == len(hashes) * B


def _drop_memory_tiers(stack) -> None:
    """Empty every engine's memory tier (pages of finished requests), so a repeat reads from disk."""
    for url in stack.engine_urls:
        reply = http("POST", url + "/admin/memory-tier/drop", b"", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert reply.status == 200, reply


def _rewrite_segments(stack, before: Stored, change) -> int:
    """Apply change(bytearray raw, header) to every segment file written since `before`; returns how many."""
    changed = 0
    for path, _ in stored(stack).files - before.files:
        if "/segments/" not in path:
            continue
        raw = bytearray(open(path, "rb").read())
        header = decode_header(bytes(raw[:12 + int.from_bytes(raw[8:12], "little")]))
        change(raw, header)
        with open(path, "r+b") as f:  # in place, as a disk or a writer with the file would
            f.write(raw)
        changed += 1
    return changed


def test_nan_latents_and_swapped_words_are_served_as_misses(stack):
    """Latents of NaN (0x7FC0) where a keyed writer's block should be, and two 8-byte words swapped
    inside one row (the old rowsum64 missed that): the answer is the clean miss's, nothing of the
    damaged block is loaded, and the store counts it."""
    for seed, damage in ((13, "nan"), (14, "swap")):
        wait_for_saves(stack)
        before = stored(stack)
        tokens = np.random.default_rng(seed).integers(100, 100_000, 3 * B + 10).tolist()
        first = _completion(stack, "key-a", tokens)
        wait_for_saves(stack)

        def change(raw: bytearray, header) -> None:
            at = header.data_offset + 7 * stack_row_bytes(header)  # layer 0, block 0, row 7
            row = np.frombuffer(raw, np.uint16, stack_row_bytes(header) // 2, at).copy()
            if damage == "nan":
                row[5] = 0x7FC0
            else:
                words = row.view(np.uint64)
                words[[1, 4]] = words[[4, 1]]
            raw[at:at + row.nbytes] = row.tobytes()
        assert _rewrite_segments(stack, before, change)
        failures = sum(admin_stats(url)["store"]["verification_failures"] for url in stack.engine_urls)
        _drop_memory_tiers(stack)
        again = _completion(stack, "key-a", tokens)
        assert again["choices"][0]["text"] == first["choices"][0]["text"], damage
        assert again["usage"]["prompt_cache_hit_tokens"] == 0, damage
        assert sum(admin_stats(url)["store"]["verification_failures"] for url in stack.engine_urls) > failures


def stack_row_bytes(header) -> int:
    return header.geometry.row_bytes


def test_valkey_needs_the_password(stack):
    url = urlsplit(stack.redis_url)
    anonymous = redis.Redis(host=url.hostname, port=url.port)
    try:
        assert anonymous.ping()  # the default user may only PING (health checks)
        for command in (("CONFIG", "SET", "maxmemory", "1"), ("KEYS", "*"), ("SET", "x", "1"), ("FLUSHALL",)):
            with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|NOAUTH|no permissions"):
                anonymous.execute_command(*command)
    finally:
        anonymous.close()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(stack.redis_url, password="wrong").ping()
    assert urlsplit(stack.redis_url).password is None
    acl = Path(stack.data / "valkey" / "users.acl")
    assert stat.S_IMODE(acl.stat().st_mode) == 0o600 and stack.secrets.redis_password not in acl.read_text()


def _descendants(pid: int) -> set[int]:
    children = {int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid}
    return children.union(*(_descendants(c) for c in children)) if children else children


def _ppid(pid: int) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_no_secret_in_any_process_argv_and_secret_files_are_private(stack):
    """/proc/*/cmdline is readable by every local user: the service token, salt key, MAC key, admin
    token, Valkey password and API keys must be in no process's argv."""
    secrets = [stack.secrets.service_token, stack.secrets.salt_key, stack.secrets.mac_key, stack.secrets.admin_token,
               stack.secrets.redis_password, "key-a", "key-b"]
    pids = {proc.pid for proc in stack.procs.values()} | {stack.valkey.process.pid}
    pids |= set().union(*(_descendants(pid) for pid in set(pids)))
    assert len(pids) >= 4
    for pid in sorted(pids):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:  # exited meanwhile
            continue
        assert not [s for s in secrets if s in argv], (pid, argv)
        assert not re.search(r"://[^/\s@]*:[^/\s@]*@", argv), argv  # no user:password@ in a URL
    for path in (stack.data / "secrets").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((stack.data / "secrets").stat().st_mode) == 0o700


def test_bob_learns_nothing_of_alices_prompts_from_usage_or_metrics(stack):
    """Alice is answered; bob sends her conversation with her answer (as a client re-sends history).
    Alice's token cache renders her answer as the ids the model generated; bob's must be plain
    tokenization, so his usage.prompt_tokens says nothing about what she was answered. And the
    gateway's /metrics (hit counters of every tenant) is closed to tenants' keys."""
    tokenizer_cache = TokenCache(shared_tokenizer(), 16 << 20)
    found_difference = False
    for seed in range(8):
        question = " ".join(np.random.default_rng(seed).choice(["alpha", "beta", "gamma", "delta"], 40))
        messages = [{"role": "user", "content": question}]
        answer = _chat(stack, "key-a", messages)["choices"][0]["message"]["content"]
        follow = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}]
        plain = len(render_chat([ChatMessage(m["role"], m["content"]) for m in follow], tokenizer_cache))
        bob = _chat(stack, "key-b", follow)["usage"]["prompt_tokens"]
        alice = _chat(stack, "key-a", follow)["usage"]["prompt_tokens"]
        assert bob == plain, (seed, bob, plain)
        found_difference |= alice != plain
        if found_difference:
            break
    assert found_difference, "no answer re-tokenized differently: the test could not see a shared cache"
    for key in ("key-a", "key-b", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert http("GET", stack.gateway_url + "/metrics", headers=headers).status == 401, key


def _chat(stack, key: str, messages: list[dict]) -> dict:
    body = {"model": "deepseek-chat", "messages": messages, "max_tokens": 12, "temperature": 0}
    reply = http("POST", stack.gateway_url + "/v1/chat/completions", json.dumps(body).encode(),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert reply.status == 200, reply
    return reply.json()


def test_an_oversized_body_is_refused_before_it_costs_memory(stack):
    """The issue's 9 MB chat body (it took 10.6 s and 1.6 GB tokenizing) is context_length_exceeded
    from the word bound, without tokenizing; a 64 MiB one is 413 (longer than any prompt within
    the tiny model's 16K context can need: 13.6 MB). The gateway's memory barely moves."""
    gateway = stack.procs["gateway"].pid
    rss_before = vm_rss_bytes(gateway)
    for size, status, code in ((9_000_000, 400, "context_length_exceeded"), (64 << 20, 413, "request_too_large")):
        body = b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "' + b"word " * (size // 5) + b'"}]}'
        reply = http("POST", stack.gateway_url + "/v1/chat/completions", body,
                     {"Authorization": "Bearer key-b", "Content-Type": "application/json"})
        assert reply.status == status and reply.json()["error"]["code"] == code, reply
        if status == 400:
            assert "at least 1800000 tokens" in reply.json()["error"]["message"], reply
    assert vm_rss_bytes(gateway) - rss_before < 64 << 20
