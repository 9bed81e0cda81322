"""Two hosts: two complete `deepinfer up` stacks (own data dirs, own engines, kvstores and
gateways, as two machines would have) sharing one Redis Cluster and one S3 bucket (a real
S3-compatible server, moto). A prefix saved through host A is a hit on host B with the same
greedy answer, and host B's reads are verified like any other."""
from __future__ import annotations

import asyncio
import secrets

import pytest

from services.launcher import Stack, StackConfig
from tests.conftest import free_port, free_ports
from tests.fault_stack import admin_json, audit_index, chat, prompt, wait_for_saves
from tests.volume_shelf import BUCKET, S3Shelf

pytestmark = pytest.mark.timeout(600)


# The deployment's secrets, given to both hosts as two hosts of one deployment would have them: with
# salt and MAC keys of their own, neither host could compute or verify the other's blocks.
SHARED = {"salt_key": secrets.token_hex(32), "mac_key": secrets.token_hex(32)}


def host(data, redis_url: str, volumes: list[str]) -> Stack:
    cfg = StackConfig(preset="tiny", data_dir=str(data), engines=1, gateway_port=free_port(),
                      kvstore_port=free_port(), engine_port=free_ports(1), redis_url=redis_url, redis_cluster=True,
                      volumes=volumes, budget_gib=1.0, ready_timeout_s=400, **SHARED)  # s3 needs a stated budget
    return Stack(cfg, quiet=True)


def test_a_prefix_saved_through_host_a_is_a_hit_on_host_b(tmp_path, cluster_url, s3_server):
    shelf = S3Shelf(s3_server, f"s3://{BUCKET}/{secrets.token_hex(6)}")
    volumes = shelf.volumes(2)
    a = host(tmp_path / "host-a", cluster_url, volumes).start()
    try:
        b = host(tmp_path / "host-b", cluster_url, volumes).start()
        try:
            content = prompt("two-hosts")
            answer, usage = chat(a, content)
            assert usage.prompt_cache_hit_tokens == 0
            wait_for_saves(a)
            text, usage = chat(b, content)
            assert usage.prompt_cache_hit_tokens > 0 and text == answer
            # Both hosts see the same two volumes in the bucket, with the same ids (one opener won each).
            on_a, on_b = (admin_json(h, h.kvstore_url + "/admin/volumes")["volumes"] for h in (a, b))
            assert {v["name"] for v in on_b} == {v + "/" for v in volumes} and all(v["reachable"] for v in on_b)
            assert {v["id"] for v in on_a} == {v["id"] for v in on_b}
            assert asyncio.run(audit_index(b, volumes)) > 0  # every entry reads back verified from host B

            # Objects host A saved, deleted from the bucket behind the index's back (as host A's
            # eviction deletes them after the reader grace): host B's read of them is a verified miss.
            before = {s for v in volumes for s in shelf.segments(v)}
            content = prompt("deleted-on-a")
            answer, _ = chat(a, content)
            wait_for_saves(a)
            saved = {s for v in volumes for s in shelf.segments(v)} - before
            assert saved
            for segment in saved:
                shelf.remove(segment)
            text, usage = chat(b, content)
            assert usage.prompt_cache_hit_tokens == 0 and text == answer
        finally:
            b.stop()
    finally:
        a.stop()
