"""ttft_bench, the client side: streamed requests through the gateway, timed at the client, and the
engine's and gateway's Prometheus counters read around each request.

The client is plain HTTP (http.client, as curl would be): the openai Python client spends ~157 ms
building a request whose prompt is 16K token ids (measured against a server that answers at once,
1.5 ms with plain HTTP), which is the client library's time, not the serving stack's.

The engine's NDJSON done event carries per-request timing, but the gateway does not pass it on to
the client, so the per-request breakdown comes from metric deltas (exact while requests run one at
a time, which the bench ensures).
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse
import urllib.request
from typing import NamedTuple

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

# Token ids well inside the DeepSeek vocabulary and below its special tokens (128K+).
FIRST_ID, LAST_ID = 1_000, 100_000

ENGINE_TTFT_SUM = "deepinfer_engine_ttft_seconds_sum"
ENGINE_STALL = "deepinfer_engine_prefetch_stall_seconds_total"
ENGINE_LOADED_BYTES = "deepinfer_engine_loaded_bytes_total"
ENGINE_LOADED_TOKENS = 'deepinfer_engine_prefill_tokens_total{source="loaded"}'
ENGINE_FALLBACKS = "deepinfer_engine_cache_fallbacks_total"
GATEWAY_TTFT_SUM = "gateway_time_to_first_token_seconds_sum"


class Timed(NamedTuple):
    """One streamed request. Seconds; the *_s deltas come from the services' counters."""
    client_ttft_s: float  # request sent -> first SSE chunk received, at the client
    first_chunk_text: bool  # False: the first token decoded to no text yet (the chunk came at the end)
    cached_tokens: int  # usage.prompt_cache_hit_tokens
    gateway_ttft_s: float  # gateway: request arrival -> first token from the engine
    engine_ttft_s: float  # engine: job start -> first token sampled (prefetch + prefill, stall included)
    stall_s: float  # engine: compute waiting for prefix latents from disk
    loaded_bytes: float
    loaded_tokens: float
    fallbacks: float  # hits the engine cut short (verification failure or prefetch deadline)
    engine_cpu_s: float | None  # CPU time the engine process used meanwhile (vs wall time: contention)


def http_get(url: str, token: str = "", timeout_s: float = 10.0) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
        return response.read()


def _post(url: str, token: str = "", timeout_s: float = 30.0) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=b"", headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


def scrape(url: str, token: str = "") -> dict[str, float]:
    """Every sample of a /metrics page (read with the admin token: the engines' needs a token), keyed
    `name` or `name{label="value",...}`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http_get(url + "/metrics", token).decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _total(samples: dict[str, float], name: str) -> float:
    """A metric summed over its label sets (`name` exact, or every `name{...}`)."""
    if "{" in name:
        return samples.get(name, 0.0)
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


class GatewayDriver:
    """Drives one stack: the gateway for requests, its engines for metrics and pending saves."""

    def __init__(self, gateway_url: str, admin_token: str, engine_urls: list[str] | None = None,
                 api_key: str = "bench", model: str = "deepseek-chat", seed: int | None = None,
                 engine_pid: int | None = None):
        self.gateway_url, self.admin_token, self.model = gateway_url.rstrip("/"), admin_token, model
        self.engine_urls = engine_urls or self._engines_from_gateway()
        address = urllib.parse.urlsplit(self.gateway_url)
        self.host, self.port, self.api_key = address.hostname, address.port or 80, api_key
        self.rng = np.random.default_rng(seed if seed is not None else time.time_ns())
        self.engine_pid = engine_pid

    def _engines_from_gateway(self) -> list[str]:
        stats = json.loads(http_get(self.gateway_url + "/admin/stats", self.admin_token))
        return [engine["url"] for engine in stats["engines"]]

    def fresh_tokens(self, n: int) -> list[int]:
        """n random token ids: a prefix nobody has sent before (P(repeat of a 64-token block) ~ 0)."""
        return self.rng.integers(FIRST_ID, LAST_ID, n).tolist()

    def drop_memory_tier(self) -> None:
        """Empties every engine's memory tier, so the next hit reads its prefix from disk."""
        for url in self.engine_urls:
            _post(url + "/admin/memory-tier/drop", self.admin_token)

    def pending_saves(self) -> int:
        return sum(json.loads(http_get(url + "/admin/stats", self.admin_token))["pending_saves"]
                   for url in self.engine_urls)

    def wait_for_saves(self, timeout_s: float = 300.0) -> float:
        """Blocks until no engine has a save in flight (so its index entries are published); seconds waited."""
        begin = time.perf_counter()
        while self.pending_saves():
            if time.perf_counter() - begin > timeout_s:
                raise TimeoutError(f"engines still saving after {timeout_s:.0f} s")
            time.sleep(0.05)
        return time.perf_counter() - begin

    def _counters(self) -> dict[str, float]:
        engines = [scrape(url, self.admin_token) for url in self.engine_urls]
        gateway = scrape(self.gateway_url, self.admin_token)
        total = {name: sum(_total(s, name) for s in engines)
                 for name in (ENGINE_TTFT_SUM, ENGINE_STALL, ENGINE_LOADED_BYTES, ENGINE_LOADED_TOKENS,
                              ENGINE_FALLBACKS)}
        total[GATEWAY_TTFT_SUM] = _total(gateway, GATEWAY_TTFT_SUM)
        return total

    def complete(self, tokens: list[int]) -> Timed:
        """One streamed /v1/completions request generating one token; times the first chunk."""
        body = json.dumps({"model": self.model, "prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        before = self._counters()
        cpu_before = cpu_seconds(self.engine_pid)
        connection = http.client.HTTPConnection(self.host, self.port, timeout=900)
        try:
            begin = time.perf_counter()
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                                 "Authorization": f"Bearer {self.api_key}"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
            first_s, first_text, usage = None, False, None
            for line in response:  # SSE: "data: {chunk}" lines, then "data: [DONE]"
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first_s is None:
                    first_s = time.perf_counter() - begin
                    first_text = bool(chunk.get("choices") and chunk["choices"][0].get("text"))
                usage = chunk.get("usage") or usage
        finally:
            connection.close()
        cpu_after = cpu_seconds(self.engine_pid)
        after = self._counters()
        delta = {name: after[name] - before[name] for name in after}
        cached = int(usage.get("prompt_cache_hit_tokens") or 0) if usage is not None else -1
        return Timed(first_s, first_text, cached, delta[GATEWAY_TTFT_SUM], delta[ENGINE_TTFT_SUM],
                     delta[ENGINE_STALL], delta[ENGINE_LOADED_BYTES], delta[ENGINE_LOADED_TOKENS],
                     delta[ENGINE_FALLBACKS], None if cpu_before is None else cpu_after - cpu_before)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (/proc/<pid>/stat), or None."""
    if not pid:
        return None
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def peak_rss_bytes(pid: int) -> int | None:
    """VmHWM (peak resident set) of a process, or None when it cannot be read."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
