"""The segment: the blocks written by one save, stored layer-major in one volume object.

Object layout (bytes):
  [0, 8)            magic b"DIKVSEG1"
  [8, 12)           header length H (uint32 little-endian)
  [12, 12 + H)      msgpack header: format version, fingerprint, geometry, tenant, block hashes,
                    checksums (block_check.py), block MACs (block_mac.py), and "publication": what
                    republishing its index entries needs (chain root, retention class, TTL, expiry)
  [.., data_offset) zero padding to a 4 KiB boundary
  [data_offset, ..) latents, layer-major: layer l is bytes
                    [data_offset + l * n_blocks * block_bytes, + n_blocks * block_bytes),
                    i.e. (n_blocks * block_tokens, row_width) stored rows (geometry.py: latents in cache
                    dtype, or fp8 rows of row_bytes in the fp8 latent format).
So one layer of a run of consecutive blocks is one contiguous byte range.
"""
from __future__ import annotations

import mmap
from typing import NamedTuple, Sequence

import msgpack
import numpy as np

from .block_check import CHECKSUM, block_checksums, nonfinite_stored_blocks
from .block_mac import MAC_BYTES, BlockMac
from .geometry import CacheGeometry
from .hashing import HASH_BYTES

MAGIC = b"DIKVSEG1"
PREAMBLE_BYTES = 12
ALIGN_BYTES = 4096
# 2: xxh3-64 checksums and keyed block MACs. 1 (no "version" field): rowsum64, no MACs; read as misses.
FORMAT_VERSION = 2


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python 3.11 lacks the name
PAGE_BYTES = mmap.PAGESIZE


def populate(source: memoryview, start: int, length: int) -> None:
    """Map the pages of source[start:start+length) in one call when `source` views an mmap: the
    kernel fills the page tables in a loop (reading what is not cached yet), instead of the copy
    taking a page fault every 64 KiB. A no-op for other buffers and on kernels without it."""
    mapping = source.obj
    if not isinstance(mapping, mmap.mmap) or length <= 0:
        return
    begin = start // PAGE_BYTES * PAGE_BYTES
    end = min(len(mapping), start + length)
    if end > begin:
        try:
            mapping.madvise(MADV_POPULATE_READ, begin, end - begin)
        except (OSError, ValueError):  # an old kernel (EINVAL), or the file shrank (EFAULT): fault on copy
            pass


class BlockFault(NamedTuple):
    """The first block of a read that may not be served, and why: "short" (missing bytes),
    "checksum" or "nonfinite" (a NaN or Inf latent)."""

    block: int
    reason: str


def check_blocks(rows: np.ndarray, expected: np.ndarray, geometry: CacheGeometry) -> BlockFault | None:
    """Verify blocks already in `rows` (n_blocks * block_tokens, row_width) against `expected` (n_blocks,)."""
    bad = np.flatnonzero(block_checksums(rows, geometry.block_tokens) != expected)
    nonfinite = np.flatnonzero(nonfinite_stored_blocks(rows, geometry))
    first_bad = int(bad[0]) if bad.size else len(expected)
    first_nonfinite = int(nonfinite[0]) if nonfinite.size else len(expected)
    if first_bad == first_nonfinite == len(expected):
        return None
    return BlockFault(first_bad, "checksum") if first_bad <= first_nonfinite else BlockFault(first_nonfinite, "nonfinite")


def copy_verified(source: memoryview, start: int, rows: np.ndarray, expected: np.ndarray, geometry: CacheGeometry,
                  chunk_blocks: int = 64) -> BlockFault | None:
    """Copy len(expected) blocks from source[start:] into `rows` (n_blocks * block_tokens, row_width),
    verifying each block (checksum against `expected` (n_blocks,), finite values) right after
    copying it, a chunk at a time (64 blocks = 4.5 MiB at the default geometry: still in the
    last-level cache; smaller chunks measured slower from per-call overhead). A mapped source has
    each chunk's pages populated first (`populate`).

    Returns the first block that is missing or fails, or None if all are good.
    Blocking (run it in a worker thread: numpy copies and xxhash release the GIL).
    """
    n_blocks = len(expected)
    block_bytes = rows.nbytes // max(n_blocks, 1)
    available = max(0, min(n_blocks, (len(source) - start) // block_bytes))
    src = np.frombuffer(source, np.uint8, count=available * block_bytes, offset=start) if available else None
    dst = rows.reshape(-1).view(np.uint8)
    bt = geometry.block_tokens
    for a in range(0, available, chunk_blocks):
        b = min(available, a + chunk_blocks)
        populate(source, start + a * block_bytes, (b - a) * block_bytes)
        dst[a * block_bytes:b * block_bytes] = src[a * block_bytes:b * block_bytes]
        fault = check_blocks(rows[a * bt:b * bt], expected[a:b], geometry)
        if fault is not None:
            return BlockFault(a + fault.block, fault.reason)
    return None if available == n_blocks else BlockFault(available, "short")


class SegmentPublication(NamedTuple):
    """How the segment was published, so that a lost index can be rebuilt from the volumes alone."""

    root: bytes        # block 0's hash of the chain (names the index shard), HASH_BYTES
    retention: str     # retention class, e.g. "chat"
    ttl_s: int         # the class's (or the request's) TTL, seconds
    expires_at: int    # unix seconds: written + ttl_s. A hit in the index extends the entry's
                       # life beyond this; the header keeps the expiry as written.
    epoch: int = 0     # the tenant's purge epoch the save began under (fence.py); older ones are erased

    @property
    def written_at(self) -> int:
        return self.expires_at - self.ttl_s

    def as_dict(self) -> dict:
        return {"root": self.root, "retention": self.retention, "ttl_s": self.ttl_s, "expires_at": self.expires_at,
                "epoch": self.epoch}


class SegmentHeader(NamedTuple):
    fingerprint: str
    geometry: CacheGeometry
    tenant: str
    hashes: tuple[bytes, ...]   # block hashes, in block order
    checksums: np.ndarray       # (num_layers, n_blocks) uint64, xxh3-64 of each block of each layer
    data_offset: int            # bytes
    version: int                # FORMAT_VERSION
    macs: bytes                 # n_blocks * MAC_BYTES, block_mac.BlockMac.block of each block
    publication: SegmentPublication | None = None  # None: written before headers carried it

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)


def data_offset_for(header_bytes: int) -> int:
    return -(-(PREAMBLE_BYTES + header_bytes) // ALIGN_BYTES) * ALIGN_BYTES


def segment_object_bytes(geometry: CacheGeometry, fingerprint: str, tenant: str, blocks: int) -> int:
    """Upper bound of a segment object's size (what the byte budget is charged before writing):
    data plus a header bound (hashes, checksums, MACs, names, publication, msgpack framing)."""
    header = 512 + len(fingerprint.encode()) + len(tenant.encode()) + blocks * (
        HASH_BYTES + MAC_BYTES + 8 * geometry.num_layers)
    return data_offset_for(header) + blocks * geometry.num_layers * geometry.block_bytes


def encode_segment(fingerprint: str, geometry: CacheGeometry, tenant: str, hashes: Sequence[bytes],
                   layers: Sequence[np.ndarray], mac: BlockMac, *,
                   publication: SegmentPublication | None = None) -> tuple[bytes, int]:
    """(segment object bytes, data_offset). `layers[l]` is (len(hashes) * block_tokens, row_width) stored rows."""
    checksums = np.stack([block_checksums(np.ascontiguousarray(x), geometry.block_tokens) for x in layers])
    head = encode_header(fingerprint, geometry, tenant, hashes, checksums, mac, publication=publication)
    parts = [head] + [np.ascontiguousarray(x).view(np.uint8).data for x in layers]
    return b"".join(parts), len(head)


def encode_header(fingerprint: str, geometry: CacheGeometry, tenant: str, hashes: Sequence[bytes],
                  checksums: np.ndarray, mac: BlockMac, *, publication: SegmentPublication | None = None) -> bytes:
    """The bytes of a segment object before its latents: preamble, header, padding to data_offset.
    `checksums` is (num_layers, len(hashes)) uint64; the block MACs are made here under `mac`."""
    fields = {
        "version": FORMAT_VERSION, "fingerprint": fingerprint, "geometry": geometry.as_dict(), "tenant": tenant,
        "hashes": b"".join(hashes), "checksum": CHECKSUM, "checksums": checksums.astype("<u8").tobytes(),
        "macs": mac.segment(FORMAT_VERSION, fingerprint, tuple(hashes), checksums),
    }
    if publication is not None:
        fields["publication"] = publication.as_dict()
    header = msgpack.packb(fields)
    preamble = MAGIC + len(header).to_bytes(4, "little") + header
    return preamble + bytes(data_offset_for(len(header)) - len(preamble))


class SegmentFormatError(ValueError):
    """The stored bytes are not a segment header this code can trust."""


class SegmentMissing(SegmentFormatError):
    """No segment object under that id (never written, or deleted)."""


class SegmentVersionError(SegmentFormatError):
    """A segment of another format version: never served (its blocks are misses), reported."""


class SegmentForged(SegmentFormatError):
    """A block MAC does not verify: the segment was not written by a holder of the MAC key."""


def header_length(preamble: bytes) -> int:
    if len(preamble) < PREAMBLE_BYTES or preamble[:8] != MAGIC:
        raise SegmentFormatError("bad magic")
    return int.from_bytes(preamble[8:12], "little")


def decode_header(raw: bytes) -> SegmentHeader:
    """Parse the first 12 + H bytes of a segment object (its MACs are checked by the reader, which
    holds the key). Raises SegmentVersionError for another format version."""
    length = header_length(raw)
    if len(raw) < PREAMBLE_BYTES + length:
        raise SegmentFormatError("truncated header")
    try:
        h = msgpack.unpackb(raw[PREAMBLE_BYTES:PREAMBLE_BYTES + length])
        version = h.get("version", 1)
        if version != FORMAT_VERSION:
            raise SegmentVersionError(f"segment format version {version!r}, this code reads {FORMAT_VERSION}")
        geometry = CacheGeometry(**h["geometry"])
        blob = h["hashes"]
        hashes = tuple(blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES))
        checksums = np.frombuffer(h["checksums"], dtype="<u8").reshape(geometry.num_layers, len(hashes))
        if h["checksum"] != CHECKSUM:
            raise SegmentFormatError(f"unknown checksum {h['checksum']!r}")
        macs = h["macs"]
        if not isinstance(macs, bytes) or len(macs) != len(hashes) * MAC_BYTES:
            raise SegmentFormatError("block MACs missing or of the wrong length")
        publication = _publication(h["publication"]) if "publication" in h else None
        return SegmentHeader(h["fingerprint"], geometry, h["tenant"], hashes, checksums, data_offset_for(length),
                             version, macs, publication)
    except SegmentFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as e:
        raise SegmentFormatError(f"malformed header: {e}") from e


def _publication(fields: dict) -> SegmentPublication:
    publication = SegmentPublication(fields["root"], fields["retention"], fields["ttl_s"], fields["expires_at"],
                                     fields.get("epoch", 0))
    if (not isinstance(publication.root, bytes) or len(publication.root) != HASH_BYTES
            or not isinstance(publication.retention, str)
            or not all(isinstance(v, int) and v >= 0
                       for v in (publication.ttl_s, publication.expires_at, publication.epoch))):
        raise SegmentFormatError(f"malformed publication {fields!r}")
    return publication
