"""The segment format: header round trip, format version, block MACs, xxh3 checksums, finite
latents, copy_verified."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore import CacheGeometry, block_hashes
import msgpack

from kvstore.block_check import nonfinite_blocks
from kvstore.block_mac import BlockMac
from kvstore.segment import (PREAMBLE_BYTES, BlockFault, SegmentFormatError, SegmentPublication, SegmentVersionError,
                             block_checksums, copy_verified, decode_header, encode_segment)

GEOMETRY = CacheGeometry(num_layers=3, latent_dim=576, block_tokens=16)
MAC = BlockMac("test-mac-key")
NAN_BF16 = 0x7FC0


def layers(n_blocks: int, seed: int = 0) -> list[np.ndarray]:
    """Random bf16 bit patterns, every exponent below all-ones (finite)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, (GEOMETRY.num_layers, n_blocks * 16, 576), dtype=np.uint16) & 0xBF7F
    return [x.view(GEOMETRY.np_dtype) for x in bits]


def encode(fingerprint, tenant, hashes, data, mac=MAC):
    return encode_segment(fingerprint, GEOMETRY, tenant, hashes, data, mac)


def test_header_round_trip_and_layer_major_layout():
    hashes = block_hashes(list(range(5 * 16)), "fp", "t", 16)
    data = layers(5)
    payload, offset = encode("fp", "tenant", hashes, data)
    header = decode_header(payload[:offset])
    assert header.version == 2 and MAC.first_forged(2, "fp", header.hashes, header.checksums, header.macs) is None
    assert header.fingerprint == "fp" and header.geometry == GEOMETRY and header.tenant == "tenant"
    assert header.hashes == tuple(hashes) and header.data_offset == offset and offset % 4096 == 0
    assert len(payload) == offset + 3 * 5 * GEOMETRY.block_bytes
    layer2 = np.frombuffer(payload, np.uint16, count=5 * 16 * 576, offset=offset + 2 * 5 * GEOMETRY.block_bytes)
    assert np.array_equal(layer2, data[2].view(np.uint16).reshape(-1))
    assert np.array_equal(header.checksums[1], block_checksums(data[1], 16))


def test_header_carries_its_publication():
    hashes = block_hashes(list(range(2 * 16)), "fp", "t", 16)
    publication = SegmentPublication(b"r" * 16, "agent", 3 * 86_400, 1_800_000_000)
    payload, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, layers(2), MAC, publication=publication)
    header = decode_header(payload[:offset])
    assert header.publication == publication and header.publication.written_at == 1_800_000_000 - 3 * 86_400
    legacy, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, layers(2), MAC)
    assert decode_header(legacy[:offset]).publication is None
    bad, offset = encode_segment("fp", GEOMETRY, "tenant", hashes, layers(2), MAC,
                                 publication=publication._replace(root=b"short"))
    with pytest.raises(SegmentFormatError, match="publication"):
        decode_header(bad[:offset])


def test_malformed_headers_are_refused():
    with pytest.raises(SegmentFormatError, match="magic"):
        decode_header(b"NOTASEGMENT.....")
    payload, offset = encode("fp", "", block_hashes(list(range(16)), "fp", "t", 16), layers(1))
    with pytest.raises(SegmentFormatError, match="truncated"):
        decode_header(payload[:40])
    broken = bytearray(payload[:offset])
    broken[12:20] = b"\xc1" * 8  # msgpack's "never used" byte
    with pytest.raises(SegmentFormatError, match="malformed"):
        decode_header(bytes(broken))


def test_an_older_format_version_is_refused_as_such():
    payload, offset = encode("fp", "", block_hashes(list(range(16)), "fp", "t", 16), layers(1))
    header = msgpack.unpackb(payload[PREAMBLE_BYTES:offset].rstrip(b"\0"))
    for version in (None, 1, 3):
        old = {k: v for k, v in header.items() if k not in ("version", "macs")} | (
            {} if version is None else {"version": version})
        raw = msgpack.packb(old)
        with pytest.raises(SegmentVersionError):
            decode_header(payload[:8] + len(raw).to_bytes(4, "little") + raw)


def test_macs_bind_key_fingerprint_hash_and_checksums():
    hashes = tuple(block_hashes(list(range(3 * 16)), "fp", "t", 16))
    payload, offset = encode("fp", "", list(hashes), layers(3))
    h = decode_header(payload[:offset])
    assert MAC.first_forged(2, "fp", h.hashes, h.checksums, h.macs) is None
    assert BlockMac("other-key").first_forged(2, "fp", h.hashes, h.checksums, h.macs) == 0
    assert MAC.first_forged(2, "fp2", h.hashes, h.checksums, h.macs) == 0
    assert MAC.first_forged(2, "fp", (h.hashes[0], h.hashes[2], h.hashes[1]), h.checksums, h.macs) == 1
    changed = h.checksums.copy()
    changed[2, 2] ^= 1
    assert MAC.first_forged(2, "fp", h.hashes, changed, h.macs) == 2
    keyless = BlockMac("")  # no key: nothing verifies, nothing can be made
    assert not keyless.keyed and keyless.first_forged(2, "fp", h.hashes, h.checksums, h.macs) == 0
    with pytest.raises(ValueError, match="no MAC key"):
        keyless.block(2, "fp", h.hashes[0], h.checksums[:, 0])


def test_checksum_catches_flips_zeroed_swapped_rows_and_swapped_words():
    rows = layers(2)[0]  # (32, 576)
    ref = block_checksums(rows, 16)
    for damage in ("flip", "zero", "swap", "words"):
        bad = rows.copy().view(np.uint16)
        if damage == "flip":
            bad[17, 300] ^= 1 << 9
        elif damage == "zero":
            bad[20:24] = 0
        elif damage == "swap":
            bad[[18, 19]] = bad[[19, 18]]
        else:  # two 8-byte words inside one row trade places (a row's word sum stays the same)
            words = bad.view(np.uint64)
            words[21, [3, 7]] = words[21, [7, 3]]
        got = block_checksums(bad.view(GEOMETRY.np_dtype), 16)
        assert got[0] == ref[0] and got[1] != ref[1], damage


def test_copy_verified_reports_the_first_missing_or_bad_block():
    data = layers(4, seed=3)[0]
    source = memoryview(b"\0" * 100 + data.view(np.uint8).tobytes())
    expected = block_checksums(data, 16)
    out = np.zeros_like(data)
    assert copy_verified(source, 100, out, expected, GEOMETRY, chunk_blocks=3) is None
    assert np.array_equal(out.view(np.uint16), data.view(np.uint16))
    short = source[:100 + 2 * GEOMETRY.block_bytes + 5]
    assert copy_verified(short, 100, np.zeros_like(data), expected, GEOMETRY) == BlockFault(2, "short")
    tampered = bytearray(source)
    tampered[100 + GEOMETRY.block_bytes + 3] ^= 0xFF
    assert copy_verified(memoryview(bytes(tampered)), 100, np.zeros_like(data), expected, GEOMETRY) == (1, "checksum")
    assert copy_verified(memoryview(b""), 0, np.zeros_like(data), expected, GEOMETRY) == (0, "short")


@pytest.mark.parametrize("pattern", [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x7F81])  # NaNs, +-Inf, a signalling NaN
def test_copy_verified_refuses_nonfinite_latents_even_with_a_matching_checksum(pattern):
    data = layers(3, seed=4)[0]
    data.view(np.uint16)[2 * 16 + 5, 17] = pattern  # block 2
    expected = block_checksums(data, 16)  # the writer checksummed the NaN: the checksum passes
    source = memoryview(data.view(np.uint8).tobytes())
    assert copy_verified(source, 0, np.zeros_like(data), expected, GEOMETRY) == (2, "nonfinite")


@pytest.mark.parametrize("dtype, patterns, finite", [
    ("bfloat16", [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF],
     [0x7F7F, 0xFF7F, 0x8000, 0x0000, 0x0001, 0x8001, 0x3F80]),
    ("float16", [0x7C00, 0xFC00, 0x7E00, 0xFFFF], [0x7BFF, 0xFBFF, 0x8000, 0x3C00]),
    ("float32", [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF], [0x7F7FFFFF, 0xFF7FFFFF, 0x80000000, 0x3F800000]),
    ("float8_e4m3fn", [0x7F, 0xFF], [0x7E, 0xFE, 0x80, 0x00]),  # e4m3fn: 0x7E is 448, no Inf
])
def test_nonfinite_blocks_finds_every_nan_and_inf_pattern_and_nothing_else(dtype, patterns, finite):
    geometry = CacheGeometry(num_layers=1, latent_dim=64, block_tokens=4, dtype=dtype)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[geometry.np_dtype.itemsize]
    for pattern in patterns:
        rows = np.zeros((3 * 4, 64), unsigned)
        rows[5, 7] = pattern  # block 1
        assert nonfinite_blocks(rows.view(geometry.np_dtype), 4, dtype).tolist() == [False, True, False], hex(pattern)
        if dtype != "float8_e4m3fn":
            assert not np.isfinite(rows.view(geometry.np_dtype).astype(np.float32)[5, 7])
    rows = np.array(finite * 64 * 3, unsigned)[:3 * 4 * 64].reshape(12, 64)
    assert not nonfinite_blocks(rows.view(geometry.np_dtype), 4, dtype).any()
    assert np.isfinite(rows.view(geometry.np_dtype).astype(np.float32)).all()
