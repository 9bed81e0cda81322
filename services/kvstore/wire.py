"""The kvstore service's msgpack wire format, shared by the server (parse) and client (encode).

POST /v1/segments  {"fingerprint", "geometry": {...}, "hashes": [16 B], "start_block", "tenant",
                    "retention", "ttl_s" (int or nil), "layers": [raw bytes of (tokens, row_width) stored rows],
                    "epoch" (the tenant's purge epoch the request began under, or nil)}
POST /v1/read      {"fingerprint", "geometry", "root", "hashes", "runs": [[volume, segment, first,
                    count, n_blocks, data_offset]], "layer"} -> raw latent bytes, X-Valid-Blocks
POST /v1/lookup    {"hashes"} -> {"root", "hashes", "runs"}
"""
from __future__ import annotations

from typing import Any, NamedTuple

import msgpack
import numpy as np

from kvstore import CacheGeometry, Hit, SegmentRun
from kvstore.hashing import HASH_BYTES
from kvstore.location import SEGMENT_ID, VOLUME_ID
from services.common import RequestError

MSGPACK = "application/msgpack"
VALID_BLOCKS_HEADER = "X-Valid-Blocks"


class SaveRequest(NamedTuple):
    hashes: list[bytes]
    layers: list[np.ndarray]   # each (new_blocks * block_tokens, row_width) stored rows (geometry.py)
    start_block: int
    tenant: str
    retention: str
    ttl_s: int | None
    epoch: int | None = None  # the tenant's purge epoch the request began under (kvstore/fence.py)


class ReadRequest(NamedTuple):
    hit: Hit
    layer: int


# msgpack errors whose message is empty
_UNEXPLAINED = {msgpack.StackError: "nested too deeply",
                msgpack.FormatError: "a byte that starts no msgpack type (e.g. 0xc1)"}


def unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        detail = str(e) or _UNEXPLAINED.get(type(e), type(e).__name__)
        raise RequestError(400, f"body is not valid msgpack: {detail}", "body") from None
    if not isinstance(message, dict):
        raise RequestError(400, "body must be a msgpack map", "body")
    return message


def _field(message: dict, name: str, kind: type | tuple, default: Any = ...) -> Any:
    if name not in message or message[name] is None:
        if default is ...:
            raise RequestError(400, f"missing field {name!r}", name)
        return default
    value = message[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(400, f"field {name!r} has the wrong type {type(value).__name__}", name)
    return value


def check_model(message: dict, fingerprint: str, geometry: CacheGeometry) -> None:
    """The request is for the model and cache geometry this kvstore serves (else 409)."""
    if _field(message, "fingerprint", str) != fingerprint:
        raise RequestError(409, "fingerprint does not match this kvstore's (model and latent format)", "fingerprint")
    given = _field(message, "geometry", dict)
    if given != geometry.as_dict():
        raise RequestError(409, f"geometry {given} does not match this kvstore's {geometry.as_dict()}", "geometry")


def parse_hashes(message: dict) -> list[bytes]:
    hashes = _field(message, "hashes", list)
    if not hashes or any(not isinstance(h, bytes) or len(h) != HASH_BYTES for h in hashes):
        raise RequestError(400, f"hashes must be a non-empty list of {HASH_BYTES}-byte strings", "hashes")
    return hashes


def parse_save(message: dict, geometry: CacheGeometry) -> SaveRequest:
    hashes = parse_hashes(message)
    start = _field(message, "start_block", int, 0)
    if not 0 <= start < len(hashes):
        raise RequestError(400, f"start_block must be in [0, {len(hashes)})", "start_block")
    raw_layers = _field(message, "layers", list)
    if len(raw_layers) != geometry.num_layers:
        raise RequestError(400, f"layers must have {geometry.num_layers} entries, got {len(raw_layers)}", "layers")
    rows = (len(hashes) - start) * geometry.block_tokens
    layers = []
    for i, raw in enumerate(raw_layers):
        if not isinstance(raw, bytes) or len(raw) != rows * geometry.row_bytes:
            raise RequestError(400, f"layers[{i}] must be {rows * geometry.row_bytes} bytes "
                                    f"({rows} tokens x {geometry.row_bytes} bytes)", f"layers[{i}]")
        layers.append(np.frombuffer(raw, geometry.row_dtype).reshape(rows, geometry.row_width))
    ttl_s = _field(message, "ttl_s", int, None)
    return SaveRequest(hashes, layers, start, _field(message, "tenant", str, ""),
                       _field(message, "retention", str, "chat"), ttl_s, _field(message, "epoch", int, None))


def parse_run(raw: Any, i: int) -> SegmentRun:
    if not isinstance(raw, list) or len(raw) != 6:
        raise RequestError(400, f"runs[{i}] must be [volume, segment, first, count, n_blocks, data_offset]", f"runs[{i}]")
    volume, segment, *numbers = raw
    if not isinstance(volume, str) or not VOLUME_ID.match(volume):
        raise RequestError(400, f"runs[{i}] volume must be 16 hex digits", f"runs[{i}]")
    if not isinstance(segment, str) or not SEGMENT_ID.match(segment):
        raise RequestError(400, f"runs[{i}] segment id must be 32 lowercase hex digits", f"runs[{i}]")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in numbers):
        raise RequestError(400, f"runs[{i}] numbers must be non-negative integers", f"runs[{i}]")
    first, count, n_blocks, offset = numbers
    if count < 1 or first + count > n_blocks:
        raise RequestError(400, f"runs[{i}] blocks lie outside the segment", f"runs[{i}]")
    return SegmentRun(volume, segment, first, count, n_blocks, offset)


def parse_read(message: dict, geometry: CacheGeometry) -> ReadRequest:
    hashes = parse_hashes(message)
    runs = [parse_run(r, i) for i, r in enumerate(_field(message, "runs", list))]
    if sum(r.count for r in runs) != len(hashes):
        raise RequestError(400, "runs must cover exactly the listed hashes", "runs")
    layer = _field(message, "layer", int)
    if not 0 <= layer < geometry.num_layers:
        raise RequestError(400, f"layer must be in [0, {geometry.num_layers})", "layer")
    root = _field(message, "root", bytes)
    return ReadRequest(Hit(root, tuple(hashes), tuple(runs)), layer)


def encode_hit(hit: Hit) -> dict[str, Any]:
    return {"root": hit.root, "hashes": list(hit.hashes), "runs": [list(r) for r in hit.runs]}


def decode_hit(message: dict) -> Hit:
    if not message.get("hashes"):
        return Hit(message.get("root", b""), (), ())
    runs = tuple(parse_run(r, i) for i, r in enumerate(message["runs"]))
    return Hit(message["root"], tuple(message["hashes"]), runs)
