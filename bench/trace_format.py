"""Mooncake traces: requests with arrival times and prefix-chained `hash_ids`, mapped to our blocks.

A trace `hash_id` stands for `hash_tokens` prompt tokens (512 in Mooncake's release); the last one
of a request may be partial (its `input_length` tells). Equal ids at equal positions mean equal
tokens, so block j of hash id h has the same tokens wherever h appears: its key is h * per + j
(per = hash_tokens // block_tokens). Output tokens have no ids in a trace: every answer block gets a
key of its own (negative), so answers count toward capacity and never hit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

MOONCAKE_HASH_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "traces" / "mooncake" \
    / "conversation_trace.jsonl"


class TraceRequest(NamedTuple):
    timestamp_ms: int
    input_length: int       # prompt tokens
    output_length: int      # answer tokens
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all if None), in file order (sorted by timestamp)."""
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                request = TraceRequest(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                       tuple(int(h) for h in row["hash_ids"]))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{number}: not a Mooncake trace record ({e!r})") from None
            requests.append(request)
    return requests


def prompt_block_keys(request: TraceRequest, hash_tokens: int, block_tokens: int) -> list[int]:
    """Keys of the prompt's full blocks of `block_tokens` (a partial tail is not a block)."""
    if hash_tokens % block_tokens:
        raise ValueError(f"hash_tokens ({hash_tokens}) must be a multiple of block_tokens ({block_tokens})")
    per = hash_tokens // block_tokens
    if request.input_length > len(request.hash_ids) * hash_tokens:
        raise ValueError(f"input_length {request.input_length} exceeds {len(request.hash_ids)} hash ids "
                         f"of {hash_tokens} tokens")
    return [request.hash_ids[k // per] * per + k % per for k in range(request.input_length // block_tokens)]


def scale_request(request: TraceRequest, factor: int) -> TraceRequest:
    """The same request with every hash id standing for 1/factor of its tokens (rounded up per id),
    so that a long prompt fits a small machine and prefix sharing is unchanged."""
    if factor < 1:
        raise ValueError(f"scale factor must be >= 1, got {factor}")
    full = MOONCAKE_HASH_TOKENS // factor
    tail = request.input_length - MOONCAKE_HASH_TOKENS * (len(request.hash_ids) - 1)
    prompt = full * (len(request.hash_ids) - 1) + -(-tail // factor)
    return request._replace(input_length=prompt, output_length=max(1, -(-request.output_length // factor)))


def prompt_token_ids(request: TraceRequest, hash_tokens: int, vocab: tuple[int, int]) -> list[int]:
    """Token ids of the prompt: hash id h is a fixed run of `hash_tokens` ids in [vocab[0], vocab[1])
    drawn from a generator seeded by h, so equal ids give equal tokens in every request."""
    runs: Sequence[np.ndarray] = [np.random.default_rng(h).integers(vocab[0], vocab[1], hash_tokens)
                                  for h in request.hash_ids]
    return np.concatenate(runs)[:request.input_length].tolist()
