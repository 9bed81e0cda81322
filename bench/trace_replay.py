"""Index-level replay of a trace under DeepInfer's rules (no model, no disk): hit tokens per request.

Per request, in arrival order (each request's saves land before the next request arrives):
  1. lookup: the prompt's full blocks, at most (input_length - 1) // B of them (one prompt token is
     always left to prefill, PrefixLookup.usable_blocks); the hit's segments are touched.
  2. first save (engine, after the first token): prompt blocks [hit, input_length // B).
  3. second save (engine, after the answer): blocks [max(hit, input_length // B),
     (input_length + output_length - 1) // B): the answer's latents, but for its last token, which
     is never fed back through the model. Answer tokens have no ids in the trace, so these blocks
     are unique to the request: they take capacity and are never hit.
With admission (`admit_after` N > 1, the gateway's --admit-after), step 1 also counts a sighting of each looked-up
block (per chained key, as PrefixIndex.lookup does; the trace's hour is well inside the sighting window) and the
admitted blocks are the leading ones indexed already or seen N times; step 2 saves prompt blocks [hit, admitted)
only, and step 3 saves nothing (the engine writes no block past the admitted count).
The trace's ceiling: every prompt token whose hash id was seen in any earlier request counts.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple, Sequence

from kvstore import CacheGeometry

from .trace_format import TraceRequest, prompt_block_keys
from .trace_store_model import StoreModel, segment_bytes


class ReplayResult(NamedTuple):
    requests: int
    input_tokens: int
    hit_tokens: int           # prompt tokens served from the cache
    hit_requests: int         # requests with at least one hit block
    mostly_hit_requests: int  # requests with at least half of the prompt hit
    saved_blocks: int         # blocks written (prompt and answer)
    evictions: int            # segments evicted for capacity
    failed_saves: int
    live_blocks: int          # blocks held at the end
    segment_sizes: dict[int, int]   # blocks per written segment -> segments
    per_request_hits: list[int]     # hit tokens of each request
    stranded_tokens: int = 0        # prompt tokens still cached but behind a gap (an evicted block before them)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def bytes_written(self, geometry: CacheGeometry) -> int:
        """Segment bytes written (latents plus headers) if the store had this geometry."""
        return sum(n * segment_bytes(geometry, blocks) for blocks, n in self.segment_sizes.items())

    def bytes_read(self, geometry: CacheGeometry) -> int:
        """Latent bytes read for every hit token, all layers."""
        return self.hit_tokens * geometry.num_layers * geometry.row_bytes


def capacity_budget(capacity_tokens: int | None, geometry: CacheGeometry, volumes: int) -> int | None:
    """Per-volume byte budget whose volumes together hold `capacity_tokens` tokens of latents
    (segment headers come out of it too: about 0.1% of a full segment)."""
    if capacity_tokens is None:
        return None
    return capacity_tokens * geometry.num_layers * geometry.row_bytes // volumes


class _Replay:
    """One request's three steps (lookup, prompt save, answer save) against a StoreModel."""

    def __init__(self, store: StoreModel, hash_tokens: int, admit_after: int = 1) -> None:
        self.store = store
        self.hash_tokens = hash_tokens
        self.admit_after = admit_after
        self.sightings: Counter[int] = Counter()
        self.answer_key = -1
        self.saved = 0
        self.stranded_blocks = 0

    def lookup(self, request: TraceRequest) -> tuple[list[int], int]:
        """The prompt's block keys and its hit; with admission, the keys end at the admitted blocks."""
        B = self.store.geometry.block_tokens
        keys = prompt_block_keys(request, self.hash_tokens, B)
        usable = keys[:max(0, (request.input_length - 1) // B)]
        hit_blocks, segments = self.store.lookup(usable)
        self.store.touch(segments)
        index = self.store.index
        self.stranded_blocks += sum(1 for key in usable[hit_blocks + 1:] if key in index)
        if self.admit_after > 1:
            admitted = hit_blocks
            for i, key in enumerate(usable):
                self.sightings[key] += 1
                if i == admitted and self.sightings[key] >= self.admit_after:
                    admitted += 1
            keys = keys[:admitted]
        return keys, hit_blocks

    def save_prompt(self, keys: list[int], hit_blocks: int) -> None:
        self.saved += self.store.save(keys, hit_blocks)

    def save_answer(self, request: TraceRequest, keys: list[int]) -> None:
        if self.admit_after > 1:
            return  # the answer's blocks are past the admitted ones
        history_blocks = (request.input_length + request.output_length - 1) // self.store.geometry.block_tokens
        if history_blocks > len(keys):
            answer = list(range(self.answer_key, self.answer_key - (history_blocks - len(keys)), -1))
            self.answer_key -= len(answer)
            self.saved += self.store.save(keys + answer, len(keys))

    def result(self, requests: Sequence[TraceRequest], hit_blocks: Sequence[int]) -> ReplayResult:
        B, store = self.store.geometry.block_tokens, self.store
        return ReplayResult(len(requests), sum(r.input_length for r in requests), sum(hit_blocks) * B,
                            sum(h > 0 for h in hit_blocks),
                            sum(2 * h * B >= r.input_length for h, r in zip(hit_blocks, requests)), self.saved, store.evictions, store.failed_saves,
                            store.live_blocks(), dict(store.segment_sizes), [h * B for h in hit_blocks],
                            self.stranded_blocks * B)


def replay(requests: Iterable[TraceRequest], store: StoreModel, hash_tokens: int, admit_after: int = 1) -> ReplayResult:
    """Runs `requests` through `store` (fresh or warm) under the rules above."""
    steps, done, hits = _Replay(store, hash_tokens, admit_after), [], []
    for request in requests:
        keys, hit_blocks = steps.lookup(request)
        steps.save_prompt(keys, hit_blocks)
        steps.save_answer(request, keys)
        done.append(request)
        hits.append(hit_blocks)
    return steps.result(done, hits)


def replay_timed(requests: Sequence[TraceRequest], store: StoreModel, hash_tokens: int,
                 times: Sequence[tuple[float, float, float]]) -> ReplayResult:
    """Like replay(), but each request's lookup, prompt save and answer save happen at the given
    times (seconds; e.g. arrival, first token, end of a live run), so a save still in flight when a
    later request looks up is not there yet."""
    steps = _Replay(store, hash_tokens)
    events = sorted((t, step, i) for i, triple in enumerate(times) for step, t in enumerate(triple))
    keys: dict[int, list[int]] = {}
    hits = [0] * len(requests)
    for _, step, i in events:
        if step == 0:
            keys[i], hits[i] = steps.lookup(requests[i])
        elif step == 1:
            steps.save_prompt(keys[i], hits[i])
        else:
            steps.save_answer(requests[i], keys[i])
    return steps.result(requests, hits)


def trace_ceiling(requests: Sequence[TraceRequest], hash_tokens: int) -> tuple[int, int]:
    """(prompt tokens whose hash id some earlier request had, all prompt tokens)."""
    seen: set[int] = set()
    hits = inputs = 0
    for request in requests:
        for position, h in enumerate(request.hash_ids):
            if h in seen:
                hits += min(hash_tokens, request.input_length - position * hash_tokens)
        seen.update(request.hash_ids)
        inputs += request.input_length
    return hits, inputs
