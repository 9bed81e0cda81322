"""Block MACs: who may have written a block. Each stored block carries
MAC = keyed BLAKE2b-128(MAC key; format version | model fingerprint | block hash | the block's
per-layer checksums), stored in its segment's header and checked before any of its bytes are read.

A party without the deployment's MAC key (a client of an unauthenticated port, anyone able to
write a volume) cannot make a block that passes: its hash, fingerprint and checksums are bound
together under the key, and the checksums bind the bytes (block_check.py). Also after the index
is rebuilt from the volumes, since the MAC is in the segment, not in the index.
"""
from __future__ import annotations

import hashlib
import hmac

import numpy as np

MAC_BYTES = 16
_PERSON = b"dikv-block-mac"


class BlockMac:
    """The deployment's MAC key and the MACs it makes and checks."""

    def __init__(self, mac_key: str) -> None:
        """An empty key is no key: no block verifies (every read is a miss) and none can be made."""
        # BLAKE2b keys are at most 64 bytes: a longer (or any) secret is hashed down to 32.
        self._key = hashlib.sha256(b"dikv-mac-key\x00" + mac_key.encode()).digest() if mac_key else None

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def block(self, version: int, fingerprint: str, block_hash: bytes, checksums: np.ndarray) -> bytes:
        """MAC of one block; `checksums` is (num_layers,) uint64, the block's checksum in each layer."""
        if self._key is None:
            raise ValueError("no MAC key configured: blocks cannot be stored")
        mac = hashlib.blake2b(key=self._key, digest_size=MAC_BYTES, person=_PERSON)
        mac.update(version.to_bytes(4, "little"))
        mac.update(fingerprint.encode() + b"\x00")
        mac.update(block_hash)
        mac.update(np.ascontiguousarray(checksums, "<u8").tobytes())
        return mac.digest()

    def segment(self, version: int, fingerprint: str, hashes: tuple[bytes, ...], checksums: np.ndarray) -> bytes:
        """The MACs of every block of a segment, concatenated; `checksums` is (num_layers, n_blocks)."""
        return b"".join(self.block(version, fingerprint, h, checksums[:, i]) for i, h in enumerate(hashes))

    def first_forged(self, version: int, fingerprint: str, hashes: tuple[bytes, ...], checksums: np.ndarray,
                     macs: bytes) -> int | None:
        """Index of the first block whose stored MAC does not verify (constant-time compare), or None."""
        if self._key is None:
            return 0 if hashes else None
        for i, h in enumerate(hashes):
            expected = self.block(version, fingerprint, h, checksums[:, i])
            if not hmac.compare_digest(expected, macs[i * MAC_BYTES:(i + 1) * MAC_BYTES]):
                return i
        return None
