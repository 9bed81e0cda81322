"""Live replay: trace requests sent through a running gateway at their (time-scaled) arrival times.

Each request is a streaming /v1/completions call whose prompt is token ids (hash id h -> a fixed
run of ids seeded by h, bench.trace_format), so equal trace prefixes are equal token prefixes.
TTFT is client-side: from sending the request to the first streamed chunk. Requests run
concurrently, as they arrive; none is retried.
"""
from __future__ import annotations

import asyncio
import time
from typing import NamedTuple, Sequence

from openai import AsyncOpenAI
from tqdm import tqdm

from .trace_format import TraceRequest, prompt_token_ids

# Prompt token ids: ordinary vocabulary, clear of BOS/EOS (0, 1) and the special tokens at the top.
TOKEN_RANGE = (1_000, 100_000)


class LiveRequest(NamedTuple):
    index: int
    arrival_s: float          # scheduled send time, from the replay's start
    prompt_tokens: int
    hit_tokens: int           # usage.prompt_cache_hit_tokens
    completion_tokens: int
    ttft_s: float             # send -> first streamed chunk
    latency_s: float          # send -> end of stream
    error: str                # "" when the request succeeded


async def _one(client: AsyncOpenAI, model: str, index: int, arrival_s: float, prompt: list[int],
               max_tokens: int) -> LiveRequest:
    begin = time.perf_counter()
    ttft, usage = None, None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - begin
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None:
            raise RuntimeError("the stream ended without usage")
    except Exception as error:  # noqa: BLE001 - reported per request, the replay goes on
        return LiveRequest(index, arrival_s, len(prompt), 0, 0, float("nan"), time.perf_counter() - begin,
                           f"{type(error).__name__}: {error}"[:300])
    hit = int(getattr(usage, "prompt_cache_hit_tokens", 0) or 0)
    return LiveRequest(index, arrival_s, len(prompt), hit, usage.completion_tokens, ttft,
                       time.perf_counter() - begin, "")


async def replay_live(gateway_url: str, requests: Sequence[TraceRequest], hash_tokens: int, time_scale: float,
                      model: str = "deepseek-chat", api_key: str = "none", progress: bool = True) -> list[LiveRequest]:
    """Sends request i at (timestamp_i - timestamp_0) / time_scale seconds; returns results in trace order."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    client = AsyncOpenAI(base_url=gateway_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    prompts = [prompt_token_ids(r, hash_tokens, TOKEN_RANGE) for r in requests]
    t0 = requests[0].timestamp_ms if requests else 0
    bar = tqdm(total=len(requests), desc="live replay", unit="req", disable=not progress)
    start = time.perf_counter()

    async def scheduled(i: int, request: TraceRequest) -> LiveRequest:
        arrival = (request.timestamp_ms - t0) / 1000 / time_scale
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        result = await _one(client, model, i, arrival, prompts[i], request.output_length)
        bar.update(1)
        return result

    try:
        return list(await asyncio.gather(*(scheduled(i, r) for i, r in enumerate(requests))))
    finally:
        bar.close()
        await client.close()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]
