"""Per-tenant byte quotas on the volumes: where they are kept, and eviction inside the tenant first.

The kvstore service's configuration is the source (a default and a tenant -> GiB map); it publishes
them to Redis, so every writer (the kvstore service, and engines writing to mounted volumes) enforces
the same quotas without their own flags. Key layout (hash tag {tenants}, beside fence.py's):
  p:{tenants}:quota          hash    tenant -> bytes (0: no quota for that tenant)
  p:{tenants}:quota-default  string  bytes of every tenant not in the hash (absent or 0: no quota)
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import TYPE_CHECKING, AsyncIterator, Awaitable

import redis.asyncio as redis

if TYPE_CHECKING:
    from .store import BlockStore

GiB = 1 << 30
REFRESH_S = 5.0  # a changed quota reaches every writer within this


def parse_quotas(spec: str) -> dict[str, float]:
    """"tenantA=2,tenantB=0.5" -> {"tenantA": 2.0, "tenantB": 0.5} (GiB); ValueError naming a bad entry."""
    quotas: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        tenant, sep, gib = entry.rpartition("=")
        try:
            quotas[tenant] = float(gib)
        except ValueError:
            sep = ""
        if not sep or not tenant or quotas.get(tenant, -1) < 0:
            raise ValueError(f"tenant quotas entry {entry!r} must look like TENANT=GIB (GIB >= 0)")
    return quotas


class TenantQuotas:
    """Invariant (one writer process): a tenant's live bytes never exceed its quota once a save of it
    publishes, since the bytes of its saves in flight are reserved before they are written and its
    least recently hit segments are evicted first to make room."""

    def __init__(self, store: "BlockStore") -> None:
        self.store = store
        prefix = store.index.prefix
        self.key, self.default_key = f"{prefix}:{{tenants}}:quota", f"{prefix}:{{tenants}}:quota-default"
        self._known: tuple[float, int, dict[str, int]] = (-REFRESH_S, 0, {})  # (read at, default, map)
        self._reserved: Counter[str] = Counter()  # bytes of saves in flight in this process, per tenant
        self._turns: dict[str, asyncio.Condition] = {}

    async def publish(self, default_bytes: int, quotas: dict[str, int]) -> None:
        """Replace the quotas every writer enforces."""
        pipe = self.store.index.redis.pipeline(transaction=True)
        pipe.delete(self.key)
        if quotas:
            pipe.hset(self.key, mapping=quotas)
        pipe.set(self.default_key, default_bytes)
        await pipe.execute()
        self._known = (-REFRESH_S, 0, {})

    async def of(self, tenant: str) -> int:
        """`tenant`'s quota in bytes; 0: none."""
        read_at, default, quotas = self._known
        if time.monotonic() - read_at >= REFRESH_S:
            client: redis.Redis = self.store.index.redis
            raw_map, raw_default = await asyncio.gather(client.hgetall(self.key), client.get(self.default_key))
            default, quotas = int(raw_default or 0), {k.decode(): int(v) for k, v in raw_map.items()}
            self._known = (time.monotonic(), default, quotas)
        return quotas.get(tenant, default)

    async def all(self) -> tuple[int, dict[str, int]]:
        """(default bytes, tenant -> bytes) as last read."""
        await self.of("")
        return self._known[1], dict(self._known[2])

    @contextlib.asynccontextmanager
    async def room(self, tenant: str, incoming: int) -> AsyncIterator["Reservation"]:
        """Hold `incoming` bytes of `tenant`'s quota while a save writes and publishes them; evicts the
        tenant's least recently hit segments (any volume) until they fit. Waits while only the
        tenant's other saves in flight hold the rest of its quota."""
        quota = await self.of(tenant)
        if not quota:
            yield Reservation(self, tenant, None, 0)
            return
        from .store import SegmentWriteError
        if incoming > quota:
            raise SegmentWriteError(f"a save of {incoming} bytes exceeds tenant {tenant!r}'s quota of {quota}")
        turn = self._turns.setdefault(tenant, asyncio.Condition())
        ledger, volumes, evicted = self.store.ledger, list(self.store.volumes), 0
        async with turn:
            while await ledger.tenant_used(volumes, tenant) + self._reserved[tenant] + incoming > quota:
                least = [(found[1], v, found[0]) for v in volumes
                         if (found := await ledger.tenant_least_recent(v, tenant)) is not None]
                if least:
                    _, vid, record = min(least, key=lambda found: found[0])
                    evicted += await self.store.capacity.retire(vid, record)
                elif self._reserved[tenant]:
                    await turn.wait()
                else:
                    break  # nothing of it is live or in flight: what the ledger counts is stale
            self._reserved[tenant] += incoming
        self.store.stats.evictions += evicted
        held = Reservation(self, tenant, turn, incoming)
        try:
            yield held
        finally:
            async with turn:
                self._reserved[tenant] -= held.left
                turn.notify_all()


    async def trim(self, tenant: str) -> int:
        """After a save: evicts `tenant`'s least recently hit segments while its live bytes exceed its quota
        (each writer process reserves only its own saves, so several writers together can pass the quota by
        their saves in flight); returns the bytes evicted."""
        quota = await self.of(tenant)
        if not quota:
            return 0
        ledger, volumes, evicted = self.store.ledger, list(self.store.volumes), 0
        async with self._turns.setdefault(tenant, asyncio.Condition()):
            while await ledger.tenant_used(volumes, tenant) > quota:
                least = [(found[1], v, found[0]) for v in volumes
                         if (found := await ledger.tenant_least_recent(v, tenant)) is not None]
                if not least:
                    break
                _, vid, record = min(least, key=lambda found: found[0])
                evicted += await self.store.capacity.retire(vid, record)
        self.store.stats.evictions += evicted
        return evicted


class Reservation:
    """Bytes of one save held in its tenant's quota until the ledger counts them."""

    def __init__(self, quotas: TenantQuotas, tenant: str, turn: asyncio.Condition | None, held: int) -> None:
        self.quotas, self.tenant, self.turn, self.left = quotas, tenant, turn, held

    async def counted(self, reserved: int, add: Awaitable[None]) -> None:
        """Await `add` (the ledger counting a segment held as `reserved` bytes) and stop holding them, in
        the tenant's turn: a save making room never counts a segment both live and in flight."""
        if self.turn is None:
            return await add
        async with self.turn:
            await add
            reserved = min(reserved, self.left)
            self.quotas._reserved[self.tenant] -= reserved
            self.left -= reserved
