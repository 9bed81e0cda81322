"""Chained block hashes and the cache geometry."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore import CacheGeometry, block_hashes


def test_only_full_blocks_and_prefix_stable():
    tokens = list(range(64 * 3 + 10))
    hashes = block_hashes(tokens, "fp", "salt")
    assert len(hashes) == 3 and all(len(h) == 16 for h in hashes)
    longer = block_hashes(tokens + list(range(500)), "fp", "salt")
    assert longer[:3] == hashes  # a longer prompt with the same prefix shares the prefix's blocks
    assert block_hashes(tokens[:63], "fp", "salt") == []


def test_chain_depends_on_everything_before():
    base = list(range(256))
    changed = list(base)
    changed[5] = 99_999  # in block 0
    a, b = block_hashes(base, "fp", "s"), block_hashes(changed, "fp", "s")
    assert all(x != y for x, y in zip(a, b))  # block 0 differs, so every later block differs too
    same_blocks = base[64:128] * 2
    h = block_hashes(same_blocks, "fp", "s")
    assert h[0] != h[1]  # equal token blocks at different positions hash differently


def test_fingerprint_and_tenant_salt_isolate():
    tokens = list(range(128))
    ref = block_hashes(tokens, "fp", "tenant-a")
    assert set(ref).isdisjoint(block_hashes(tokens, "fp", "tenant-b"))
    assert set(ref).isdisjoint(block_hashes(tokens, "fp2", "tenant-a"))
    assert block_hashes(tokens, "fp", b"tenant-a") == ref
    assert set(block_hashes(tokens, "fpt", "enant-a")).isdisjoint(ref)  # no concatenation ambiguity


def test_numpy_and_list_inputs_agree_and_bad_ids_are_refused():
    tokens = np.arange(1000, 1000 + 320, dtype=np.int64)
    assert block_hashes(tokens, "fp", "s", block_tokens=32) == block_hashes(tokens.tolist(), "fp", "s", block_tokens=32)
    with pytest.raises(ValueError, match="int32"):
        block_hashes([2 ** 40] * 64, "fp", "s")
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes([1] * 64, "fp", "s", block_tokens=0)


def test_geometry_sizes_and_validation():
    g = CacheGeometry(num_layers=8)
    assert g.row_bytes == 1152 and g.block_bytes == 73_728
    with pytest.raises(ValueError, match="dtype"):
        CacheGeometry(num_layers=8, dtype="int4")
    with pytest.raises(ValueError, match="num_layers"):
        CacheGeometry(num_layers=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        CacheGeometry(num_layers=1, latent_dim=3)
