"""End to end: the real stack (tiny preset, real Valkey, real volumes, real processes) started by the
same launcher as `deepinfer up`, driven with the official openai client."""
import asyncio
import json
import subprocess
import urllib.request

import pytest
from openai import OpenAI

from model.reference import generate
from model.serving import serving_model
from model.sampling import SamplingParams
from model.weights import load_model
from services.gateway.chat_template import ChatMessage, render_chat
from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import DeepSeekTokenizer
from services.launcher import Stack, StackConfig, curl_example
from tests.conftest import free_port, free_ports

B = 64
SYSTEM = ("You are DeepInfer's test assistant. Follow the house rules: be brief, cite sources, never "
          "invent numbers, answer in the user's language, and prefer tables for comparisons. ") * 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("stack")
    cfg = StackConfig(preset="tiny", data_dir=str(data), engines=2, gateway_port=free_port(),
                      kvstore_port=free_port(), engine_port=free_ports(2), redis_port=free_port(),
                      api_keys="key-a:tenant-a,key-b:tenant-b", ready_timeout_s=400)
    running = Stack(cfg, quiet=True).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tokens_of():
    cache = TokenCache(DeepSeekTokenizer(), 64 << 20)
    return lambda messages: render_chat([ChatMessage(m["role"], m["content"]) for m in messages], cache)


@pytest.fixture(scope="module")
def reference(stack):
    loaded = load_model(stack.data / "models" / "tiny")
    served = serving_model(loaded.model, "bfloat16")  # as the engines serve it
    return lambda tokens, n: generate(served, tokens, SamplingParams(max_tokens=n))


def client(stack, key="key-a"):
    return OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=300)


def chat(stack, messages, key="key-a", max_tokens=12, **extra):
    return client(stack, key).chat.completions.create(model="deepseek-chat", messages=messages,
                                                      max_tokens=max_tokens, temperature=0, **extra)


def wait_for_saves(stack):
    """Saves run after the response; wait until no engine has one pending."""
    for _ in range(200):
        pending = 0
        for url in stack.engine_urls:
            request = urllib.request.Request(url + "/admin/stats",
                                             headers={"Authorization": f"Bearer {stack.admin_token}"})
            with urllib.request.urlopen(request, timeout=5) as r:
                pending += json.load(r)["pending_saves"]
        if not pending:
            return
        import time
        time.sleep(0.05)


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_long_system_prompt_twice_hits_the_shared_prefix_with_the_same_answer(stack, tokens_of, reference):
    first_msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is MLA?"}]
    second_msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is MLA? Briefly."}]
    first = chat(stack, first_msgs)
    assert first.usage.prompt_cache_hit_tokens == 0
    wait_for_saves(stack)
    again = chat(stack, first_msgs)
    p = tokens_of(first_msgs)
    assert again.usage.prompt_cache_hit_tokens == (len(p) - 1) // B * B
    assert again.usage.prompt_cache_miss_tokens == len(p) - again.usage.prompt_cache_hit_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_cache_hit_tokens
    assert again.choices[0].message.content == first.choices[0].message.content

    other = chat(stack, second_msgs)
    shared = common_prefix(p, tokens_of(second_msgs))
    assert other.usage.prompt_cache_hit_tokens == shared // B * B > 0
    # The same greedy tokens as the model computing everything from scratch, in-process, no cache.
    tokenizer = DeepSeekTokenizer()
    assert other.choices[0].message.content == tokenizer.decode(reference(tokens_of(second_msgs), 12))


def test_three_turn_chat_hits_earlier_turns_including_the_answers(stack, tokens_of):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about disks. " * 20}]
    saved_tokens = 0
    for turn in range(3):
        reply = chat(stack, messages, max_tokens=40)
        prompt = tokens_of(messages)
        if turn:
            # Saved latents cover the previous prompt plus every answer token fed back through the model.
            expected = min(saved_tokens // B, (len(prompt) - 1) // B) * B
            assert reply.usage.prompt_cache_hit_tokens == expected
            assert expected > previous_prompt_len // B * B  # the hit reaches into the previous answer
        saved_tokens = len(prompt) + reply.usage.completion_tokens - 1
        previous_prompt_len = len(prompt)
        wait_for_saves(stack)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And turn {turn + 2}?"}]


def test_streaming_ends_with_usage(stack):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stream please."}]
    stream = client(stack).chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=10,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_cache_hit_tokens > 0
    assert text == chat(stack, messages, max_tokens=10).choices[0].message.content


def test_tenants_never_share_hits(stack):
    messages = [{"role": "system", "content": SYSTEM + " Tenant test."}, {"role": "user", "content": "Hi"}]
    chat(stack, messages, key="key-a")
    wait_for_saves(stack)
    assert chat(stack, messages, key="key-a").usage.prompt_cache_hit_tokens > 0
    assert chat(stack, messages, key="key-b").usage.prompt_cache_hit_tokens == 0
    with pytest.raises(Exception) as denied:
        chat(stack, messages, key="key-unknown")
    assert getattr(denied.value, "status_code", None) == 401


def _engine_loaded_tokens(stack, url):
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {stack.admin_token}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('deepinfer_engine_prefill_tokens_total{source="loaded"}'):
                return float(line.split()[-1])
    return 0.0


async def test_a_prefix_saved_through_one_engine_is_hit_through_the_other(stack):
    """Engine 0 computes and saves a prefix; engine 1 (pinned with the admin header, not by the router's
    choice) reads it from disk; engine 0 serves the repeat from its memory tier."""
    from openai import AsyncOpenAI
    aclient = AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="key-a", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": "Replica test. " + SYSTEM}, {"role": "user", "content": "Go"}]

    async def on(engine: int):
        pin = {"X-DeepInfer-Engine": str(engine), "X-DeepInfer-Admin-Token": stack.admin_token}
        reply = await aclient.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=4,
                                                      temperature=0, extra_headers=pin)
        return reply.usage.prompt_cache_hit_tokens, reply.choices[0].message.content

    before = [_engine_loaded_tokens(stack, u) for u in stack.engine_urls]
    first_hits, first = await on(0)
    wait_for_saves(stack)
    disk_hits, on_other = await on(1)
    memory_hits, again = await on(0)
    loaded = [a - b for a, b in zip([_engine_loaded_tokens(stack, u) for u in stack.engine_urls], before)]
    assert first_hits == 0 and disk_hits > 0 and memory_hits == disk_hits, (first_hits, disk_hits, memory_hits)
    assert loaded == [memory_hits, disk_hits], f"loaded tokens per engine {loaded}"
    assert on_other == first == again


def test_pinning_an_engine_needs_the_admin_token(stack):
    with pytest.raises(Exception) as refused:
        chat(stack, [{"role": "user", "content": "pin"}], max_tokens=2,
             extra_headers={"X-DeepInfer-Engine": "1", "X-DeepInfer-Admin-Token": "wrong"})
    assert getattr(refused.value, "status_code", None) == 403


def test_readme_curl_example_returns_usage(stack):
    command = curl_example(stack).replace("\\\n", " ")
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    body = json.loads(out.stdout)
    assert body["usage"]["prompt_tokens"] > 0 and "prompt_cache_hit_tokens" in body["usage"]
