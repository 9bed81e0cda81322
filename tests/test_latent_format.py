"""The fp8 latent format (kvstore/latent_format.py): the codec against FlashMLA's FP8-with-scale layout, and the
binding that keeps the two formats apart (a reader of the other format misses, never misreads): through a real
BlockStore on real volumes with a real Valkey index, and through the kvstore service as a real process."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvstore import BlockStore, CacheGeometry, PrefixIndex, block_hashes, open_redis
from kvstore.block_check import nonfinite_stored_blocks
from kvstore.latent_format import cache_fingerprint, dequantize, quantize
from kvstore.segment import decode_header
from model.config import preset
from model.weights import init_model, save_model
from services.kvstore.client import KvstoreClient, KvstoreError
from tests.test_kvstore_service import FP as SERVICE_FP, SERVICE_TOKEN, start_service

MODEL_FP = "format-model-fp"
SALT = "ab" * 16
BF16 = CacheGeometry(num_layers=2, latent_dim=576, block_tokens=16)
FP8 = CacheGeometry(num_layers=2, latent_dim=576, block_tokens=16, fp8_dims=512)


def latents(tokens: int, seed: int, latent_dim: int = 576) -> np.ndarray:
    """(tokens, latent_dim) bf16 latents whose rows span 1e-3..1e2 in magnitude, one c_kv tile all zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, latent_dim), dtype=np.float32) * np.logspace(-3, 2, tokens)[:, None]
    x[0, :min(128, latent_dim - 16)] = 0
    return x.astype(ml_dtypes.bfloat16)


def fp8_rows(x: np.ndarray, g: CacheGeometry) -> np.ndarray:
    return np.array(quantize(jnp.asarray(x), g))  # a writable host copy


def test_the_fp8_row_is_flashmlas_656_bytes_and_bf16_geometry_is_unchanged():
    assert (FP8.row_bytes, FP8.block_bytes, FP8.row_dtype, FP8.latent_format) == (656, 16 * 656, np.uint8, "fp8")
    assert [part[:2] for part in FP8.row_parts] == [(0, 512), (512, 528), (528, 656)]
    assert "fp8_dims" not in BF16.as_dict() and CacheGeometry(**BF16.as_dict()) == BF16  # bf16 headers as before
    assert CacheGeometry(**FP8.as_dict()) == FP8
    assert CacheGeometry(2, 48, 64, fp8_dims=32).row_bytes == 72  # tiny: 32 + 4 + 16 * 2, padded to 8-byte words
    assert cache_fingerprint(MODEL_FP, "bf16") == MODEL_FP != cache_fingerprint(MODEL_FP, "fp8")


@pytest.mark.parametrize("latent_dim, fp8_dims", [(576, 512), (48, 32)])  # DeepSeek's, and tiny's partial tile
def test_quantize_round_trips_within_fp8_error_per_tile_with_the_rope_part_bit_exact(latent_dim, fp8_dims):
    g = CacheGeometry(1, latent_dim, 64, fp8_dims=fp8_dims)
    x = latents(64, seed=1, latent_dim=latent_dim)
    rows = fp8_rows(x, g)
    assert rows.shape == (64, g.row_bytes) and rows.dtype == np.uint8
    assert np.array_equal(fp8_rows(x.view(np.uint16), g), rows)  # from the pool's raw bits: the same bytes
    (_, c, _), (_, s, _), (_, r, _) = g.row_parts
    tiles = g.scale_tiles
    c_kv = np.pad(x[:, :c].astype(np.float32), ((0, 0), (0, tiles * 128 - c))).reshape(64, tiles, 128)
    amax = np.abs(c_kv).max(-1)  # (tokens, tiles)
    scales = rows[:, c:s].copy().view("<f4")
    mantissa, exponent = np.frexp(np.maximum(amax / np.float32(448), np.float32(1e-4)))
    assert np.array_equal(scales, np.ldexp(np.float32(1), exponent - (mantissa == 0.5)))  # FlashMLA's power of two
    assert np.array_equal(rows[:, r:], np.zeros_like(rows[:, r:]))  # padding

    y = np.asarray(dequantize(jnp.asarray(rows), g))
    assert y.dtype == x.dtype and y.shape == x.shape
    error = np.abs(np.pad(y[:, :c].astype(np.float32) - x[:, :c].astype(np.float32),
                          ((0, 0), (0, tiles * 128 - c)))).reshape(64, tiles, 128).max(-1)
    # e4m3 keeps 3 mantissa bits (half an ulp: 2^-4 of a value, at most of the tile's max), bf16 8 more
    assert np.all(error <= amax * (2.0 ** -4 + 2.0 ** -8)), (error / np.maximum(amax, 1e-30)).max()
    assert not y[0, :min(128, c)].astype(np.float32).any()  # an all-zero tile stays zero
    assert np.array_equal(y[:, c:].view(np.uint16), x[:, c:].view(np.uint16))  # k_pe bit-exact
    assert np.array_equal(rows[:, s:s + 2 * (latent_dim - c)].copy().view(np.uint16), x[:, c:].view(np.uint16))


def test_the_nonfinite_check_reads_each_part_of_an_fp8_row_at_its_own_dtype():
    rows = fp8_rows(latents(3 * 16, seed=2), FP8)  # 3 blocks
    (_, c, _), (_, s, _), _ = FP8.row_parts
    rows[5, c:c + 4] = np.frombuffer(np.float32(3.0e38).tobytes(), np.uint8)  # a finite scale holding 0x7F/0xFF
    rows[6, s:s + 2] = 0x7F  # k_pe = 0x7F7F: the largest finite bf16, bytes that are NaN in e4m3
    assert not nonfinite_stored_blocks(rows, FP8).any()
    nan_c_kv, nan_scale, inf_rope = rows.copy(), rows.copy(), rows.copy()
    nan_c_kv[16 + 3, 100] = 0x7F  # e4m3fn NaN, block 1
    nan_scale[32 + 1, c:c + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)  # block 2
    inf_rope[2, s:s + 2] = np.frombuffer(np.array(np.inf, ml_dtypes.bfloat16).tobytes(), np.uint8)  # block 0
    assert nonfinite_stored_blocks(nan_c_kv, FP8).tolist() == [False, True, False]
    assert nonfinite_stored_blocks(nan_scale, FP8).tolist() == [False, False, True]
    assert nonfinite_stored_blocks(inf_rope, FP8).tolist() == [True, False, False]


@pytest.fixture
async def index(redis_url):
    client = open_redis(redis_url)
    yield PrefixIndex(client, "fmt")
    await client.aclose()


def tokens(seed: int, blocks: int = 3) -> list[int]:
    return [(seed * 7919 + i * 13) % 50_000 for i in range(blocks * 16)]


async def read_all(store, hit) -> tuple[list[np.ndarray], int]:
    p = store.prefetch(hit)
    layers = [await p.layer(layer) for layer in range(store.geometry.num_layers)]
    return layers, await p.valid_tokens()


async def test_an_fp8_segment_is_a_miss_for_a_bf16_reader_and_vice_versa(tmp_path, index):
    """Both formats' stores share volumes and an index: each reads its own blocks back byte for byte, finds none of
    the other's (their block hashes differ), and handed the other's hit anyway (a forged or stale location) reads
    zero valid tokens: by the fingerprint, and by the header's geometry alone when the fingerprints are made equal."""
    volumes = [str(tmp_path / "ssd0"), str(tmp_path / "ssd1")]
    stores = {name: await BlockStore.open(volumes, g, cache_fingerprint(MODEL_FP, name), index, mac_key="fmt-mac",
                                          threads=2, max_segment_blocks=4)
              for name, g in (("bf16", BF16), ("fp8", FP8))}
    try:
        hits, stored = {}, {}
        for seed, (name, store) in enumerate(stores.items()):
            x = [latents(3 * 16, seed=10 * seed + layer) for layer in range(2)]
            stored[name] = x if name == "bf16" else [fp8_rows(layer, FP8) for layer in x]
            hashes = block_hashes(tokens(seed), store.fingerprint, SALT, 16)
            result = await store.save(hashes, stored[name])
            segment = next(Path(v) / "segments" / result.segments[0] for v in volumes
                           if (Path(v) / "segments" / result.segments[0]).exists())
            header = decode_header(segment.read_bytes())
            assert header.geometry.latent_format == name
            assert segment.stat().st_size - header.data_offset == 3 * 2 * 16 * store.geometry.row_bytes
            hits[name] = await index.lookup(hashes)
            assert hits[name].blocks == 3
            layers, valid = await read_all(store, hits[name])
            assert valid == 3 * 16 and all(np.array_equal(a, b) for a, b in zip(layers, stored[name]))

        for reader, other in (("bf16", "fp8"), ("fp8", "bf16")):
            store = stores[reader]
            other_tokens = tokens(list(stores).index(other))
            assert (await index.lookup(block_hashes(other_tokens, store.fingerprint, SALT, 16))).blocks == 0
            failures = store.stats.verification_failures
            layers, valid = await read_all(store, hits[other])
            assert valid == 0 and all(len(layer) == 0 for layer in layers)
            assert store.stats.verification_failures == failures + 1
    finally:
        for store in stores.values():
            await store.close()

    # the header alone: a reader under the fp8 fingerprint but bf16 geometry (a misconfigured one) misses too
    fp8_hashes = block_hashes(tokens(1), cache_fingerprint(MODEL_FP, "fp8"), SALT, 16)
    writer = await BlockStore.open(volumes, FP8, cache_fingerprint(MODEL_FP, "fp8"), index, mac_key="fmt-mac",
                                   threads=2)
    await writer.save(fp8_hashes, stored["fp8"])
    hit = await index.lookup(fp8_hashes)
    await writer.close()
    misconfigured = await BlockStore.open(volumes, BF16, cache_fingerprint(MODEL_FP, "fp8"), index,
                                          mac_key="fmt-mac", threads=2)
    try:
        assert hit.blocks == 3 and (await read_all(misconfigured, hit))[1] == 0
    finally:
        await misconfigured.close()


async def test_the_kvstore_service_carries_fp8_rows_and_refuses_the_other_format(tmp_path, valkey_server):
    """The service stores and serves fp8 rows as they are (656 bytes a token a layer on its volumes); a client
    of the other format is refused its saves (409) and reads nothing, in both directions."""
    url = valkey_server.connection_url
    (tmp_path / "bf16").mkdir(), (tmp_path / "fp8").mkdir()
    bf16_proc, bf16_url = start_service(tmp_path / "bf16", url, "--index-prefix", "fmt-bf16")
    fp8_proc, fp8_url = start_service(tmp_path / "fp8", url, "--index-prefix", "fmt-fp8", "--latent-format", "fp8")
    geometry = {"bf16": CacheGeometry(4, 576, 16), "fp8": CacheGeometry(4, 576, 16, fp8_dims=512)}
    clients = {(name, svc): KvstoreClient(svc_url, geometry[name], cache_fingerprint(SERVICE_FP, name),
                                          service_token=SERVICE_TOKEN)
               for name in geometry for svc, svc_url in (("bf16", bf16_url), ("fp8", fp8_url))}
    try:
        hits = {}
        for name in geometry:
            x = [latents(2 * 16, seed=layer) for layer in range(4)]
            rows = x if name == "bf16" else [fp8_rows(layer, geometry[name]) for layer in x]
            hashes = block_hashes(tokens(5, blocks=2), cache_fingerprint(SERVICE_FP, name), SALT, 16)
            client = clients[(name, name)]
            result = await client.save(hashes, rows)
            assert result.blocks == 2
            hits[name] = await client.lookup(hashes)
            p = client.prefetch(hits[name])
            assert await p.valid_tokens() == 32
            assert all([np.array_equal(await p.layer(layer), rows[layer]) for layer in range(4)])
            sizes = [f.stat().st_size for f in (tmp_path / name).glob("v*/segments/*")]
            assert len(sizes) == 1 and sizes[0] - hits[name].runs[0].data_offset == 2 * 4 * 16 * {
                "bf16": 1152, "fp8": 656}[name]
        for name, other in (("bf16", "fp8"), ("fp8", "bf16")):
            client = clients[(name, other)]  # a client of one format at the other's service
            with pytest.raises(KvstoreError) as refused:
                await client.save(block_hashes(tokens(6, blocks=1), client.fingerprint, SALT, 16),
                                  [np.zeros((16, geometry[name].row_width), geometry[name].row_dtype)] * 4)
            assert refused.value.status == 409
            assert (await client.lookup(block_hashes(tokens(5, blocks=2), client.fingerprint, SALT, 16))).blocks == 0
            assert await client.prefetch(hits[other]).valid_tokens() == 0
    finally:
        for client in clients.values():
            await client.close()
        for proc in (bf16_proc, fp8_proc):
            proc.terminate()
            proc.wait(timeout=10)


async def test_an_fp8_engine_saves_and_a_fresh_one_hits_from_disk_close_to_the_bf16_hit(tmp_path, redis_url):
    """tiny in-process (its real model thread), mounted volumes and a Valkey index shared by both formats: an
    engine saves a prompt's blocks, a fresh engine of the same format (empty pool) loads them from disk. The fp8
    hit reads fewer bytes and answers as the bf16 hit does, its logprobs within a tolerance (not bit for bit)."""
    from tests.test_engine_batching import Running, engine_config, prompt

    loaded = save_model(init_model(preset("tiny")), preset("tiny"), tmp_path / "model")
    tokens = prompt(21, 64 * 4 + 10)
    answers = {}
    for name in ("bf16", "fp8"):
        cfg = engine_config(tmp_path, redis_url, latent_format=name)
        async with Running(loaded, cfg) as first:
            await first.generate(first.job(tokens, max_tokens=1))
            hit = await first.hit(tokens)
        async with Running(loaded, cfg) as fresh:
            events = [e async for e in fresh.engine.run(fresh.job(tokens, max_tokens=8, hit=hit, logprobs=5))]
            geometry, stats = fresh.cache.geometry, fresh.cache.store.stats
        done = events[-1]
        assert done["tiers"] == {"memory": 0, "disk": 4 * 64}
        assert stats.bytes_read == 4 * geometry.num_layers * geometry.block_bytes
        answers[name] = hit, [e for e in events if e["type"] == "token"]
    (bf16_hit, bf16), (fp8_hit, fp8) = answers["bf16"], answers["fp8"]
    assert not set(bf16_hit.hashes) & set(fp8_hit.hashes)  # one index, two caches
    assert [e["id"] for e in fp8] == [e["id"] for e in bf16]  # greedy
    drift = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(fp8, bf16))
    top = {t: lp for t, lp in bf16[0]["top_logprobs"]}
    drift = max(drift, *(abs(lp - top[t]) for t, lp in fp8[0]["top_logprobs"] if t in top))
    assert drift < 0.05, drift
