"""Mooncake traces: requests with arrival times and prefix-chained `hash_ids`, mapped to our blocks.

A trace `hash_id` stands for `hash_tokens` prompt tokens (512 in Mooncake's release); the last one
of a request may be partial (its `input_length` tells). Equal ids at equal positions mean equal
tokens, so block j of hash id h has the same tokens wherever h appears: its key is h * per + j
(per = hash_tokens // block_tokens). Output tokens have no ids in a trace: every answer block gets a
key of its own (negative), so answers count toward capacity and never hit.
"""
from __future__ import annotations

import json
from collections import Counter
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
    """Keys of the prompt's full blocks of `block_tokens` (a partial tail is not a block).

    A hash id of several blocks: block j of id h is h * per + j. A block of several hash ids (a
    scaled-down trace): the last id it covers, which names the whole prefix (ids are chained)."""
    if request.input_length > len(request.hash_ids) * hash_tokens:
        raise ValueError(f"input_length {request.input_length} exceeds {len(request.hash_ids)} hash ids "
                         f"of {hash_tokens} tokens")
    blocks = request.input_length // block_tokens
    if hash_tokens >= block_tokens:
        if hash_tokens % block_tokens:
            raise ValueError(f"hash_tokens ({hash_tokens}) must be a multiple of block_tokens ({block_tokens})")
        per = hash_tokens // block_tokens
        return [request.hash_ids[k // per] * per + k % per for k in range(blocks)]
    if block_tokens % hash_tokens:
        raise ValueError(f"block_tokens ({block_tokens}) must be a multiple of hash_tokens ({hash_tokens})")
    ids = block_tokens // hash_tokens
    return [request.hash_ids[(k + 1) * ids - 1] for k in range(blocks)]


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


def session_slice(requests: Sequence[TraceRequest], sessions: int, min_turns: int = 1) -> list[TraceRequest]:
    """Every request of the first `sessions` sessions with at least `min_turns` requests, in trace
    order. A session is the requests sharing their first two hash ids (a conversation whose first
    prompt is over one hash id long); a one-id request is a session of its own."""
    turns = Counter(r.hash_ids[:2] for r in requests)
    chosen: set[tuple[int, ...]] = set()
    picked = []
    for request in requests:
        key = request.hash_ids[:2]
        if key not in chosen and len(chosen) < sessions and turns[key] >= min_turns:
            chosen.add(key)
        if key in chosen:
            picked.append(request)
    return picked


def agent_trace(seed: int = 0, sessions: int = 1500, seconds: float = 3600.0) -> list[TraceRequest]:
    """An agent-like workload in Mooncake's format (hash ids of 512 tokens), sorted by arrival: four fixed system
    prompts with tool definitions (3K to 12K tokens, the most used first: 45/30/15/10% of sessions), each session
    1-12 turns (geometric, mean 4), each turn a user message of 1-2 ids and a tool result of 0-6 ids nobody sent
    before, the previous answers part of later prompts, turns 5-60 s apart, sessions arriving uniformly."""
    rng = np.random.default_rng(seed)
    systems = [tuple(range(base, base + length)) for base, length in ((1, 6), (100, 10), (200, 16), (300, 24))]
    fresh = iter(range(10_000, 1 << 40))
    requests = []
    for _ in range(sessions):
        ids = list(systems[rng.choice(4, p=[0.45, 0.30, 0.15, 0.10])])
        at = rng.uniform(0, seconds * 1000)
        for _turn in range(min(12, int(rng.geometric(0.25)))):
            ids += [next(fresh) for _ in range(int(rng.integers(1, 3)) + int(rng.integers(0, 7)))]
            output = int(rng.integers(100, 800))
            requests.append(TraceRequest(int(at), len(ids) * MOONCAKE_HASH_TOKENS - int(rng.integers(0, 512)), output,
                                         tuple(ids)))
            ids += [next(fresh) for _ in range(-(-output // MOONCAKE_HASH_TOKENS))]  # the answer, in the next prompt
            at += rng.uniform(5_000, 60_000)
    return sorted(requests)
