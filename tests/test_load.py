"""A bounded load test of the real stack (tiny preset, two engines): 64 concurrent clients replay
multi-turn conversations in waves. Zero errors, every answer equal to the same conversation run
alone, and the gateway's and engines' memory flat from the second wave to the last.

Prints the hit ratio and latency percentiles (DEEPINFER_RECORD_LOAD=1 also writes them into
RELIABILITY.md's load row).
"""
from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from openai import AsyncOpenAI

from tests.stack_probes import start_tiny_stack, vm_rss_bytes, wait_for_saves, wait_until_idle

CLIENTS = 64
TURNS = 3
WAVES = 4
MAX_TOKENS = 8
SYSTEM = ("You are DeepInfer's load-test assistant. Answer briefly, cite sources, never invent numbers, "
          "and prefer tables for comparisons. ") * 4
RSS_TOLERANCE = (1.10, 48 << 20)  # last wave's RSS <= second wave's * 1.10 + 48 MiB
RELIABILITY = Path(__file__).resolve().parent.parent / "RELIABILITY.md"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # 64 clients share one key here: lift the gateway's per-key limit on requests in flight (16 by default).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DEEPINFER_GATEWAY_KEY_MAX_CONCURRENT", "64")
        running = start_tiny_stack(tmp_path_factory.mktemp("load"), engines=2, api_keys="key-load:tenant-load")
    yield running
    running.stop()


def user_turns(conversation: int) -> list[str]:
    return [f"Conversation {conversation}: how do disks {conversation % 5} and {conversation} differ?",
            f"Why would block {conversation * 7} be slow?",
            "Summarize in one line."][:TURNS]


class Turn(NamedTuple):
    answer: str
    seconds: float
    prompt_tokens: int
    hit_tokens: int


async def converse(client: AsyncOpenAI, conversation: int) -> list[Turn]:
    """One client: the conversation's turns in order, each resending the answers so far."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for text in user_turns(conversation):
        messages.append({"role": "user", "content": text})
        start = time.monotonic()
        reply = await client.chat.completions.create(model="deepseek-chat", messages=messages,
                                                     max_tokens=MAX_TOKENS, temperature=0)
        answer = reply.choices[0].message.content
        turns.append(Turn(answer, time.monotonic() - start, reply.usage.prompt_tokens,
                          reply.usage.prompt_cache_hit_tokens))
        messages.append({"role": "assistant", "content": answer})
    return turns


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def record_in_reliability(row: str) -> None:
    """Replace the load row of RELIABILITY.md's table, only when asked (DEEPINFER_RECORD_LOAD=1): a test
    run must not edit tracked files."""
    if os.environ.get("DEEPINFER_RECORD_LOAD") != "1" or not RELIABILITY.exists():
        return
    text = RELIABILITY.read_text()
    pattern = re.compile(r"^\|\s*load\b[^\n]*$", re.IGNORECASE | re.MULTILINE)
    if pattern.search(text):
        RELIABILITY.write_text(pattern.sub(lambda _: row, text, count=1))


async def test_64_clients_multi_turn_zero_errors_same_answers_flat_memory(stack):
    client = AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="key-load", max_retries=0, timeout=300)
    # References: every conversation run alone, one request at a time.
    reference = [[turn.answer for turn in await converse(client, c)] for c in range(CLIENTS)]
    wait_for_saves(stack)
    pids = {name: proc.pid for name, proc in stack.procs.items() if name != "kvstore"}
    rss: list[dict[str, int]] = []
    turns: list[Turn] = []
    started = time.monotonic()
    for wave in range(WAVES):
        results = await asyncio.gather(*(converse(client, c) for c in range(CLIENTS)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"wave {wave}: {len(errors)} of {CLIENTS} clients failed, e.g. {errors[0]!r}"
        for c, result in enumerate(results):
            assert [turn.answer for turn in result] == reference[c], (wave, c)
            turns += result
        wait_for_saves(stack)
        wait_until_idle(stack)
        rss.append({name: vm_rss_bytes(pid) for name, pid in pids.items()})
    seconds = time.monotonic() - started
    await client.close()

    latencies = [turn.seconds for turn in turns]
    hit_ratio = sum(t.hit_tokens for t in turns) / sum(t.prompt_tokens for t in turns)
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    mib = {name: [round(sample[name] / 2 ** 20) for sample in rss] for name in pids}
    print(f"\nload: {CLIENTS} clients x {TURNS} turns x {WAVES} waves = {len(turns)} requests in {seconds:.1f} s, "
          f"0 errors, hit ratio {hit_ratio:.1%}, latency p50 {p50:.3f} s p99 {p99:.3f} s; RSS MiB by wave {mib}")
    record_in_reliability(
        f"| Load: {CLIENTS} concurrent clients, {len(turns)} multi-turn chat requests ({WAVES} waves, tiny preset, "
        f"2 engines, temperature 0) | 0 errors; every answer equals the same conversation run alone; "
        f"hit ratio {hit_ratio:.1%}; latency p50 {p50:.2f} s, p99 {p99:.2f} s (64 clients queued on 2 engines); "
        f"gateway and engine RSS flat from wave 2 to wave {WAVES} | "
        f"`test_64_clients_multi_turn_zero_errors_same_answers_flat_memory` |")
    assert len(turns) == CLIENTS * TURNS * WAVES
    assert hit_ratio > 0.5  # the system prompt and earlier turns are served from the cache
    scale, slack = RSS_TOLERANCE
    for name in pids:
        assert rss[-1][name] <= rss[1][name] * scale + slack, f"{name} RSS grew: MiB by wave {mib[name]}"
