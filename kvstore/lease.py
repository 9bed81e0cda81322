"""VolumeLease: at most one holder per volume at a time (one reconciler), as a key in Redis.

Key: p:{vol:<id>}:reconciler -> holder token, with a TTL (the same hash tag as the volume's
ledger). The holder renews it while working; a holder that dies lets it lapse after `ttl_s`,
and only the holder's token can renew or release it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import AsyncIterator

import redis.asyncio as redis

log = logging.getLogger(__name__)

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class VolumeLease:
    """Invariant: while `held` is set, no other VolumeLease on the same Redis holds the volume
    (up to the renewal period: a holder that cannot renew stops at its next check of `held`)."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str, volume: str,
                 ttl_s: float = 30.0) -> None:
        self.redis = client
        self.key = f"{prefix}:{{vol:{volume}}}:reconciler"
        self.ttl_ms = int(ttl_s * 1000)
        self.token = secrets.token_hex(8)
        self.held = asyncio.Event()
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    async def holder(self) -> str | None:
        value = await self.redis.get(self.key)
        return None if value is None else value.decode()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[bool]:
        """Try to take the lease; yields whether it was taken. Renewed every ttl/3 until the block ends."""
        if not await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            yield False
            return
        self.held.set()
        renewer = asyncio.create_task(self._keep())
        try:
            yield True
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            self.held.clear()
            try:
                await self._release(keys=[self.key], args=[self.token])
            except Exception:  # Redis gone: the lease lapses by itself after its TTL
                log.warning("could not release %s; it lapses after %d ms", self.key, self.ttl_ms)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                renewed = await self._renew(keys=[self.key], args=[self.token, self.ttl_ms])
            except Exception:  # Redis unreachable: we cannot know we still hold it
                renewed = 0
            if not renewed:
                log.warning("lost the lease %s", self.key)
                self.held.clear()
                return
