"""A stack a benchmark drives over HTTP: `BenchStack` starts, restarts and stops one on fixed ports and one data
dir; `GatewayDriver` sends it streamed requests, timed at the client, and reads the engine's and gateway's
Prometheus counters around each.

A restart stops every process (gateway, engine, kvstore, Valkey), drops the page cache, starts the same stack
again (same ports, data dir, volumes and durable index: Valkey's append-only file), waits for the kvstore's
start-time reconciliation pass (so it does not run beside the measured request) and drops the page cache once
more: a cold hit has to come from processes that never touched the prefix, since a running engine keeps the
segments it read mapped and dropping the page cache does not evict mapped pages.

The client is plain HTTP (http.client, as curl would be), not the openai client, whose time to build a request of
thousands of token ids is the client library's, not the serving stack's. The engine's done event carries
per-request timing, but the gateway does not pass it on, so the per-request breakdown comes from metric deltas
(exact while requests run one at a time, which the benches ensure).
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.kv_bench import free_port
from services.launcher import Stack, StackConfig

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


class Restart(NamedTuple):
    """Seconds of one restart."""
    stop_s: float  # SIGTERM to every process (gateway first, Valkey last) until all exited
    start_s: float  # new processes until every service answers /readyz (model load, compile-cache reads, warm-up)
    reconcile_s: float  # ready -> the kvstore's first reconciliation pass done
    dropped: bool  # the page cache was dropped (root only)


class BenchStack:
    """One stack on fixed ports and one data dir, started, restarted and stopped by the bench."""

    def __init__(self, preset: str, model_dir: Path, data_dir: Path, engines: int = 1):
        self.cfg = StackConfig(preset=preset, model_dir=str(model_dir), data_dir=str(data_dir), engines=engines,
                               gateway_port=free_port(), kvstore_port=free_port(), engine_port=free_port(),
                               redis_port=free_port(), ready_timeout_s=600)
        self.stack: Stack | None = None

    def start(self) -> float:
        """Starts the stack; seconds until every service is ready."""
        begin = time.perf_counter()
        self.stack = Stack(self.cfg, quiet=True).start()
        return time.perf_counter() - begin

    def stop(self) -> float:
        begin = time.perf_counter()
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        return time.perf_counter() - begin

    def restart(self, drop: Callable[[], bool]) -> Restart:
        stop_s = self.stop()
        dropped = drop()
        start_s = self.start()
        reconcile_s = self.wait_for_reconciliation()
        return Restart(stop_s, start_s, reconcile_s, dropped and drop())

    def wait_for_reconciliation(self, timeout_s: float = 300.0) -> float:
        """Blocks until the kvstore has finished a reconciliation pass; seconds waited."""
        begin = time.perf_counter()
        while True:
            state = json.loads(http_get(self.kvstore_url + "/admin/reconcile", self.admin_token))
            if state["passes"] >= 1 and not state["running"]:
                return time.perf_counter() - begin
            if time.perf_counter() - begin > timeout_s:
                raise TimeoutError(f"kvstore still reconciling after {timeout_s:.0f} s")
            time.sleep(0.05)

    @property
    def gateway_url(self) -> str:
        return self.stack.gateway_url

    @property
    def kvstore_url(self) -> str:
        return self.stack.kvstore_url

    @property
    def engine_urls(self) -> list[str]:
        return self.stack.engine_urls

    @property
    def admin_token(self) -> str:
        return self.stack.admin_token

    @property
    def engine_pid(self) -> int:
        return self.stack.procs["engine0"].pid

    @property
    def logs(self) -> Path:
        return Path(self.cfg.data_dir) / "logs"
