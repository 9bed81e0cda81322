"""A streaming client that times every token, and the serving metrics of vLLM's benchmark_serving.

Requests are /v1/completions calls with token-id prompts (so equal trace prefixes are equal token
prefixes), stream=True, temperature 0. Per request: TTFT (send -> first token), ITL (the gaps
between tokens), TPOT ((latency - TTFT) / (output tokens - 1)).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from typing import NamedTuple, Sequence

import aiohttp


class Result(NamedTuple):
    prompt_tokens: int
    output_tokens: int
    hit_tokens: int
    send_s: float  # on the run's clock
    ttft_s: float
    latency_s: float
    token_times_s: tuple[float, ...]  # arrival of each token, on the run's clock
    error: str  # "" when the request succeeded

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


class Client:
    """POSTs to an OpenAI-compatible /v1/completions (DeepInfer's gateway, or a peer's server)."""

    def __init__(self, base_url: str, model: str = "deepseek-chat", api_key: str = "bench",
                 extra_headers: dict | None = None, fresh_connections: bool = False):
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} | (extra_headers or {})
        self.clock0 = time.perf_counter()
        self._session: aiohttp.ClientSession | None = None
        # A connection per request: a peer that closes idle keep-alive connections (llama-server after
        # 5 s) would otherwise fail the request that reuses one.
        self.fresh_connections = fresh_connections

    def now(self) -> float:
        return time.perf_counter() - self.clock0

    async def __aenter__(self) -> "Client":
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=3600),
                                              connector=aiohttp.TCPConnector(limit=0, force_close=self.fresh_connections))
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def complete(self, prompt: list[int], max_tokens: int, headers: dict | None = None,
                       first_token: asyncio.Event | None = None, times: list[float] | None = None,
                       extra: dict | None = None, counts: list[int] | None = None) -> Result:
        """One streamed request; `times`, if given, receives each text chunk's arrival as it comes (so a
        request cancelled midway still shows when its tokens came), and `counts` the tokens each brought (by its
        logprobs, when `extra` asks for them; else 1: detokenization holds back a token that ends inside a
        character, which then arrives with the next); `extra`: more body fields (a peer's own)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}} | (extra or {})
        send = self.now()
        times = [] if times is None else times
        hit, output, error, finished = 0, 0, "", False
        try:
            async with self._session.post(self.url, json=body, headers=self.headers | (headers or {})) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        times.append(self.now())
                        if counts is not None:
                            counts.append(len((chunk["choices"][0].get("logprobs") or {}).get("tokens") or [0]))
                        if first_token is not None:
                            first_token.set()
                    usage = chunk.get("usage")
                    if usage:
                        finished = True
                        # DeepSeek's field, else OpenAI's (llama-server's)
                        hit = int(usage.get("prompt_cache_hit_tokens")
                                  or (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                        output = int(usage.get("completion_tokens") or len(times))
        except Exception as e:  # noqa: BLE001 - counted per request; the run goes on
            error = f"{type(e).__name__}: {e}"[:300]
        end = self.now()
        if first_token is not None:
            first_token.set()  # (also on failure: nobody waits forever)
        if error or (not times and not finished):
            return Result(len(prompt), 0, 0, send, math.nan, end - send, (), error or "no tokens")
        if not times:  # a whole answer with no text (its first token ended it: EOS): done, its TTFT its latency
            return Result(len(prompt), output, hit, send, end - send, end - send, (), "")
        # Detokenization can hold a token back (an incomplete UTF-8 sequence): count tokens, time chunks.
        return Result(len(prompt), max(output, len(times)), hit, send, times[0] - send, end - send, tuple(times), "")


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict:
    """Mean and nearest-rank percentiles (NaN for no values)."""
    ordered = sorted(v for v in values if v is not None and not math.isnan(v))
    out = {"mean": sum(ordered) / len(ordered) if ordered else math.nan}
    for q in qs:
        out[f"p{q}"] = ordered[max(1, math.ceil(len(ordered) * q / 100)) - 1] if ordered else math.nan
    return out


def summarize(results: Sequence[Result], duration_s: float) -> dict:
    """vLLM benchmark_serving's metrics over one run."""
    ok = [r for r in results if not r.error]
    output = sum(r.output_tokens for r in ok)
    return {"requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "duration_s": duration_s,
            "request_throughput": len(ok) / duration_s if duration_s else math.nan,
            "output_token_throughput": output / duration_s if duration_s else math.nan,
            "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": output,
            "hit_tokens": sum(r.hit_tokens for r in ok),
            "ttft_s": percentiles([r.ttft_s for r in ok]), "tpot_s": percentiles([r.tpot_s for r in ok]),
            "itl_s": percentiles([gap for r in ok for gap in r.itl_s]),
            "first_error": next((r.error for r in results if r.error), "")}


async def closed_loop(client: Client, sessions: Sequence[Sequence[tuple[list[int], int]]], concurrency: int
                      ) -> tuple[list[Result], float]:
    """`concurrency` users, each taking the next session and sending its turns one after another."""
    queue: asyncio.Queue = asyncio.Queue()
    for session in sessions:
        queue.put_nowait(session)
    results: list[Result] = []

    async def user() -> None:
        while not queue.empty():
            for prompt, max_tokens in queue.get_nowait():
                results.append(await client.complete(prompt, max_tokens))

    begin = client.now()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return results, client.now() - begin


async def poisson(client: Client, requests: Sequence[tuple[list[int], int]], rate: float, seed: int = 0
                  ) -> tuple[list[Result], float]:
    """Open loop: requests sent at exponential gaps of mean 1 / rate seconds, whatever is in flight."""
    import numpy as np
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(requests))
    begin = client.now()

    async def at(delay: float, prompt: list[int], max_tokens: int) -> Result:
        await asyncio.sleep(delay)
        return await client.complete(prompt, max_tokens)

    results = await asyncio.gather(*(at(float(t), p, m) for t, (p, m) in zip(np.cumsum(gaps), requests)))
    return list(results), client.now() - begin
