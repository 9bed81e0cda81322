"""Index-level replay of a trace under DeepInfer's rules (no model, no disk): hit tokens per request.

Per request, in arrival order (each request's saves land before the next request arrives):
  1. lookup: the prompt's full blocks, at most (input_length - 1) // B of them (one prompt token is
     always left to prefill, PrefixLookup.usable_blocks); the hit's segments are touched.
  2. first save (engine, after the first token): prompt blocks [hit, input_length // B).
  3. second save (engine, after the answer): blocks [max(hit, input_length // B),
     (input_length + output_length - 1) // B): the answer's latents, but for its last token, which
     is never fed back through the model. Answer tokens have no ids in the trace, so these blocks
     are unique to the request: they take capacity and are never hit.
The trace's ceiling: every prompt token whose hash id was seen in any earlier request counts.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

from kvstore import CacheGeometry

from .trace_format import TraceRequest, prompt_block_keys
from .trace_store_model import StoreModel, segment_bytes


class ReplayResult(NamedTuple):
    requests: int
    input_tokens: int
    hit_tokens: int           # prompt tokens served from the cache
    hit_requests: int         # requests with at least one hit block
    saved_blocks: int         # blocks written (prompt and answer)
    evictions: int            # segments evicted for capacity
    failed_saves: int
    live_blocks: int          # blocks held at the end
    segment_sizes: dict[int, int]   # blocks per written segment -> segments
    per_request_hits: list[int]     # hit tokens of each request

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


def replay(requests: Iterable[TraceRequest], store: StoreModel, hash_tokens: int) -> ReplayResult:
    """Runs `requests` through `store` (fresh or warm) under the rules above."""
    B = store.geometry.block_tokens
    answer_key = -1
    count = inputs = hits = hit_requests = saved = 0
    per_request = []
    for request in requests:
        keys = prompt_block_keys(request, hash_tokens, B)
        usable = max(0, (request.input_length - 1) // B)
        hit_blocks, segments = store.lookup(keys[:usable])
        store.touch(segments)
        saved += store.save(keys, hit_blocks)
        history_blocks = (request.input_length + request.output_length - 1) // B
        answer_start = max(hit_blocks, len(keys))
        if history_blocks > answer_start:
            answer = list(range(answer_key, answer_key - (history_blocks - len(keys)), -1))
            answer_key -= len(answer)
            saved += store.save(keys + answer, answer_start)
        count += 1
        inputs += request.input_length
        hits += hit_blocks * B
        hit_requests += hit_blocks > 0
        per_request.append(hit_blocks * B)
    return ReplayResult(count, inputs, hits, hit_requests, saved, store.evictions, store.failed_saves,
                        store.live_blocks(), dict(store.segment_sizes), per_request)


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
