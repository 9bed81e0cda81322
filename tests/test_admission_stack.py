"""`deepinfer up --admit-after 2` through the real stack (tiny preset, real Valkey, volumes and processes): a
one-off prompt is served and kept in the engine's memory tier but not written to disk; its second sighting writes
its blocks, which a later request then reads back from disk."""
from __future__ import annotations

from pathlib import Path

import pytest
import redis
from openai import OpenAI

from tests.stack_probes import ADMIN_TOKEN, http, metric, start_tiny_stack, wait_for_saves

SYSTEM = ("You are the admission test's assistant. Each rule below is one sentence: answer briefly, never guess, "
          "quote the source, and say when you do not know. ") * 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_tiny_stack(tmp_path_factory.mktemp("admission"), api_keys="key-a:tenant-a", admit_after=2)
    yield running
    running.stop()


def ask(stack, question: str):
    client = OpenAI(base_url=stack.gateway_url + "/v1", api_key="key-a", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="deepseek-chat", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    wait_for_saves(stack)
    return reply


def on_disk(stack) -> tuple[int, int]:
    """(segment files on the volumes, block entries in the index)."""
    segments = sum(1 for volume in stack.volumes for path in (Path(volume) / "segments").glob("*")
                   if len(path.name) == 32)
    client = redis.Redis.from_url(stack.redis_url, password=stack.secrets.redis_password)
    try:
        entries = sum(1 for _ in client.scan_iter(match="dikv:*:b:*", count=1000))
    finally:
        client.close()
    return segments, entries


def test_a_one_off_prompt_stays_off_the_disk_and_its_second_sighting_is_written(stack):
    engine = stack.engine_urls[0]
    first = ask(stack, "What is the first rule?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert on_disk(stack) == (0, 0) and metric(engine, "deepinfer_engine_saved_blocks_total") == 0
    assert metric(stack.gateway_url, "gateway_admission_blocks_total", 'decision="deferred"') > 0

    second = ask(stack, "What is the first rule?")  # the same prompt: its blocks' second sighting
    blocks = (second.usage.prompt_tokens - 1) // 64
    assert second.usage.prompt_tokens_details.cached_tokens == blocks * 64  # the memory tier kept it meanwhile
    segments, entries = on_disk(stack)
    assert segments >= 1 and entries == blocks
    assert metric(engine, "deepinfer_engine_saved_blocks_total") == blocks

    assert http("POST", engine + "/admin/memory-tier/drop", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                ).status == 200
    third = ask(stack, "What is the second rule?")  # the system prompt's blocks, now read from disk
    assert third.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(engine, "deepinfer_engine_prefix_hit_tokens_total", 'tier="disk"') > 0


def test_a_memory_hit_of_blocks_on_disk_writes_them_no_second_time(stack):
    """Blocks the index holds are on disk: a request that finds them in the memory tier saves none of them again."""
    engine = stack.engine_urls[0]
    ask(stack, "What is the first rule?")  # its blocks are on disk after the first test's second sighting
    saved, stored = metric(engine, "deepinfer_engine_saved_blocks_total"), on_disk(stack)
    for _ in range(2):
        repeat = ask(stack, "What is the first rule?")
        assert repeat.usage.prompt_tokens_details.cached_tokens == (repeat.usage.prompt_tokens - 1) // 64 * 64
    assert metric(engine, "deepinfer_engine_saved_blocks_total") == saved and on_disk(stack) == stored
