"""A volume: one tensorstore kvstore root (a directory per SSD by default) holding segments."""
from __future__ import annotations

import asyncio
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tensorstore as ts

from .location import SEGMENT_ID, VOLUME_ID

ID_KEY = "VOLUME_ID"
# The default byte budget of a file-system volume: this share of its file system's total size (not
# of its free space, which the cache itself uses up), computed on the volume's first open and
# recorded in it, so the kvstore and every engine that mounts it apply the same figure.
DEFAULT_BUDGET_SHARE = 0.8
BUDGET_KEY = "DEFAULT_BUDGET_BYTES"
SEGMENT_DIR = "segments/"
QUARANTINE_DIR = "quarantine/"  # segment objects reconciliation found torn or foreign, kept for a human
READ_MODES = ("mmap", "pread", "tensorstore")
# A mapping keeps a deleted (unlinked) segment's disk space allocated, so mappings are dropped
# once idle, and the cache is bounded.
MAP_IDLE_S = 60.0
MAX_MAPPED_SEGMENTS = 4096
MAX_MAPPED_BYTES = 64 << 30


def volume_spec(volume: str | dict[str, Any]) -> dict[str, Any]:
    """A tensorstore kvstore spec: a plain path means the `file` driver on that directory; a URL
    (`s3://bucket/prefix`, `gs://...`) its driver. An s3 volume takes the standard AWS variables:
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (an S3-compatible server), AWS_REGION or
    AWS_DEFAULT_REGION; credentials come from tensorstore's AWS chain (AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws/credentials, instance roles)."""
    if isinstance(volume, dict):
        spec = dict(volume)
    elif "://" in volume:
        spec = ts.KvStore.Spec(volume).to_json()
    else:
        spec = {"driver": "file", "path": os.path.abspath(volume)}
    if spec.get("path") and not spec["path"].endswith("/"):
        spec["path"] += "/"
    if spec.get("driver") == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint and "endpoint" not in spec:
            spec["endpoint"] = endpoint
        if region and "aws_region" not in spec:
            spec["aws_region"] = region
    return spec


def segment_key(segment: str) -> str:
    """The volume key of a segment; refuses anything but a segment id, so no name escapes the root."""
    if not SEGMENT_ID.match(segment):
        raise ValueError(f"segment id must be 32 lowercase hex digits, got {segment!r}")
    return SEGMENT_DIR + segment


class Volume:
    """Segments in one kvstore root.

    Invariants: a write is atomic and durable when it returns (tensorstore writes a temporary
    file, fsyncs it (`file_io_sync`) and renames it), so a reader sees a whole segment or none;
    a segment object never changes after that, it is only deleted (unlinked).

    Reads of `file` volumes bypass tensorstore (the benchmark decided, see BENCHMARKS.md):
    "mmap" (default) keeps each segment file mapped, and a read copies from the mapping,
    which avoids the kernel's slower copy_to_user path and re-populating page tables;
    "pread" preadv()s into the caller's buffer. Other drivers (and "tensorstore") read through
    tensorstore byte ranges. Caveat of "mmap": a segment file truncated in place by something
    other than kvstore (kvstore never does) is noticed before each read and remapped, but one
    truncated in the microseconds between that check and the copy would fault the process (SIGBUS).
    """

    def __init__(self, store: ts.KvStore, spec: dict[str, Any], volume_id: str, pool: ThreadPoolExecutor,
                 read_mode: str = "mmap", default_budget_bytes: int | None = None) -> None:
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        self.store = store
        self.spec = spec
        self.id = volume_id
        self.default_budget_bytes = default_budget_bytes  # None: not a file system, needs an explicit budget
        self._pool = pool
        self.read_mode = read_mode if spec.get("driver") == "file" else "tensorstore"
        # segment -> (mapping of its whole file, last use on the monotonic clock), least recent first
        self._maps: OrderedDict[str, tuple[memoryview, float]] = OrderedDict()
        self._mapped_bytes = 0
        self._maps_lock = threading.Lock()

    @classmethod
    async def open(cls, volume: str | dict[str, Any], pool: ThreadPoolExecutor, read_mode: str = "mmap") -> "Volume":
        spec = volume_spec(volume)
        if spec.get("driver") == "file":
            os.makedirs(spec["path"], exist_ok=True)
        store = await ts.KvStore.open(spec, context=ts.Context({"file_io_sync": True}))
        found = await store.read(ID_KEY)
        if found.state != "value":  # only if still absent: of openers racing (two hosts), one id wins
            await store.write(ID_KEY, secrets.token_hex(8).encode(), if_equal=found.stamp.generation)
            found = await store.read(ID_KEY)
        volume_id = found.value.decode().strip()
        if not VOLUME_ID.match(volume_id):
            raise ValueError(f"volume {spec} has a malformed {ID_KEY}: {volume_id!r}")
        return cls(store, spec, volume_id, pool, read_mode, await _default_budget(store, spec))

    @property
    def name(self) -> str:
        if "bucket" in self.spec:
            return f"{self.spec['driver']}://{self.spec['bucket']}/{self.spec.get('path', '')}"
        return self.spec.get("path") or str(self.spec)

    def _path(self, segment: str) -> str:
        return self.spec["path"] + segment_key(segment)

    async def write(self, segment: str, payload: bytes) -> None:
        await self.store.write(segment_key(segment), payload)

    async def delete(self, segment: str) -> None:
        self.unmap(segment)
        await self.store.write(segment_key(segment), None)

    async def read(self, segment: str, offset: int, length: int, quarantined: bool = False) -> bytes:
        """Up to `length` bytes at `offset`; shorter (possibly empty) if the object is shorter or gone."""
        key = QUARANTINE_DIR + segment if quarantined else segment_key(segment)
        try:
            result = await self.store.read(key, byte_range=slice(offset, offset + length))
        except ValueError as e:  # tensorstore refuses a range past the end: read what there is
            if "OUT_OF_RANGE" not in str(e):
                raise
            try:
                result = await self.store.read(key, byte_range=slice(offset, None))
            except ValueError:
                return b""
        return result.value if result.state == "value" else b""

    async def read_into(self, segment: str, offset: int, out: memoryview) -> int:
        """Fill `out` from `offset`; returns bytes read (less than len(out) if short or gone)."""
        if self.read_mode == "tensorstore":
            data = await self.read(segment, offset, len(out))
            out[:len(data)] = data
            return len(data)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, _pread_all, self._path(segment), offset, out)

    def mapped(self, segment: str) -> memoryview:
        """The whole segment object, memory-mapped read-only (empty if gone). Blocking: call from
        a worker thread. Mappings are cached; dropping one never invalidates views in use."""
        now = time.monotonic()
        with self._maps_lock:
            self._drop_idle(now)
            cached = self._maps.get(segment)
        if cached is not None and not _shrunk(self._path(segment), len(cached[0])):
            with self._maps_lock:
                if segment in self._maps:
                    self._maps[segment] = (cached[0], now)
                    self._maps.move_to_end(segment)
            return cached[0]
        self.unmap(segment)
        try:
            fd = os.open(self._path(segment), os.O_RDONLY)
        except FileNotFoundError:
            return memoryview(b"")
        try:
            size = os.fstat(fd).st_size
            view = memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ)) if size else memoryview(b"")
        finally:
            os.close(fd)
        with self._maps_lock:
            if segment not in self._maps:
                self._maps[segment] = (view, now)
                self._mapped_bytes += len(view)
        return view

    def _drop_idle(self, now: float) -> None:
        while self._maps:
            segment, (view, used) = next(iter(self._maps.items()))
            if (used > now - MAP_IDLE_S and len(self._maps) <= MAX_MAPPED_SEGMENTS
                    and self._mapped_bytes <= MAX_MAPPED_BYTES):
                break
            self._unmap_locked(segment)

    def _unmap_locked(self, segment: str) -> None:
        entry = self._maps.pop(segment, None)
        if entry is not None:
            self._mapped_bytes -= len(entry[0])

    def unmap(self, segment: str) -> None:
        with self._maps_lock:
            self._unmap_locked(segment)

    def close(self) -> None:
        """Drop every cached mapping (mapped pages cannot leave the page cache while mapped)."""
        with self._maps_lock:
            self._maps.clear()
            self._mapped_bytes = 0

    async def has_size(self, segment: str, size: int) -> bool:
        """Whether the segment object exists and is exactly `size` bytes (a torn write is shorter)."""
        if self.spec.get("driver") == "file":
            try:
                return os.stat(self._path(segment)).st_size == size
            except FileNotFoundError:
                return False
        try:  # no stat in tensorstore's kvstore API: the last byte must be there and nothing after it
            result = await self.store.read(segment_key(segment), byte_range=slice(size - 1, None))
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
            return False
        return result.state == "value" and len(result.value) == 1

    async def exists(self, segment: str) -> bool:
        result = await self.store.read(segment_key(segment), byte_range=slice(0, 0))
        return result.state == "value"

    async def quarantine(self, segment: str) -> None:
        """Move a segment object out of `segments/` into `quarantine/` (kept, never read again)."""
        self.unmap(segment)
        if self.spec.get("driver") == "file":
            os.makedirs(self.spec["path"] + QUARANTINE_DIR, exist_ok=True)
            try:
                os.rename(self._path(segment), self.spec["path"] + QUARANTINE_DIR + segment)
            except FileNotFoundError:
                pass
            return
        found = await self.store.read(segment_key(segment))
        if found.state == "value":
            await self.store.write(QUARANTINE_DIR + segment, found.value)
            await self.store.write(segment_key(segment), None)

    async def quarantined(self) -> list[str]:
        """The segment objects in `quarantine/`."""
        keys = await self.store.list(ts.KvStore.KeyRange(QUARANTINE_DIR, QUARANTINE_DIR[:-1] + "0"))
        names = [k.decode()[len(QUARANTINE_DIR):] for k in keys]
        return [n for n in names if SEGMENT_ID.match(n)]

    async def delete_quarantined(self, segment: str) -> None:
        await self.store.write(QUARANTINE_DIR + segment, None)

    async def segments(self) -> list[str]:
        keys = await self.store.list(ts.KvStore.KeyRange(SEGMENT_DIR, SEGMENT_DIR[:-1] + "0"))
        names = [k.decode()[len(SEGMENT_DIR):] for k in keys]
        return [n for n in names if SEGMENT_ID.match(n)]

    async def reachable(self) -> bool:
        try:
            found = await asyncio.wait_for(self.store.read(ID_KEY), timeout=2.0)
            return found.state == "value" and found.value.decode().strip() == self.id
        except Exception:  # readiness probe: any failure means "not reachable"
            return False


async def _default_budget(store: ts.KvStore, spec: dict[str, Any]) -> int | None:
    """The volume's recorded default budget; on a file system's first open, computed and recorded."""
    found = await store.read(BUDGET_KEY)
    if found.state == "value":
        return int(found.value.decode())
    if spec.get("driver") != "file":
        return None
    fs = os.statvfs(spec["path"])
    budget = int(fs.f_blocks * fs.f_frsize * DEFAULT_BUDGET_SHARE)
    await store.write(BUDGET_KEY, str(budget).encode())
    return budget


def _shrunk(path: str, mapped: int) -> bool:
    """The file is now shorter than its mapping (touching the lost tail would fault: SIGBUS).
    A deleted file is not shrunk: its mapping stays valid until unmapped."""
    try:
        return os.stat(path).st_size < mapped
    except FileNotFoundError:
        return False


def _pread_all(path: str, offset: int, out: memoryview) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)
