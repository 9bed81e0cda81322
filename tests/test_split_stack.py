"""Prefill/decode disaggregation through the real stack (tiny preset, batch-invariant, bf16 latents, real Valkey,
volumes and processes): `deepinfer up --engines 1 --prefill-engines 1 --decode-engines 1`. A request is split (the
prefill engine prefills and saves, the decode engine loads the published blocks and decodes); the same request
pinned to the role-both engine under another tenant (another salt: nothing shared) is the undivided reference."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.stack_probes import ADMIN_TOKEN, admin_stats, http, metric, start_tiny_stack, wait_for_saves

B = 64  # tokens per block


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_tiny_stack(tmp_path_factory.mktemp("split"), engines=1, prefill_engines=1, decode_engines=1,
                               batch_invariant=True, api_keys="key-a:tenant-a,key-b:tenant-b,key-c:tenant-c")
    yield running
    running.stop()


def engines(stack) -> dict[str, str]:
    """role -> engine URL."""
    return {admin_stats(url)["role"]: url for url in stack.engine_urls}


def complete(stack, key: str, prompt: list[int], max_tokens: int = 12, pin: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if pin is not None:
        headers |= {"X-DeepInfer-Engine": pin, "X-DeepInfer-Admin-Token": ADMIN_TOKEN}
    body = {"model": "deepseek-chat", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    reply = http("POST", stack.gateway_url + "/v1/completions", json.dumps(body).encode(), headers, timeout=300)
    assert reply.status == 200, reply.body[:500]
    return reply.json()


def tokens_of(reply: dict) -> list[str]:
    return reply["choices"][0]["logprobs"]["tokens"]


def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104_729) % 100_000 + 1000 for i in range(length)]


def counters(url: str) -> dict[str, float]:
    return {"computed": metric(url, "deepinfer_engine_prefill_tokens_total", 'source="computed"'),
            "disk": metric(url, "deepinfer_engine_prefix_hit_tokens_total", 'tier="disk"'),
            "memory": metric(url, "deepinfer_engine_prefix_hit_tokens_total", 'tier="memory"')}


def delta(after: dict, before: dict) -> dict:
    return {name: after[name] - before[name] for name in after}


@pytest.mark.parametrize("length", [5 * B, 5 * B + 17])
def test_a_split_request_gives_the_undivided_tokens_and_recomputes_no_published_block(stack, length):
    """Whole blocks and a partial tail: the decode engine loads every full block of the prompt the prefill engine
    published (the first token's latent is its first decode step's) and computes only the tail."""
    role = engines(stack)
    prompt = prompt_of(length, length)
    reference = complete(stack, "key-b", prompt, pin=role["both"])
    before = {name: counters(url) for name, url in role.items()}
    split = complete(stack, "key-a", prompt)
    wait_for_saves(stack)
    assert tokens_of(split) == tokens_of(reference) and split["choices"][0]["text"] == reference["choices"][0]["text"]
    assert split["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"] == 12
    assert split["usage"]["prompt_tokens"] == length and split["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prefill, decode = (delta(counters(role[name]), before[name]) for name in ("prefill", "decode"))
    assert prefill["computed"] == length  # the whole prompt, on the prefill engine
    published = length // B * B
    assert decode == {"computed": length - published, "disk": published, "memory": 0}, decode
    assert delta(counters(role["both"]), before["both"]) == {"computed": 0, "disk": 0, "memory": 0}


def test_a_repeated_prefix_is_a_hit_for_the_split_request(stack):
    """The second request of a conversation reuses the first's blocks: the prefill engine computes only the new part,
    the user's cached_tokens counts the prompt's hit (not the handoff)."""
    role = engines(stack)
    first = prompt_of(4 * B + 10, 3)
    complete(stack, "key-a", first, max_tokens=4)
    wait_for_saves(stack)
    second = first + prompt_of(2 * B, 4)
    reference = complete(stack, "key-b", second, pin=role["both"])
    before = counters(role["prefill"])
    split = complete(stack, "key-a", second)
    assert tokens_of(split) == tokens_of(reference)
    cached = split["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 4 * B and delta(counters(role["prefill"]), before)["computed"] == len(second) - cached


def test_a_prefill_engine_killed_mid_prompt_leaves_the_request_to_the_others(stack):
    """SIGKILL as the prefill engine starts a long prompt: the gateway runs the request undivided on another engine,
    with the same tokens; nothing wrong is served. (Last in this module: the prefill engine stays dead.)"""
    role = engines(stack)
    prompt = prompt_of(8_000, 9)
    reference = complete(stack, "key-b", prompt, max_tokens=6, pin=role["both"])
    victim = f"engine{stack.engine_urls.index(role['prefill'])}"
    log_path = stack.logs / f"{victim}.log"
    seen = log_path.read_text().count("8000 prompt tokens")
    result: dict = {}
    request = threading.Thread(target=lambda: result.update(complete(stack, "key-c", prompt, max_tokens=6)))
    request.start()
    deadline = time.monotonic() + 120
    while log_path.read_text().count("8000 prompt tokens") == seen:  # the engine has the job: its prefill begins
        assert time.monotonic() < deadline and request.is_alive(), "the prefill engine never got the request"
        time.sleep(0.005)
    os.kill(stack.procs[victim].pid, signal.SIGKILL)
    request.join(300)
    assert tokens_of(result) == tokens_of(reference)
    assert metric(stack.gateway_url, "gateway_split_fallbacks_total") == 1
