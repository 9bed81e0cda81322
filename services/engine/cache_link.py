"""The engine's link to the latent cache (a BlockStore over mounted volumes and Redis, or the kvstore service's
client): an accelerator, not a dependency; while it is unreachable the engine serves misses and keeps retrying."""
from __future__ import annotations

import asyncio
import logging

from kvstore import BlockStore, CacheGeometry, PrefixIndex, open_redis
from kvstore.kv_events import BlockEvents
from kvstore.latent_format import cache_fingerprint, fp8_dims
from model.config import ModelConfig
from services.engine.config import EngineConfig

log = logging.getLogger(__name__)

RETRY_S = 2.0


class CacheLink:
    def __init__(self, cfg: EngineConfig, geometry: CacheGeometry, fingerprint: str, events: BlockEvents | None = None):
        self.cfg = cfg
        self.geometry = geometry
        self.fingerprint = fingerprint
        self.events = events  # the mounted index's disk events (remote: the kvstore service publishes them)
        self.store: BlockStore | None = None
        self.index: PrefixIndex | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def for_model(cls, cfg: EngineConfig, model: ModelConfig, fingerprint: str,
                  events: BlockEvents | None = None) -> "CacheLink":
        """The link to `model`'s cache in cfg's latent format: its geometry, its cache fingerprint."""
        geometry = CacheGeometry(model.num_layers, model.latent_dim, cfg.block_tokens, model.cache_dtype,
                                 fp8_dims(cfg.latent_format, model.latent_dim, model.qk_rope_head_dim))
        return cls(cfg, geometry, cache_fingerprint(fingerprint, cfg.latent_format), events)

    async def start(self) -> None:
        if self.cfg.caching:
            self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        if self.cfg.kvstore_url:
            from services.kvstore.client import KvstoreClient  # the HTTP client only where the cache is remote

            # remote: the kvstore service's client degrades to misses by itself while the service is down
            self.store = KvstoreClient(self.cfg.kvstore_url, self.geometry, self.fingerprint,
                                       read_ahead=self.cfg.read_ahead, service_token=self.cfg.service_token)
            return
        while self.store is None:
            try:
                index = PrefixIndex(open_redis(self.cfg.redis_url, self.cfg.redis_cluster,
                                               password=self.cfg.redis_password), self.cfg.index_prefix, self.events)
                if not await index.ping():
                    raise ConnectionError(f"redis at {self.cfg.redis_url} does not answer")
                self.store = await BlockStore.open(
                    self.cfg.volumes, self.geometry, self.fingerprint, index, mac_key=self.cfg.mac_key,
                    budget_bytes=self.cfg.budget_bytes or None, read_ahead=self.cfg.read_ahead)
                self.index = index
                log.info("latent cache connected: %d volumes, redis %s", len(self.cfg.volumes), self.cfg.redis_url)
            except Exception as error:  # noqa: BLE001 - any failure here means "serve misses, retry"
                log.warning("latent cache unavailable (%r); serving misses, retrying in %.0f s", error, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def ready(self) -> dict[str, bool]:
        if not self.cfg.caching:
            return {}
        if self.cfg.kvstore_url:
            return {"cache": await _answers(self.cfg.kvstore_url + "/healthz")}
        return {"cache": self.store is not None and self.index is not None and await self.index.ping()}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.store is not None:
            await self.store.close()


async def _answers(url: str) -> bool:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            async with session.get(url) as response:
                return response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False
