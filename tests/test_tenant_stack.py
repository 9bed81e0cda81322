"""Tenant quotas and the purge on the real stack: gateway, engine (memory tier on, writing the volumes),
kvstore, Valkey, as `deepinfer up` starts them; read only through HTTP, Redis and the volumes' files.

The tests run in file order on one stack: the quota load test, the purge, the purge killed half-way.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from kvstore.fence import TenantFence
from kvstore.segment import decode_header
from services.launcher import Stack, _ready
from tests.fault_stack import prompt
from tests.stack_probes import ADMIN_TOKEN, admin_stats, http, metric, start_tiny_stack, wait_for_saves, wait_until_idle

ALPHA_QUOTA_GIB = 0.0003  # ~322 KB: about four segments of one tiny-model prompt (~78 KB each)
KEYS = f"ka:alpha:{ALPHA_QUOTA_GIB},kb:beta"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class RestartableStack(Stack):
    """The launcher's Stack, remembering each process's command line so a test restarts what it killed."""

    def _spawn(self, name, module, args, secret_fields=None):
        self.__dict__.setdefault("commands", {})[name] = (module, list(args), secret_fields)
        super()._spawn(name, module, args, secret_fields)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        module, args, secret_fields = self.commands[name]
        self._spawn(name, module, args, secret_fields)
        deadline = time.monotonic() + timeout_s
        while not _ready(self._urls()[name]):
            assert self.procs[name].poll() is None and time.monotonic() < deadline, self.tail(name)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import tests.stack_probes as probes
    original, probes.Stack = probes.Stack, RestartableStack
    try:
        running = start_tiny_stack(tmp_path_factory.mktemp("tenants"), api_keys=KEYS)
    finally:
        probes.Stack = original
    yield running
    running.stop()


def ask(stack: Stack, key: str, content: str) -> int:
    """One greedy chat request as the key's tenant; the prompt tokens served from the cache."""
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0}
    reply = http("POST", stack.gateway_url + "/v1/chat/completions", json.dumps(body).encode(),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, timeout=120)
    assert reply.status == 200, reply
    return reply.json()["usage"]["prompt_cache_hit_tokens"]


def tenant_bytes(stack: Stack, tenant: str) -> float:
    return metric(stack.kvstore_url, "kvstore_tenant_bytes", f'tenant="{tenant}"')


def volume_blocks(stack: Stack) -> Counter:
    """Blocks per tenant in every segment object on the volumes, read from the files' headers."""
    found = Counter()
    for volume in stack.volumes:
        for path in (Path(volume) / "segments").glob("*"):
            if len(path.name) == 32:
                header = decode_header(path.read_bytes()[:1 << 16])
                found[header.tenant] += header.n_blocks
    return found


def index_blocks(stack: Stack) -> Counter:
    """Index entries per tenant of the segment record they point into ("?": no record, dangling)."""
    client = redis.Redis.from_url(stack.redis_url, password=stack.secrets.redis_password)
    try:
        found = Counter()
        for key in client.scan_iter(match=b"dikv:{*}:b:*", count=1000):
            value = client.get(key)
            if value is None or key[38:42] != b"}:b:":
                continue
            segment = value.split(b"|")[1]
            tenant = client.hget(key[:40] + b"s:" + segment, "tenant")
            found[tenant.decode() if tenant else "?"] += 1
        return found
    finally:
        client.close()


def memory_pages(stack: Stack) -> Counter:
    return sum((Counter(admin_stats(url)["tenant_pages"]) for url in stack.engine_urls), Counter())


def fence(stack: Stack) -> tuple[redis.Redis, TenantFence]:
    client = redis.Redis.from_url(stack.redis_url, password=stack.secrets.redis_password)
    keys = TenantFence.__new__(TenantFence)
    keys.epochs_key, keys.tombstones_key = "dikv:{tenants}:epoch", "dikv:{tenants}:purge"
    return client, keys


def tombstone(stack: Stack, tenant: str) -> int | None:
    client, keys = fence(stack)
    try:
        value = client.hget(keys.tombstones_key, tenant)
        return None if value is None else int(value)
    finally:
        client.close()


BETA = [prompt(f"beta {i}", 200) for i in range(3)]


def test_a_tenant_under_load_stays_within_its_quota_and_the_other_keeps_its_hits(stack):
    for content in BETA:
        assert ask(stack, "kb", content) == 0
    wait_for_saves(stack)
    beta_hits = [ask(stack, "kb", content) for content in BETA]
    assert min(beta_hits) > 0
    wait_for_saves(stack)  # a memory hit's blocks are saved again
    beta_bytes = tenant_bytes(stack, "beta")

    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(tenant_bytes(stack, "alpha"))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    workers = [threading.Thread(target=lambda w=w: [ask(stack, "ka", prompt(f"alpha {w} {i}", 200))
                                                    for i in range(4)]) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wait_for_saves(stack)
    done.set()
    sampler.join()
    samples.append(tenant_bytes(stack, "alpha"))

    quota = ALPHA_QUOTA_GIB * (1 << 30)
    segment = 4096 + 8 * 2 * 64 * 48 * 2  # the largest segment of a prompt here: header, 8 blocks x 2 layers
    assert 0 < samples[-1] and max(samples) <= quota + segment, (samples, quota)
    assert metric(stack.kvstore_url, "kvstore_tenant_quota_bytes", 'tenant="alpha"') == int(quota)
    assert tenant_bytes(stack, "beta") == beta_bytes
    tenants = {t["tenant"]: t for t in json.loads(http("GET", stack.gateway_url + "/admin/dashboard.json",
                                                       headers=ADMIN).body)["kvstore"]["tenants"]}
    assert tenants["alpha"]["quota_bytes"] == int(quota) and tenants["beta"]["used_bytes"] == beta_bytes
    assert [ask(stack, "kb", content) for content in BETA] == beta_hits


def test_a_purge_erases_the_tenant_from_index_memory_and_volumes(stack):
    alpha = [prompt(f"alpha purge {i}", 200) for i in range(2)]
    for content in alpha:
        ask(stack, "ka", content)
    wait_for_saves(stack)
    wait_until_idle(stack)
    assert volume_blocks(stack)["alpha"] and index_blocks(stack)["alpha"] and memory_pages(stack)["alpha"]
    beta_hits = [ask(stack, "kb", content) for content in BETA]

    reply = http("DELETE", stack.gateway_url + "/admin/tenants/alpha/cache", headers=ADMIN, timeout=120)
    assert reply.status == 200, reply
    erased = reply.json()
    assert erased["blocks"] > 0 and erased["memory_blocks"] > 0 and erased["engines_missed"] == []
    assert volume_blocks(stack)["alpha"] == 0
    assert index_blocks(stack)["alpha"] == 0 and index_blocks(stack)["?"] == 0
    assert memory_pages(stack)["alpha"] == 0
    assert tenant_bytes(stack, "alpha") == 0 and tombstone(stack, "alpha") is None
    assert [ask(stack, "kb", content) for content in BETA] == beta_hits
    assert [ask(stack, "ka", content) for content in alpha] == [0, 0]  # misses: nothing of alpha is left
    assert http("DELETE", stack.gateway_url + "/admin/tenants/alpha/cache").status == 401


def test_a_purge_killed_half_way_is_finished_by_the_restarted_kvstore(stack):
    """The kvstore is stopped when the purge reaches it and killed after the tombstone is written:
    the index is fenced and the memory tier dropped, the volumes not yet erased. Its restart's
    reconciliation finishes the erasure from the tombstone."""
    for i in range(2):
        ask(stack, "ka", prompt(f"alpha crash {i}", 200))
    wait_for_saves(stack)
    wait_until_idle(stack)
    assert volume_blocks(stack)["alpha"] > 0
    beta_blocks = volume_blocks(stack)["beta"]
    kvstore = stack.procs["kvstore"]
    kvstore.send_signal(signal.SIGSTOP)
    replies = []
    purge = threading.Thread(target=lambda: replies.append(
        http("DELETE", stack.gateway_url + "/admin/tenants/alpha/cache", headers=ADMIN, timeout=600)))
    purge.start()
    deadline = time.monotonic() + 60
    while tombstone(stack, "alpha") is None:
        assert time.monotonic() < deadline, "the gateway never fenced the tenant"
        time.sleep(0.05)
    kvstore.send_signal(signal.SIGKILL)
    kvstore.wait(30)
    purge.join(60)
    assert replies[0].status == 503 and "reconciliation" in replies[0].json()["error"]["message"]
    assert volume_blocks(stack)["alpha"] > 0 and tombstone(stack, "alpha") is not None  # half-way

    stack.restart("kvstore")
    deadline = time.monotonic() + 60
    while tombstone(stack, "alpha") is not None:  # reconciliation runs at the kvstore's start
        assert time.monotonic() < deadline, "reconciliation did not finish the purge"
        time.sleep(0.1)
    assert volume_blocks(stack)["alpha"] == 0 and volume_blocks(stack)["beta"] == beta_blocks
    assert index_blocks(stack)["alpha"] == 0 and memory_pages(stack)["alpha"] == 0
    assert min(ask(stack, "kb", content) for content in BETA) > 0
