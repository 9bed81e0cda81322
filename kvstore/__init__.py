"""kvstore: the MLA latent KV cache of prompt prefixes on tensorstore volumes, indexed in Redis.

The only model knowledge here is the cache geometry. Public API (the engine and gateway use it):

    CacheGeometry(num_layers, latent_dim=576, block_tokens=64, dtype="bfloat16", fp8_dims=0)
        .block_bytes = block_tokens * row_bytes   (bytes of one block of one layer)
        stored rows: (tokens, latent_dim) in dtype, or with fp8_dims > 0 (the fp8 latent format,
        latent_format.py: quantize/dequantize in jnp, cache_fingerprint) (tokens, row_bytes) uint8

    block_hashes(tokens, fingerprint, tenant_salt, block_tokens=64) -> list[bytes]   # 16 B each
        chained over full blocks: h_i = blake2b(h_{i-1} | context(fingerprint, salt) | int32 tokens)

    open_redis(url, cluster=False, timeout_s=5.0) -> redis.asyncio client (Redis or RedisCluster)
    PrefixIndex(client, prefix="dikv")
        await lookup(hashes) -> Hit              # longest leading run, one script call; hits re-arm TTLs
        await publish(root, hashes, locations, tenant, ttl_s)   # only for durable data
        await drop(root, block_hash, segment)    # a bad entry
        await unpublish_segment(root, segment) -> int; await ping() -> bool
    Hit(root, hashes, runs: tuple[SegmentRun, ...]); .blocks; .locations; .truncated(n)

    RetentionPolicy(classes={"chat": 7 d, "agent": 3 d}, min_ttl_s=60, max_ttl_s=30 d)

    store = await BlockStore.open(volumes, geometry, fingerprint, index, mac_key=KEY, budget_bytes=None,
                                  max_segment_blocks=64, read_ahead=4, threads=8, read_mode="mmap", ...)
        volumes: directory paths or tensorstore kvstore specs (dict or URL)
        await store.save(hashes, layers, start_block=0, tenant="", retention="chat", ttl_s=None)
            -> SaveResult(blocks, segments, bytes)      # durable AND published when it returns
            hashes: the chain from block 0; layers[l]: (new_blocks * block_tokens, row_width) stored rows
            raises ValueError (bad argument, names it; also NaN/Inf latents) or SegmentWriteError
            (nothing unpublished left)
        p = store.prefetch(hit, read_ahead=None, out=None) -> Prefetch   # reading starts now
            out: optional reused (num_layers, >= tokens, row_width) staging buffer to read into
            await p.layer(l) -> np.ndarray (tokens, row_width) stored rows, verified; in layer
                                order, a later layer is never longer than an earlier one
            await p.valid_tokens() -> int            # usable prefix for every layer
            p.cancel(); await p.aclose()             # aclose: also waits out reads into `out`
        await store.read_layer(hit, l) -> LayerRead(latents, valid_blocks)   # one layer, verified
        await store.capacity.sweep() -> SweepResult; await store.capacity.evict(tenant=None) -> int
        store.capacity.start(interval_s)              # background sweeps (the kvstore service runs them)
        store.stats: StoreStats; await store.close()

    reconciler = Reconciler(store, min_age_s=60.0)    # the volumes are the source of truth
        await reconciler.run() -> ReconcileReport     # one pass, per volume under a VolumeLease in Redis
        reconciler.start(interval_s)                  # at once, then every interval (the kvstore service)

    KV events (kv_events.py: format, keys, lease and resync; kv_view.py: the reader):
    publisher = EventPublisher(client, prefix, source, block_tokens, max_len, lease_s=None)
        publisher.stored(hashes, parent, medium); publisher.removed(hashes, medium)   # any thread (BlockEvents)
        publisher.start(); await publisher.close()    # appends from the event loop every FLUSH_S
    PrefixIndex(client, prefix, events=publisher)     # publishes and removals as medium "disk" events
    view = KvView(client, prefix); view.start()       # reads the stream, then follows it
        view.held(engine_id) -> int; view.leading_run(engine_id, hashes) -> int; await view.stop()

Cache faults (missing, torn, corrupt, non-finite, forged (block MAC under mac_key), old-format or
foreign data) never raise from reads: they shorten the prefix, drop the bad index entry and count
`stats.verification_failures` (and forged_segments, old_format_segments, nonfinite_blocks).
Retention is per segment: a hit keeps the whole segment alive; eviction retires least recently
prefetched segments first (index entries first, bytes after `reader_grace_s`).
Every segment header carries what publishing it needs (chain root, retention class, TTL, expiry),
so a lost index is rebuilt from the volumes (reconcile.py); only recency is lost.

Storage layout: a save becomes segments of <= max_segment_blocks blocks, each one object on the
least used volume, stored layer-major (segment.py), so one layer of a prefix is one contiguous
range read per segment. Index layout and retention: index.py; volume accounting: ledger.py.
The remote twin of BlockStore (same save/prefetch shape) is services.kvstore.client.KvstoreClient.
"""
from .capacity import SweepResult
from .geometry import CacheGeometry
from .hashing import block_hashes, cacheable_blocks, extend_block_hashes
from .index import PrefixIndex, open_redis
from .kv_events import BlockEvents, EventPublisher
from .kv_view import KvView
from .location import BlockLocation, Hit, SegmentRun, miss
from .prefetch import LayerRead, LayerSource, Prefetch
from .reader import SegmentReader
from .reconcile import ReconcileReport, Reconciler
from .retention import RetentionPolicy
from .stats import StoreStats
from .store import BlockStore, SaveResult, SegmentWriteError

__all__ = [
    "BlockEvents", "BlockLocation", "BlockStore", "CacheGeometry", "EventPublisher", "KvView", "Hit", "LayerRead", "LayerSource", "Prefetch", "PrefixIndex",
    "ReconcileReport", "Reconciler", "RetentionPolicy", "SaveResult", "SegmentReader", "SegmentRun",
    "SegmentWriteError", "StoreStats", "SweepResult", "block_hashes", "cacheable_blocks", "extend_block_hashes", "miss", "open_redis",
]
