"""Only blocks written by a holder of the deployment's MAC key, in this segment format, with finite
latents, are ever served: a forged, old-format or non-finite block is a miss plus a counter, even
when its index entry looks perfect (as after an index rebuild from the volumes)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvstore import BlockLocation, block_hashes
from kvstore.block_check import block_checksums
from kvstore.block_mac import BlockMac
from kvstore.segment import PREAMBLE_BYTES, encode_segment
from tests.test_store_blocks import FP, GEOMETRY, MAC_KEY, index, latents, open_store, prompt, read_all, store  # noqa: F401

NAN_BF16 = 0x7FC0


async def _plant(store, index, tmp_path, payload: bytes, offset: int, hashes: list[bytes], segment: str):
    """Write a segment object straight onto volume 0 and publish index entries for it, as a party
    with write access to a volume (or an index rebuilt from the volumes) would."""
    volume = next(iter(store.volumes.values()))
    await volume.write(segment, payload)
    n = len(hashes)
    await index.publish(hashes[0], hashes, [BlockLocation(volume.id, segment, i, n, offset) for i in range(n)],
                        "victim", 3600)


async def test_a_segment_made_with_another_key_is_never_served(store, index, tmp_path):
    hashes = block_hashes(prompt(3, 20), FP, "victim-salt", GEOMETRY.block_tokens)
    poison = [np.full_like(x, 10.0) for x in latents(3, 20)]
    payload, offset = encode_segment(FP, GEOMETRY, "victim", hashes, poison, BlockMac("attacker-guess"))
    await _plant(store, index, tmp_path, payload, offset, hashes, "a" * 32)
    hit = await index.lookup(hashes)
    assert hit.blocks == 3  # the index points at it ...
    _, valid = await read_all(store, hit)
    assert valid == 0  # ... and nothing of it is served
    assert store.stats.forged_segments >= 1 and store.stats.verification_failures >= 1
    assert (await index.lookup(hashes)).blocks == 0  # the entry is dropped


async def test_a_segment_of_the_older_format_is_a_reported_miss(store, index, tmp_path):
    hashes = block_hashes(prompt(2, 21), FP, "t", GEOMETRY.block_tokens)
    payload, offset = encode_segment(FP, GEOMETRY, "t", hashes, latents(2, 21), BlockMac(MAC_KEY))
    header = msgpack.unpackb(payload[PREAMBLE_BYTES:offset].rstrip(b"\0"))
    old = msgpack.packb({k: v for k, v in header.items() if k not in ("version", "macs")} | {"checksum": "rowsum64"})
    assert PREAMBLE_BYTES + len(old) <= offset
    rewritten = payload[:8] + len(old).to_bytes(4, "little") + old
    await _plant(store, index, tmp_path, rewritten + bytes(offset - len(rewritten)) + payload[offset:], offset,
                 hashes, "b" * 32)
    _, valid = await read_all(store, await index.lookup(hashes))
    assert valid == 0 and store.stats.old_format_segments >= 1


async def test_nonfinite_latents_are_a_miss_even_from_a_keyed_writer(store, index, tmp_path):
    hashes = block_hashes(prompt(3, 22), FP, "t", GEOMETRY.block_tokens)
    data = latents(3, 22)
    data[1].view(np.uint16)[GEOMETRY.block_tokens + 3, 9] = NAN_BF16  # layer 1, block 1
    assert block_checksums(data[1], GEOMETRY.block_tokens).size == 3
    payload, offset = encode_segment(FP, GEOMETRY, "t", hashes, data, BlockMac(MAC_KEY))
    await _plant(store, index, tmp_path, payload, offset, hashes, "c" * 32)
    layers, valid = await read_all(store, await index.lookup(hashes))
    assert valid == GEOMETRY.block_tokens  # block 0 only
    assert all(np.isfinite(layer[:valid].astype(np.float32)).all() for layer in layers)
    assert store.stats.nonfinite_blocks == 1


async def test_saving_nonfinite_latents_is_refused(store, index):
    hashes = block_hashes(prompt(2, 23), FP, "t", GEOMETRY.block_tokens)
    data = latents(2, 23)
    data[3].view(np.uint16)[5, 5] = 0x7F80  # +Inf
    with pytest.raises(ValueError, match="layers\\[3\\] holds NaN or Inf"):
        await store.save(hashes, data)
    assert (await index.lookup(hashes)).blocks == 0


async def test_a_store_with_another_key_reads_nothing_of_this_one(store, index, shelf):
    hashes = block_hashes(prompt(2, 24), FP, "t", GEOMETRY.block_tokens)
    await store.save(hashes, latents(2, 24))
    other = await open_store(shelf, index, mac_key="another-deployment")  # the same volumes
    try:
        _, valid = await read_all(other, await index.lookup(hashes))
        assert valid == 0 and other.stats.forged_segments >= 1
    finally:
        await other.close()
