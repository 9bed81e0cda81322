"""GET /admin/dashboard.json: one snapshot of the whole stack's counters, for the /dashboard page.

The gateway reads its own registry, each engine's and the kvstore's /metrics (concurrently, 2 s
each; a service that does not answer is `"up": false`) and pings the prefix index. Counters are
cumulative, histograms are cumulative buckets: the page keeps a history of snapshots and turns
differences into rates, ratios and windowed quantiles, as Prometheus would.
"""
from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client import generate_latest

from services.common.metrics_text import Samples
from services.common.service_auth import bearer_headers
from services.gateway.gateway_state import GatewayState

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
# The memory tier's counter (the engine's paged pool keeps finished prefixes); without it every
# loaded token is a disk hit.
TIER_HIT_TOKENS = "deepinfer_engine_prefix_hit_tokens_total"
GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


async def _scrape(session: aiohttp.ClientSession, url: str, service_token: str) -> Samples | None:
    """A service's /metrics, read with the service token (the internal plane's credential)."""
    try:
        async with session.get(url + "/metrics", timeout=PROBE_TIMEOUT,
                               headers=bearer_headers(service_token)) as response:
            if response.status != 200:
                return None
            return Samples(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


def _buckets(samples: Samples, name: str) -> list[list[float | str]]:
    """[[upper bound s, cumulative count], ...]; the last bound is "+Inf" (JSON has no infinity)."""
    return [[bound if bound != float("inf") else "+Inf", count] for bound, count in samples.buckets(name)]


def gateway_numbers(samples: Samples) -> dict:
    requests = sum(samples.total("gateway_requests_total", endpoint=e) for e in GENERATION_ENDPOINTS)
    failed = sum(v for n, labels, v in samples.rows if n == "gateway_requests_total"
                 and labels.get("endpoint") in GENERATION_ENDPOINTS and labels.get("status", "").startswith("5"))
    return {"requests": requests, "failed_requests": failed,
            "prompt_tokens_hit": samples.total("gateway_prompt_tokens_total", cache="hit"),
            "prompt_tokens_miss": samples.total("gateway_prompt_tokens_total", cache="miss"),
            "completion_tokens": samples.total("gateway_completion_tokens_total"),
            "in_flight": samples.total("gateway_requests_in_flight"),
            "ttft_buckets": _buckets(samples, "gateway_time_to_first_token_seconds"),
            "tpot_buckets": _buckets(samples, "gateway_time_per_output_token_seconds")}


def engine_numbers(url: str, samples: Samples | None) -> dict:
    if samples is None:
        return {"url": url, "up": False}
    loaded = samples.total("deepinfer_engine_prefill_tokens_total", source="loaded")
    tiers = samples.by(TIER_HIT_TOKENS, "tier") or {"disk": loaded}
    pool = {n: v for n, labels, v in samples.rows if n.startswith("deepinfer_engine_pool_") and not labels}
    return {"url": url, "up": True,
            "prompt_tokens": samples.total("deepinfer_engine_prefill_tokens_total"),
            "hit_tokens": {"memory": tiers.get("memory", 0.0), "disk": tiers.get("disk", 0.0)},
            "loaded_bytes": samples.total("deepinfer_engine_loaded_bytes_total"),
            "generated_tokens": samples.total("deepinfer_engine_generated_tokens_total"),
            "queue_depth": samples.total("deepinfer_engine_queue_depth"),
            "in_flight": samples.total("deepinfer_engine_in_flight"),
            "pool": pool}


def kvstore_numbers(url: str, samples: Samples | None) -> dict:
    if not url:
        return {"url": "", "up": False, "configured": False}
    if samples is None:
        return {"url": url, "up": False, "configured": True}
    used = samples.by("kvstore_volume_used_bytes", "volume")
    budget = samples.by("kvstore_volume_budget_bytes", "volume")
    tenant_used = samples.by("kvstore_tenant_bytes", "tenant")
    quota = samples.by("kvstore_tenant_quota_bytes", "tenant")
    return {"url": url, "up": True, "configured": True,
            "volumes": [{"id": vid, "used_bytes": used[vid], "budget_bytes": budget.get(vid, 0.0)}
                        for vid in sorted(used)],
            "tenants": [{"tenant": t, "used_bytes": tenant_used.get(t, 0.0), "quota_bytes": quota.get(t, 0.0)}
                        for t in sorted(set(tenant_used) | set(quota))],
            "bytes_read": samples.total("kvstore_bytes_read_total"),
            "bytes_written": samples.total("kvstore_bytes_written_total"),
            "write_failures": samples.total("kvstore_write_failures_total"),
            "verification_failures": samples.total("kvstore_verification_failures_total"),
            "evictions": samples.total("kvstore_evictions_total")}


async def dashboard_snapshot(state: GatewayState) -> dict:
    config = state.config
    engine_urls = [engine.client.url for engine in state.pool.engines]  # each replica behind a name
    engine_scrapes = [_scrape(state.session, url, config.service_token) for url in engine_urls]
    kvstore_url = config.kvstore_url.rstrip("/")
    scraped = await asyncio.gather(*engine_scrapes, _scrape(state.session, kvstore_url, config.service_token) if kvstore_url
                                   else asyncio.sleep(0), state.lookup.ready())
    engines, kvstore, redis_ready = scraped[:-2], scraped[-2], scraped[-1]
    return {"time": time.time(),
            "gateway": gateway_numbers(Samples(generate_latest(state.metrics.registry).decode())),
            "engines": [engine_numbers(url, samples) for url, samples in zip(engine_urls, engines)],
            "kvstore": kvstore_numbers(kvstore_url, kvstore),
            "redis": {"configured": bool(config.redis_url), "ready": bool(redis_ready)}}
