"""The segment format: header round trip, rowsum64 checksums, copy_verified."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore import CacheGeometry, block_hashes
from kvstore.segment import (SegmentFormatError, SegmentPublication, block_checksums, copy_verified,
                             decode_header, encode_segment)

GEOMETRY = CacheGeometry(num_layers=3, latent_dim=576, block_tokens=16)


def layers(n_blocks: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, (n_blocks * 16, 576), dtype=np.uint16).view(GEOMETRY.np_dtype)
            for _ in range(GEOMETRY.num_layers)]


def test_header_round_trip_and_layer_major_layout():
    hashes = block_hashes(list(range(5 * 16)), "fp", "t", 16)
    data = layers(5)
    payload, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, data)
    header = decode_header(payload[:offset])
    assert header.fingerprint == "fp" and header.geometry == GEOMETRY and header.tenant == "tenant"
    assert header.hashes == tuple(hashes) and header.data_offset == offset and offset % 4096 == 0
    assert len(payload) == offset + 3 * 5 * GEOMETRY.block_bytes
    layer2 = np.frombuffer(payload, np.uint16, count=5 * 16 * 576, offset=offset + 2 * 5 * GEOMETRY.block_bytes)
    assert np.array_equal(layer2, data[2].view(np.uint16).reshape(-1))
    assert np.array_equal(header.checksums[1], block_checksums(data[1], 16))


def test_header_carries_its_publication():
    hashes = block_hashes(list(range(2 * 16)), "fp", "t", 16)
    publication = SegmentPublication(b"r" * 16, "agent", 3 * 86_400, 1_800_000_000)
    payload, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, layers(2), publication=publication)
    header = decode_header(payload[:offset])
    assert header.publication == publication and header.publication.written_at == 1_800_000_000 - 3 * 86_400
    legacy, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, layers(2))
    assert decode_header(legacy[:offset]).publication is None
    bad, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, layers(2),
                                 publication=publication._replace(root=b"short"))
    with pytest.raises(SegmentFormatError, match="publication"):
        decode_header(bad[:offset])


def test_malformed_headers_are_refused():
    with pytest.raises(SegmentFormatError, match="magic"):
        decode_header(b"NOTASEGMENT.....")
    payload, offset = encode_segment("fp", GEOMETRY, "", block_hashes(list(range(16)), "fp", "t", 16), layers(1))
    with pytest.raises(SegmentFormatError, match="truncated"):
        decode_header(payload[:40])
    broken = bytearray(payload[:offset])
    broken[12:20] = b"\xc1" * 8  # msgpack's "never used" byte
    with pytest.raises(SegmentFormatError, match="malformed"):
        decode_header(bytes(broken))


def test_checksum_catches_flips_zeroed_and_swapped_rows():
    rows = layers(2)[0]  # (32, 576)
    ref = block_checksums(rows, 16)
    for damage in ("flip", "zero", "swap"):
        bad = rows.copy().view(np.uint16)
        if damage == "flip":
            bad[17, 300] ^= 1 << 9
        elif damage == "zero":
            bad[20:24] = 0
        else:
            bad[[18, 19]] = bad[[19, 18]]
        got = block_checksums(bad.view(GEOMETRY.np_dtype), 16)
        assert got[0] == ref[0] and got[1] != ref[1], damage


def test_copy_verified_reports_the_first_missing_or_bad_block():
    data = layers(4, seed=3)[0]
    source = memoryview(b"\0" * 100 + data.view(np.uint8).tobytes())
    expected = block_checksums(data, 16)
    out = np.zeros_like(data)
    assert copy_verified(source, 100, out, expected, 16, chunk_blocks=3) is None
    assert np.array_equal(out.view(np.uint16), data.view(np.uint16))
    short = source[:100 + 2 * GEOMETRY.block_bytes + 5]
    assert copy_verified(short, 100, np.zeros_like(data), expected, 16) == 2
    tampered = bytearray(source)
    tampered[100 + GEOMETRY.block_bytes + 3] ^= 0xFF
    assert copy_verified(memoryview(bytes(tampered)), 100, np.zeros_like(data), expected, 16) == 1
    assert copy_verified(memoryview(b""), 0, np.zeros_like(data), expected, 16) == 0
