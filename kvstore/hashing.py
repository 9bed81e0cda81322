"""Chained block hashes over full blocks of tokens.

h_i = blake2b-128(h_{i-1} | context | int32 tokens of block i), h_{-1} = 16 zero bytes,
context = blake2b-128(len-prefixed model fingerprint | len-prefixed tenant salt).
Hashing the fingerprint and salt once into a fixed-size context keeps the per-block input
unambiguous and short. A block's hash names its whole prefix, so equal hashes mean equal
prefixes of the same model and tenant.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

HASH_BYTES = 16


def cacheable_blocks(tokens: int, block_tokens: int) -> int:
    """Leading full blocks of a prompt of `tokens` a hit may cover, or a save publish: at least one prompt token is
    always left to compute, since its logits give the first answer token (the one rule gateway and engine share)."""
    return max(0, (tokens - 1) // block_tokens)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def chain_context(fingerprint: str, tenant_salt: bytes | str) -> bytes:
    """The 16-byte digest mixed into every block hash of one (model, tenant)."""
    fp, salt = _as_bytes(fingerprint), _as_bytes(tenant_salt)
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"dikv-context")
    h.update(len(fp).to_bytes(4, "little") + fp + len(salt).to_bytes(4, "little") + salt)
    return h.digest()


def block_hashes(tokens: Sequence[int], fingerprint: str, tenant_salt: bytes | str,
                 block_tokens: int = 64) -> list[bytes]:
    """Chained 16-byte hashes of the full blocks of `tokens`; a trailing partial block is ignored."""
    return extend_block_hashes([], tokens, fingerprint, tenant_salt, block_tokens)


def extend_block_hashes(hashes: Sequence[bytes], tokens: Sequence[int], fingerprint: str,
                        tenant_salt: bytes | str, block_tokens: int = 64) -> list[bytes]:
    """`hashes` (the chain of the first len(hashes) blocks of `tokens`) extended over every full block
    of `tokens`: only the new blocks are hashed (a sequence growing by decode)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    done = len(hashes)
    n_blocks = len(tokens) // block_tokens - done
    if n_blocks <= 0:
        return list(hashes)
    tokens = tokens[done * block_tokens:]
    n_used = n_blocks * block_tokens
    if isinstance(tokens, np.ndarray):
        if tokens.size and (tokens.min() < -(2**31) or tokens.max() >= 2**31):
            raise ValueError("token ids must fit in int32")
        ids = tokens[:n_used].astype("<i4")
    else:
        try:  # fromiter converts a Python list about twice as fast as asarray
            ids = np.fromiter(tokens[:n_used], dtype="<i4", count=n_used)
        except OverflowError as e:
            raise ValueError("token ids must fit in int32") from e
    raw = ids.tobytes()  # (n_blocks * block_tokens * 4) bytes
    context = chain_context(fingerprint, tenant_salt)
    stride = block_tokens * 4
    parent = hashes[-1] if done else bytes(HASH_BYTES)
    out = list(hashes)
    blake2b = hashlib.blake2b
    for i in range(n_blocks):
        parent = blake2b(parent + context + raw[i * stride:(i + 1) * stride], digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out
