"""bench.trace_*: the index-level trace replay on tiny hand-computed traces, checked against the real
BlockStore (real volumes, real Valkey), and a short live replay through a real tiny stack."""
from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from bench.trace_format import (TraceRequest, load_trace, prompt_block_keys, prompt_token_ids, scale_request,
                                session_slice)
from bench.trace_replay import capacity_budget, replay, replay_timed, trace_ceiling
from bench.trace_store_model import StoreModel, segment_bytes
from kvstore import BlockStore, CacheGeometry, PrefixIndex, block_hashes, open_redis

# Hash ids of 4 tokens, blocks of 2: hash id h covers blocks with keys 2h and 2h + 1.
G = CacheGeometry(num_layers=1, latent_dim=4, block_tokens=2)
H = 4


def req(ids, input_length, output_length=1, t=0):
    return TraceRequest(t, input_length, output_length, tuple(ids))


def run(requests, volumes=1, budget=None, max_segment_blocks=64):
    store = StoreModel(G, volumes, budget, max_segment_blocks)
    return replay(requests, store, H), store


def test_ceiling_counts_every_token_of_a_hash_id_seen_before():
    trace = [req([1, 2], 8), req([1, 2, 3], 10), req([1, 4], 6)]
    # 0, then ids 1 and 2 (8 tokens), then id 1 (4 tokens); id 4 of the last is new.
    assert trace_ceiling(trace, H) == (12, 24)


def test_partial_last_hash_id_and_the_one_token_left_rule():
    result, _ = run([req([1, 2], 7), req([1, 2], 7)])
    # 7 tokens = 3 full blocks + 1 token; the repeat may use (7 - 1) // 2 = 3 blocks = 6 tokens,
    # where the trace's ceiling counts all 7.
    assert result.per_request_hits == [0, 6]
    assert trace_ceiling([req([1, 2], 7), req([1, 2], 7)], H) == (7, 14)

    result, store = run([req([5], 4), req([5], 4)])
    # 4 tokens = 2 full blocks, but one token stays to prefill: only block 0 hits, block 1 is saved again.
    assert result.per_request_hits == [0, 2]
    assert result.saved_blocks == 3 and len(store.segments) == 2


def test_answer_blocks_take_capacity_and_never_hit():
    result, store = run([req([7], 4, output_length=5), req([7, 8], 8)])
    # History 4 + 5 - 1 = 8 tokens: 2 prompt blocks, then 2 answer blocks in a second save.
    assert result.per_request_hits == [0, 4]
    assert result.saved_blocks == 2 + 2 + 2  # then the second prompt's blocks of id 8
    assert sorted(result.segment_sizes.items()) == [(2, 3)]
    assert store.live_blocks() == 6


def test_capacity_evicts_the_least_recently_hit_segment_first():
    budget = int(2.5 * segment_bytes(G, 2))
    a, b, c = req([1, 11], 5), req([2, 12], 5), req([3, 13], 5)  # 2 full blocks each, one segment each
    result, store = run([a, b, a, c, a, b], budget=budget)
    # a is hit (touched) after b was saved, so c's save evicts b, not a (first in, but hit since);
    # a is hit again, so b's return evicts c.
    assert result.per_request_hits == [0, 0, 4, 0, 4, 0]
    assert result.evictions == 2
    assert max(store.used) <= budget


def test_a_block_evicted_from_the_middle_of_a_chain_strands_the_rest():
    budget = int(3.5 * segment_bytes(G, 1))
    first, other = req([1, 9], 5), req([7, 17], 5)
    result, _ = run([first, other, first], budget=budget, max_segment_blocks=1)
    # `other` evicts the least recent one-block segment: block 0 of `first`; its block 1 is still
    # stored, but a lookup stops at the gap, so the repeat misses entirely.
    assert result.per_request_hits == [0, 0, 0]
    assert result.stranded_tokens == 2


def test_eviction_is_per_volume_and_placement_is_least_used_first():
    budget = int(1.5 * segment_bytes(G, 1))
    result, store = run([req([1, 11], 5), req([2, 12], 5), req([1, 11], 5)], volumes=2, budget=budget, max_segment_blocks=1)
    # Each save is 2 one-block segments, one per volume; each volume holds one, so request 2's save
    # evicts request 1's segment on both volumes.
    assert result.per_request_hits == [0, 0, 0]
    assert result.evictions == 4
    assert sorted(s.volume for s in store.segments.values()) == [0, 1]


def test_a_segment_over_the_budget_fails_its_save():
    result, _ = run([req([1, 2, 3], 9), req([1, 2, 3], 9)], budget=segment_bytes(G, 2))
    assert result.failed_saves == 2 and result.per_request_hits == [0, 0]


def test_capacity_budget_and_bytes():
    v3 = CacheGeometry(num_layers=61)
    assert capacity_budget(1_000_000, v3, 4) == 1_000_000 * 61 * 1152 // 4
    result, _ = run([req([1], 4), req([1], 4)])
    assert result.bytes_read(v3) == 2 * 61 * 1152
    assert result.bytes_written(v3) == segment_bytes(v3, 2) + segment_bytes(v3, 1)


def test_blocks_of_several_hash_ids_take_the_last_id_as_key():
    # Hash ids of 2 tokens, blocks of 4: a block is named by the last id it covers (ids are chained).
    assert prompt_block_keys(req([5, 6, 7, 8], 7), 2, 4) == [6]
    assert prompt_block_keys(req([5, 6, 7, 8], 8), 2, 4) == [6, 8]


def test_session_slice_takes_every_turn_of_the_first_sessions():
    trace = [req([0, 1], 4), req([0, 2], 4), req([0, 1, 3], 6), req([0, 5], 4), req([0, 2, 4], 6),
             req([0, 1, 3, 6], 8)]
    assert session_slice(trace, 1, min_turns=2) == [trace[0], trace[2], trace[5]]
    assert session_slice(trace, 2, min_turns=2) == [trace[0], trace[1], trace[2], trace[4], trace[5]]
    assert session_slice(trace, 3) == trace


def test_trace_mapping_and_scaling(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"timestamp": 5, "input_length": 1100, "output_length": 9, "hash_ids": [3, 4, 9]}) + "\n")
    (request,) = load_trace(path)
    keys = prompt_block_keys(request, 512, 64)
    assert len(keys) == 1100 // 64 and keys[:2] == [24, 25] and keys[8] == 32 and keys[16] == 72
    small = scale_request(request, 8)
    assert (small.input_length, small.output_length) == (64 + 64 + 10, 2)
    tokens = prompt_token_ids(small, 64, (100, 1000))
    assert len(tokens) == 138 and tokens[:64] == prompt_token_ids(req([3], 64), 64, (100, 1000))
    with pytest.raises(ValueError, match="input_length"):
        prompt_block_keys(req([1], 600), 512, 64)


# ---- the model against the real BlockStore ------------------------------------------------------

def synthetic_trace(seed: int, hash_tokens: int, conversations: int = 4, turns: int = 4) -> list[TraceRequest]:
    """Multi-turn chats over one shared system block, interleaved: prefix-chained ids of `hash_tokens`."""
    rng = random.Random(seed)
    requests = []
    for c in range(conversations):
        ids = [0] + [100 * (c + 1) + k for k in range(2 * turns + 2)]
        for t in range(turns):
            n = 2 + 2 * t + rng.randrange(2)
            requests.append(req(ids[:n], n * hash_tokens - rng.randrange(hash_tokens), rng.randrange(1, 40)))
    order = sorted(range(len(requests)), key=lambda i: (i % turns, rng.random()))  # turns in order
    return [requests[i] for i in order]


@pytest.mark.parametrize("admit_after", [1, 2])
async def test_model_matches_the_real_block_store(tmp_path, redis_url, admit_after):
    """The model's capacity rules and, with admit_after 2, its admission against the real BlockStore and the
    real index's sighting counts, with the engine's rule: no block written past the admitted count."""
    geometry, hash_tokens, fingerprint = CacheGeometry(num_layers=2, block_tokens=16), 32, "f" * 32
    B = geometry.block_tokens
    trace = synthetic_trace(seed=7, hash_tokens=hash_tokens)
    budget = int(6.2 * segment_bytes(geometry, 2))
    model = StoreModel(geometry, volumes=2, budget_bytes=budget, max_segment_blocks=2)
    expected = replay(trace, model, hash_tokens, admit_after)
    # The case exercises both; no save is over a budget (then the real store evicts on its volumes in
    # a set's order before it raises, which the model cannot know).
    assert expected.evictions > (5 if admit_after == 1 else 0) and expected.hit_tokens > 0
    assert expected.failed_saves == 0

    client = open_redis(redis_url)
    store = await BlockStore.open([str(tmp_path / "a"), str(tmp_path / "b")], geometry, fingerprint,
                                  PrefixIndex(client), mac_key="bench-trace-mac-key", threads=2, budget_bytes=budget,
                                  max_segment_blocks=2,
                                  reader_grace_s=0.0)
    rng = np.random.default_rng(0)
    hits, failed = [], 0
    try:
        for request in trace:
            tokens = prompt_token_ids(request, hash_tokens, (10, 50_000))
            answer = rng.integers(60_000, 120_000, request.output_length - 1).tolist()
            chain = block_hashes(tokens + answer, fingerprint, "", B)
            prompt_blocks = len(tokens) // B
            hit = await store.index.lookup(chain[:(len(tokens) - 1) // B], admit_after)
            limit = hit.admitted if admit_after > 1 else len(chain)  # the engine's save_blocks
            # What BlockStore.prefetch records in the background, awaited so the order is certain.
            await store.ledger.touch([(r.volume, r.segment) for r in hit.runs])
            await asyncio.sleep(0.003)  # the ledger's clock is in ms
            for begin, end in ((hit.blocks, min(prompt_blocks, limit)),
                               (max(hit.blocks, prompt_blocks), min(len(chain), limit))):
                if end > begin:
                    layers = [np.zeros(((end - begin) * B, geometry.latent_dim), geometry.np_dtype)] * 2
                    try:
                        await store.save(chain[:end], layers, start_block=begin)
                    except ValueError:  # over a volume's budget: the engine logs it and goes on
                        failed += 1
                    await asyncio.sleep(0.003)
            hits.append(hit.blocks * B)
        assert hits == expected.per_request_hits
        assert (store.stats.evictions, failed) == (expected.evictions, expected.failed_saves)
        used = await store.ledger.used(list(store.volumes))
        assert sorted(used.values()) == sorted(model.used)
    finally:
        await store.close()
        await client.aclose()


# ---- the whole benchmark ---------------------------------------------------------------------------

def test_timed_replay_sees_only_saves_that_landed():
    trace = [req([1, 11], 5), req([1, 11], 5), req([1, 11], 5)]
    # Request 0's prompt save lands at 2.0 s: request 1 (looking up at 1.0 s) misses, request 2 hits.
    times = [(0.0, 2.0, 3.0), (1.0, 4.0, 5.0), (2.5, 6.0, 7.0)]
    result = replay_timed(trace, StoreModel(G), H, times)
    assert result.per_request_hits == [0, 0, 4]


def test_admission_writes_a_block_on_its_nth_sighting_and_never_an_answer():
    trace = [req([1, 11], 8, output_length=5), req([1, 11], 8), req([1, 11], 8), req([1, 12], 8)]
    result, store = run(trace[:1])
    assert result.saved_blocks == 4 + 2  # N = 1: the prompt's 4 blocks, then its answer's 2
    store = StoreModel(G)
    result = replay(trace, store, H, admit_after=2)
    # Usable blocks: (8 - 1) // 2 = 3. Request 0: first sighting, nothing written; request 1: second
    # sighting, its 3 usable blocks written (not the 4th, never looked up); request 2 hits them; request 3
    # shares id 1's two blocks (seen 4 times, on disk), and its id 12 is a first sighting.
    assert result.per_request_hits == [0, 0, 6, 4]
    assert result.saved_blocks == 3 and store.live_blocks() == 3


def test_admission_default_is_the_n_within_a_point_that_writes_least():
    from bench.trace_bench import admission_default

    def rows(*cells):
        return [{"label": label, "admit_after": n, "hit_ratio": hit, "bytes_written": written}
                for label, n, hit, written in cells]
    close = [{"name": "a", "rows": rows(("1M", 1, 0.300, 100), ("1M", 2, 0.295, 40), ("1M", 3, 0.280, 20))},
             {"name": "b", "rows": rows(("1M", 1, 0.500, 100), ("1M", 2, 0.505, 50), ("1M", 3, 0.499, 30))}]
    assert admission_default(close) == 2  # 3 loses 2 points on "a"
    far = [close[0], {"name": "b", "rows": rows(("1M", 1, 0.5, 100), ("1M", 2, 0.47, 50), ("1M", 3, 0.45, 30))}]
    assert admission_default(far) == 1


def test_the_agent_workload_is_fixed_by_its_seed_and_chained():
    from bench.trace_format import agent_trace

    trace = agent_trace(seed=3, sessions=40)
    assert trace == agent_trace(seed=3, sessions=40) and trace != agent_trace(seed=4, sessions=40)
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    systems = {r.hash_ids[0] for r in trace}
    assert systems <= {1, 100, 200, 300} and len(systems) > 1
    # Ids are chained: an id past the system prompt names one place in one session's history.
    place = {}
    for r in trace:
        for position, h in enumerate(r.hash_ids):
            assert place.setdefault(h, (position, r.hash_ids[:position])) == (position, r.hash_ids[:position])


def test_index_level_on_a_small_trace(tmp_path):
    from bench.trace_bench import build_parser, index_level

    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 1000, "input_length": 1600, "output_length": 10, "hash_ids": [0, 1, 2, 3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = build_parser().parse_args(["--trace", str(path), "--capacities", "100k", "inf", "--no-live", "--quiet"])
    index = index_level(args)
    # Request 1 shares ids 0, 1 and 2 (1,100 tokens, 2 full ids + 76 tokens): the ceiling counts
    # 512 + 512 + 512 (id 2 is full in request 1); DeepInfer hits the 17 full blocks request 0 saved.
    assert index["ceiling"]["hit_tokens"] == 1536
    assert [r["hit_tokens"] for r in index["capacity"]] == [17 * 64, 17 * 64]
    assert index["capacity"][0]["bytes"]["deepseek-v3"]["read_bytes_per_hit_token"] == 61 * 1152


def test_live_replay_through_a_real_stack_matches_the_timed_model():
    from bench.trace_bench import build_parser, live

    # The first session of >= 4 turns: arrivals at 0, 546, 642 and 732 s, here 0, 18, 21 and 24 s.
    args = build_parser().parse_args(["--sessions", "1", "--min-turns", "4", "--time-scale", "30",
                                      "--max-output", "2", "--quiet"])
    result = live(args)
    seen = [(r["hit_tokens"], round(r["arrival_s"], 1), round(r["ttft_s"], 2), round(r["latency_s"], 2), r["error"])
            for r in result["per_request"]]
    assert result["errors"] == 0 and result["requests"] == 4, seen
    assert result["hit_ratio"] > 0, seen
    assert result["requests_matching_timed_prediction"] == 4, seen
    assert result["ttft"]["all"]["p50_s"] > 0
