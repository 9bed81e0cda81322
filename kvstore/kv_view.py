"""KvView: which blocks each engine holds in its memory tier, as the KV event stream (kv_events.py) tells.

A view reads the stream from its start, asks every engine for its whole set (INCR of the resync counter), then
follows the stream (XREAD BLOCK). Several views (gateways) read one stream; none writes to it.

Invariants: an engine is in the view from its first memory event (or AllBlocksCleared) until its lease lapses. The
view of an engine is complete from an AllBlocksCleared on while the engine's batch numbers follow each other; an
engine first seen without one (its announcement was trimmed away) or whose numbers skip (entries trimmed before this
view read them, or lost) is incomplete, and the view asks for a resync (at most every RESYNC_RETRY_S) until that
engine announces again. An incomplete view still routes with what it has.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Sequence

import redis.asyncio as redis

from .kv_events import MEMORY, AllBlocksCleared, BlockStored, EventKeys, decode_batch

log = logging.getLogger(__name__)

PAGE = 1000  # entries per read
READ_BLOCK_MS = 1000  # below the client's socket timeout
LEASE_CHECK_S = 2.0
RESYNC_RETRY_S = 10.0
RETRY_S = 1.0  # after Redis failed a read


class KvView:
    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str) -> None:
        self.redis, self.keys = client, EventKeys.under(prefix)
        self.applied: Counter[tuple[str, str]] = Counter()  # (event type, medium) -> events applied
        self.malformed = 0  # entries skipped
        self.resyncs = 0  # resync requests sent
        self.loaded = False  # the stream was read up to where this view started
        self._memory: dict[str, set[bytes]] = {}  # engine id -> block hashes in its memory tier
        self._seq: dict[str, int] = {}  # engine id -> its last batch number read
        self._incomplete: set[str] = set()
        self._last_id = b"0-0"
        self._resync_at = self._leases_at = 0.0  # monotonic seconds of the last request and check
        self._task: asyncio.Task | None = None
        self._stopping = False

    def held(self, engine: str) -> int:
        """Blocks `engine` holds in memory."""
        return len(self._memory.get(engine, ()))

    def leading_run(self, engine: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` `engine` holds in memory."""
        held, run = self._memory.get(engine, ()), 0
        while run < len(hashes) and hashes[run] in held:
            run += 1
        return run

    @property
    def engines(self) -> int:
        return len(self._memory)

    @property
    def blocks(self) -> int:
        return sum(len(held) for held in self._memory.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the reading after its current read (blocking reads return within READ_BLOCK_MS)."""
        self._stopping = True
        if self._task is not None and not (await asyncio.wait({self._task}, timeout=timeout_s))[0]:
            self._task.cancel()  # only now: a read cancelled mid-way may leave the client waiting for its answer

    async def _follow(self) -> None:
        failing = False
        while not self._stopping:
            try:
                if not self.loaded:
                    await self._read_all()
                    await self._request_resync()
                    await self._check_leases()
                    self.loaded = True
                    log.info("KV events: view loaded, %d engines, %d blocks", self.engines, self.blocks)
                await self._read_new()
                now = time.monotonic()
                if now - self._leases_at >= LEASE_CHECK_S:
                    await self._check_leases()
                if self._incomplete and now - self._resync_at >= RESYNC_RETRY_S:
                    await self._request_resync()
                if failing:
                    log.info("KV events: Redis answers again")
                    failing = False
            except Exception as error:  # noqa: BLE001 - Redis down: the router goes on with what it knows
                if not failing:
                    log.warning("KV events: cannot read the stream (%r); retrying every %.0f s", error, RETRY_S)
                    failing = True
                await asyncio.sleep(RETRY_S)

    async def _read_all(self) -> None:
        start = b"-"
        while True:
            entries = await self.redis.xrange(self.keys.stream, min=start, max="+", count=PAGE)
            for entry_id, fields in entries:
                self._apply(entry_id, fields)
            if len(entries) < PAGE:
                return
            start = b"(" + self._last_id

    async def _read_new(self) -> None:
        answer = await self.redis.xread({self.keys.stream: self._last_id}, count=PAGE, block=READ_BLOCK_MS)
        for _, entries in answer or ():
            for entry_id, fields in entries:
                self._apply(entry_id, fields)

    def _apply(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        self._last_id = entry_id
        try:
            batch = decode_batch(fields)
        except ValueError as error:
            self.malformed += 1
            log.warning("KV events: entry %s skipped: %s", entry_id, error)
            return
        engine, events = batch.source, batch.events
        announced = bool(events) and isinstance(events[0], AllBlocksCleared)
        last = self._seq.get(engine)
        if engine in self._memory and last is not None and batch.seq != last + 1 and not announced:
            self._incomplete.add(engine)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self._memory[engine] = set()
                self._incomplete.discard(engine)
                self.applied["AllBlocksCleared", MEMORY] += 1
                continue
            self.applied[type(event).__name__, event.medium] += 1
            if event.medium != MEMORY:
                continue  # the disk is shared: the index answers for it
            if engine not in self._memory:  # its earlier events were trimmed or read by no one
                self._memory[engine] = set()
                self._incomplete.add(engine)
            if isinstance(event, BlockStored):
                self._memory[engine].update(event.block_hashes)
            else:
                self._memory[engine].difference_update(event.block_hashes)
        if engine in self._memory:
            self._seq[engine] = batch.seq

    async def _request_resync(self) -> None:
        self._resync_at = time.monotonic()
        await self.redis.incr(self.keys.resync)
        self.resyncs += 1

    async def _check_leases(self) -> None:
        """Drops the engines whose lease lapsed."""
        self._leases_at = time.monotonic()
        engines = list(self._memory)
        if not engines:
            return
        pipe = self.redis.pipeline(transaction=False)
        for engine in engines:
            pipe.exists(self.keys.lease(engine))
        for engine, alive in zip(engines, await pipe.execute()):
            if not alive:
                log.info("KV events: engine %s's lease lapsed; %d blocks dropped from the view", engine,
                         self.held(engine))
                del self._memory[engine]
                self._seq.pop(engine, None)
                self._incomplete.discard(engine)
