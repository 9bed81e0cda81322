"""KV events: which blocks each source (an engine, a kvstore) stores and removes, per tier, on one Redis stream.

The events have the shape of vLLM's (vllm/distributed/kv_events.py), in batches with a timestamp:
  BlockStored{block_hashes, parent_block_hash, token_count, block_size, lora_id, medium}
  BlockRemoved{block_hashes, medium}
  AllBlocksCleared{}: the source's memory tier is empty (the disk is shared: no source clears it)
BlockStored carries a token count where vLLM has token ids: tenants' text never lands in a shared stream. A block
hash is the index's (chained, tenant-salted, 16 bytes; raw bytes in msgpack). Media: "memory" (an engine's memory
tier) and "disk" (index entries of durable blocks; entries that expire by TTL leave without an event).

Keys (prefix p; one hash tag, so a Redis Cluster keeps them on one shard):
  p:{kv-events}:stream          entries {source, seq, batch}: the source's id (an engine's engine_id), its batch
                                number (from 0, +1 per batch), the msgpack batch {ts, events}; XADD MAXLEN ~ max_len
  p:{kv-events}:resync          a counter a starting reader INCRs to ask every engine for its whole set
  p:{kv-events}:lease:<source>  an engine's lease: TTL lease_s, renewed every lease_s / 3
An engine (a publisher with a lease) announces its whole memory set, AllBlocksCleared then one BlockStored of every
block it holds, on start, when the resync counter moves, when its lease had lapsed, and after a batch was lost.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from typing import NamedTuple, Protocol, Sequence

import msgpack
import redis.asyncio as redis

log = logging.getLogger(__name__)

MEMORY, DISK = "memory", "disk"
FLUSH_S = 0.05  # a publisher appends what its sources queued this often
RETRY_S = 1.0  # while Redis is down, a publisher tries this often (and drops what comes meanwhile)


class BlockStored(NamedTuple):
    block_hashes: tuple[bytes, ...]  # a chain continuing from parent_block_hash (an announcement: any order)
    parent_block_hash: bytes | None
    token_count: int
    block_size: int                  # tokens per block
    lora_id: int | None
    medium: str


class BlockRemoved(NamedTuple):
    block_hashes: tuple[bytes, ...]
    medium: str


class AllBlocksCleared(NamedTuple):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class EventBatch(NamedTuple):
    source: str
    seq: int
    ts: float  # unix seconds
    events: tuple[KvEvent, ...]


def encode_batch(batch: EventBatch) -> dict[str, str | int | bytes]:
    """The stream entry's fields."""
    events = [{"type": type(event).__name__, **event._asdict()} for event in batch.events]
    return {"source": batch.source, "seq": batch.seq, "batch": msgpack.packb({"ts": batch.ts, "events": events})}


def decode_batch(fields: dict[bytes, bytes]) -> EventBatch:
    """A stream entry's batch; ValueError if malformed. Event types this version does not know are skipped."""
    try:
        body = msgpack.unpackb(fields[b"batch"])
        events = []
        for raw in body["events"]:
            cls = _EVENT_TYPES.get(raw.get("type"))
            if cls is not None:
                values = {name: raw[name] for name in cls._fields}
                if "block_hashes" in values:
                    values["block_hashes"] = tuple(values["block_hashes"])
                events.append(cls(**values))
        return EventBatch(fields[b"source"].decode(), int(fields[b"seq"]), float(body["ts"]), tuple(events))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"malformed KV event entry: {error!r}") from None


class EventKeys(NamedTuple):
    stream: str
    resync: str
    lease_prefix: str

    @classmethod
    def under(cls, prefix: str) -> "EventKeys":
        tag = f"{prefix}:{{kv-events}}:"
        return cls(tag + "stream", tag + "resync", tag + "lease:")

    def lease(self, source: str) -> str:
        return self.lease_prefix + source


class BlockEvents(Protocol):
    """Where a tier reports the blocks it stores and removes: from any thread, never blocking."""

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, medium: str) -> None: ...

    def removed(self, hashes: Sequence[bytes], medium: str) -> None: ...


class EventPublisher:
    """A source's KV events: queued from any thread (BlockEvents), appended to the stream from the event loop.

    With `lease_s` (an engine) the publisher holds the source's lease and announces the source's memory set when
    needed (see the module docstring); it mirrors that set from the events it sends. Without (a kvstore service),
    it only appends. A batch Redis refuses is dropped and counted, never retried: an engine announces instead.
    """

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str, source: str, block_tokens: int,
                 max_len: int, lease_s: float | None = None) -> None:
        self.redis, self.keys, self.source = client, EventKeys.under(prefix), source
        self.block_tokens, self.max_len, self.lease_s = block_tokens, max_len, lease_s
        self.held: set[bytes] = set()  # the memory set the stream has been told (event loop)
        self.published = self.dropped = 0  # events
        self._queue: deque[KvEvent] = deque()  # append and popleft are atomic: any thread may append
        self._seq = 0
        self._announce = lease_s is not None
        self._leased = False  # the lease was set once: finding it gone means it lapsed
        self._resync: bytes | None = None  # the resync counter as last read
        self._down = False
        self._retry_at = 0.0  # while down: the next try (monotonic seconds)
        self._task: asyncio.Task | None = None
        self._closed = False

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, medium: str) -> None:
        if hashes:
            self._queue.append(BlockStored(tuple(hashes), parent, len(hashes) * self.block_tokens,
                                           self.block_tokens, None, medium))

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        if hashes:
            self._queue.append(BlockRemoved(tuple(hashes), medium))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self, timeout_s: float = 2.0) -> None:
        """Appends what is queued; an engine then says its memory tier is gone and gives its lease back."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None and not (await asyncio.wait({self._task}, timeout=timeout_s))[0]:
            self._task.cancel()  # only now: a Redis call cancelled mid-way may leave its client waiting
        events = self._drain()
        if self.lease_s is not None:
            events.append(AllBlocksCleared())

        async def goodbye() -> None:
            await self._append(events)
            if self.lease_s is not None:
                await self.redis.delete(self.keys.lease(self.source))
        said = asyncio.ensure_future(goodbye())
        done, _ = await asyncio.wait({said}, timeout=timeout_s)
        if not done or said.exception() is not None:  # shutting down: a lease lapses by itself
            log.info("KV events: could not say goodbye (%r)", said.exception() if done else "timed out")

    async def _run(self) -> None:
        renew_at = 0.0
        while not self._closed:
            if self.lease_s is not None and time.monotonic() >= renew_at:
                renew_at = time.monotonic() + self.lease_s / 3
                await self._renew()
            await self.flush()
            await asyncio.sleep(FLUSH_S)

    async def _renew(self) -> None:
        """Renews the lease and reads the resync counter: a lapsed lease or a moved counter makes an announcement."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self.keys.lease(self.source), self.source, px=math.ceil(self.lease_s * 1000), get=True)
            pipe.get(self.keys.resync)
            previous, counter = await pipe.execute()
        except Exception as error:  # noqa: BLE001 - Redis down: the flush notices too
            self._note_down(error)
            return
        self._note_up()
        if (previous is None and self._leased) or (self._leased and counter != self._resync):
            self._announce = True
        self._leased, self._resync = True, counter

    async def flush(self) -> None:
        """Appends the queued events as one batch, after an announcement when one is due."""
        events = self._drain()
        if self._down and time.monotonic() < self._retry_at:
            self._mirror(events)
            self.dropped += len(events)
            return
        if self._announce:
            announced = [BlockStored(tuple(self.held), None, len(self.held) * self.block_tokens, self.block_tokens,
                                     None, MEMORY)] if self.held else []
            events = [AllBlocksCleared(), *announced, *events]
        self._mirror(events)
        if not events:
            return
        self._announce = False
        try:
            await self._append(events)
        except Exception as error:  # noqa: BLE001 - an outage drops events, never a request
            self._note_down(error)
            self.dropped += len(events)
            self._announce = self.lease_s is not None
            return
        self._note_up()

    def _drain(self) -> list[KvEvent]:
        events = []
        while self._queue:
            events.append(self._queue.popleft())
        return events

    def _mirror(self, events: list[KvEvent]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif event.medium == MEMORY and isinstance(event, BlockStored):
                self.held.update(event.block_hashes)
            elif event.medium == MEMORY:
                self.held.difference_update(event.block_hashes)

    async def _append(self, events: list[KvEvent]) -> None:
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1  # taken even if the append fails: readers see the gap
        fields = encode_batch(EventBatch(self.source, seq, time.time(), tuple(events)))
        await self.redis.xadd(self.keys.stream, fields, maxlen=self.max_len, approximate=True)
        self.published += len(events)

    def _note_down(self, error: BaseException) -> None:
        self._retry_at = time.monotonic() + RETRY_S
        if not self._down:
            log.warning("KV events: Redis unavailable (%r); dropping events until it answers", error)
            self._down = True

    def _note_up(self) -> None:
        if self._down:
            log.info("KV events: Redis answers again")
            self._down = False
