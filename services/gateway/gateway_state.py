"""Everything one gateway app holds, built at startup and torn down at cleanup."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvstore.index import PrefixIndex, open_redis
from kvstore.kv_view import KvView
from model.tokenizer_files import model_tokenizer_json
from services.gateway.config import GatewayConfig, api_keys
from services.gateway.engine_client import EngineClient
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_router import EngineRouter
from services.gateway.gateway_metrics import GatewayMetrics
from services.gateway.key_limits import KeyLimits
from services.gateway.prefix_lookup import PrefixLookup
from services.gateway.prompt_bound import PromptBound
from services.gateway.tenants import TenantKeys
from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import DeepSeekTokenizer, shared_tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    tokenizer: DeepSeekTokenizer
    token_cache: TokenCache
    tenants: TenantKeys
    metrics: GatewayMetrics
    prompt_bound: PromptBound
    limits: KeyLimits
    started_at: int = field(default_factory=lambda: int(time.time()))  # unix seconds
    session: aiohttp.ClientSession | None = None
    redis: object | None = None
    pool: EnginePool | None = None
    lookup: PrefixLookup | None = None
    router: EngineRouter | None = None
    view: KvView | None = None  # what each engine holds in memory, from the KV events

    @classmethod
    def build(cls, config: GatewayConfig) -> "GatewayState":
        tokenizer = shared_tokenizer(model_tokenizer_json(config.model_dir) or Path(config.tokenizer_json))
        return cls(config=config, tokenizer=tokenizer,
                   token_cache=TokenCache(tokenizer, config.token_cache_bytes),
                   tenants=TenantKeys(api_keys(config.api_keys), config.open_access, config.salt_key),
                   metrics=GatewayMetrics(), prompt_bound=PromptBound(tokenizer),
                   limits=KeyLimits(config.key_max_concurrent, config.key_tokens_per_minute))

    async def start(self, _app: web.Application | None = None) -> None:
        config = self.config
        # limit=0: the gateway's concurrency to engines is bounded by the engines' queues.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        session = self.session

        def connect(url: str) -> EngineClient:
            return EngineClient(url, session, config.admin_token, config.engine_connect_timeout_s,
                                config.first_token_timeout_s, service_token=config.service_token)
        self.pool = EnginePool(list(config.engines), connect, config.engine_poll_s)
        index = None
        if config.redis_url:
            self.redis = open_redis(config.redis_url, cluster=config.redis_cluster,
                                    password=config.redis_password)
            index = PrefixIndex(self.redis, config.index_prefix)
        self.lookup = PrefixLookup(index, config.lookup_timeout_s, self.metrics, config.admit_after,
                                   config.admit_window_s)
        if self.redis is not None and config.kv_events:
            self.view = KvView(self.redis, config.index_prefix)
            self.metrics.count_kv_view(self.view)
            self.view.start()
        self.router = EngineRouter(self.pool, self.lookup, self.metrics, config.default_max_tokens, self.view)
        await self.pool.start()
        log.info("gateway ready on %s:%d; engines %s (%d address(es)); prefix index %s", config.host,
                 config.port, list(config.engines) or "none", len(self.pool.engines),
                 config.redis_url or "disabled")

    async def stop(self, _app: web.Application | None = None) -> None:
        if self.view is not None:
            await self.view.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.session is not None:
            await self.session.close()
        if self.redis is not None:
            await self.redis.aclose()
