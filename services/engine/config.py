"""The engine's configuration: one dataclass, filled from CLI flags and DEEPINFER_ENGINE_* variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvstore.latent_format import check_latent_format
from model.attention import BACKENDS
from model.config import check_serving_dtype
from services.common.config import check_redis_url, load_config, secret_field
from services.common.logs import check_log_format

POOL_MEMORY_SHARE = 0.05  # of physical memory, per engine replica, when no pool size is given
POOL_GIB_CAP = 1.0
ROLES = ("both", "prefill", "decode")


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class EngineConfig:
    """DeepInfer engine: serves one MLA model, loads cached prefixes layer by layer, saves new blocks."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8200, metadata={"help": "port to bind"})
    role: str = field(default="both", metadata={
        "help": "prefill (prefills a prompt, saves its blocks, returns the first token), decode (takes a prefilled "
                "prompt's blocks from the cache and decodes) or both; a gateway splits requests when both pools exist"})
    model_dir: str = field(default="", metadata={"help": "a saved or converted model directory (overrides preset)"})
    preset: str = field(default="mini", metadata={"help": "model preset when no model_dir: tiny, mini, ..."})
    models_dir: str = field(default="data/models", metadata={"help": "where preset weights are created on first run"})
    cache_dtype: str = field(default="bfloat16", metadata={"help": "latent cache dtype: bfloat16 or float32"})
    latent_format: str = field(default="bf16", metadata={
        "help": "latents on disk: bf16 (as in the pool) or fp8 (c_kv in FP8 with scales: 656 B a token a layer on "
                "DeepSeek, 1,152 in bf16; a cache of its own)"})
    volumes: list[str] = field(default_factory=list, metadata={
        "flag": "volume", "help": "a cache volume (directory or tensorstore kvstore spec); repeat per SSD"})
    redis_url: str = field(default="", metadata={
        "help": "Redis of the prefix index: the disk cache's with --volume; where KV events go (with or without "
                "--volume, and beside --kvstore-url); empty: no disk cache without --kvstore-url, no KV events"})
    kvstore_url: str = field(default="", metadata={
        "help": "read and save through the kvstore service instead of mounting the volumes"})
    kv_events: bool = field(default=True, metadata={
        "help": "publish the blocks this engine holds (memory tier; disk with --volume) as KV events on the Redis "
                "stream gateways route by (needs --redis-url)"})
    kv_events_max_len: int = field(default=100_000, metadata={
        "help": "entries the KV event stream keeps (MAXLEN ~; every publisher should use the same)"})
    kv_events_lease_s: float = field(default=10.0, metadata={
        "help": "seconds gateways keep this engine's blocks without a renewal of its lease (renewed every third)"})
    redis_cluster: bool = field(default=False, metadata={"help": "the Redis URL is a Redis Cluster"})
    index_prefix: str = field(default="dikv", metadata={"help": "key prefix of the prefix index"})
    budget_bytes: int = field(default=0, metadata={
        "help": "per-volume byte budget (0: each volume's recorded default, 80% of its file system)"})
    block_tokens: int = field(default=64, metadata={"help": "tokens per cached block"})
    read_ahead: int = field(default=4, metadata={"help": "layers read ahead of compute on a hit (kv_bench: 4)"})
    save: bool = field(default=True, metadata={"help": "save new blocks after each request"})
    chunk_tokens: int = field(default=512, metadata={"help": "prefill chunk size, tokens"})
    max_batch: int = field(default=64, metadata={
        "help": "sequences running at once (decoding, prefilling or loading a hit); more wait in the queue"})
    max_queue: int = field(default=256, metadata={"help": "requests waiting beyond that; more get 503"})
    step_tokens: int = field(default=256, metadata={
        "help": "tokens per model step while sequences decode (their decode tokens + prefill chunks) before "
                "step costs are measured, and the fixed prefill cut in --batch-invariant mode"})
    prefill_step_ratio: float = field(default=2.0, metadata={
        "help": "while sequences decode, each step's prefill segments take about this many times the decode step's "
                "time (predicted from measured steps; at least one block, at most --solo-tokens)"})
    solo_tokens: int = field(default=2048, metadata={
        "help": "prefill tokens per step while nothing decodes (a newcomer waits at most one such step)"})
    pool_tokens: int = field(default=0, metadata={"help": "latent pool size in tokens (0: from --pool-gib)"})
    pool_gib: float = field(default=0.0, metadata={
        "help": f"latent pool size in GiB (0: {POOL_MEMORY_SHARE:.0%} of this machine's memory, at most "
                f"{POOL_GIB_CAP:g} GiB, so several engines and stacks share a machine)"})
    memory_tier: bool = field(default=True, metadata={
        "help": "keep finished sequences' blocks in the pool by block hash to serve repeated prefixes (memory tier)"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "a sequence's logits are bit-identical whatever shares its steps (fixed batch shape, fixed "
                "prefill cuts; costs throughput, see BENCHMARKS.md)"})
    dtype: str = field(default="bfloat16", metadata={
        "help": "serving dtype of the projections' and decode attention's inputs (sums in float32): bfloat16 (several "
                "times faster on CPUs with matrix units, see BENCHMARKS.md) or float32 (the checkpoint's numerics)"})
    attention: str = field(default="auto", metadata={
        "help": "attention backend (model/attention/): auto (cpu where our CPU kernels serve this machine, else "
                "xla), xla (plain JAX, every platform), cpu, or pallas (the GPU decode kernel)"})
    save_every_tokens: int = field(default=2048, metadata={
        "help": "save a long prefill's full blocks every this many tokens (a cancelled or preempted one keeps them)"})
    prefetch_deadline_factor: float = field(default=1.0, metadata={
        "help": "recompute instead of waiting for disk once a load takes this many times its recompute time"})
    heartbeat_s: float = field(default=5.0, metadata={
        "help": "seconds between progress events while a request waits for a slot or prefills (a caller's "
                "silence timeout then only fires on a stuck engine, never on a long prompt)"})
    admin_token: str = secret_field("bearer token for /admin/*; empty disables admin")
    service_token: str = secret_field("bearer token /internal/* needs and the kvstore service gets (empty: closed)")
    mac_key: str = secret_field("key of the segments' block MACs (mounted volumes; empty: no cache)")
    redis_password: str = secret_field("password of the prefix index's Redis user")
    warmup: bool = field(default=True, metadata={"help": "compile common shapes before reporting ready"})
    log_format: str = field(default="text", metadata={"help": "log lines: text or json"})

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("block_tokens", "chunk_tokens", "max_batch", "read_ahead", "step_tokens", "solo_tokens",
                     "save_every_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.prefill_step_ratio > 0:
            raise ValueError(f"prefill_step_ratio must be > 0, got {self.prefill_step_ratio}")
        if self.kv_events_max_len < 1:
            raise ValueError(f"kv_events_max_len must be >= 1, got {self.kv_events_max_len}")
        if not self.kv_events_lease_s > 0:
            raise ValueError(f"kv_events_lease_s must be > 0, got {self.kv_events_lease_s}")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.kvstore_url and self.volumes:
            raise ValueError("give either --kvstore-url (remote cache) or --volume (mounted), not both")
        check_log_format(self.log_format)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.cache_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"cache_dtype must be bfloat16 or float32, got {self.cache_dtype!r}")
        check_serving_dtype(self.dtype)
        check_latent_format(self.latent_format)
        if self.attention not in ("auto", *BACKENDS):
            raise ValueError(f"attention must be auto, {' or '.join(BACKENDS)}, got {self.attention!r}")
        if self.pool_tokens < 0 or self.pool_gib < 0:
            raise ValueError("pool_tokens and pool_gib must be >= 0")

    def pool_pages(self, bytes_per_token: int) -> int:
        """Pages of the latent pool (one of them the scratch page)."""
        if self.pool_tokens:
            tokens = self.pool_tokens
        else:
            gib = self.pool_gib or min(POOL_GIB_CAP, POOL_MEMORY_SHARE * _memory_bytes() / 2**30)
            tokens = int(gib * 2**30) // bytes_per_token
        return max(2, -(-tokens // self.block_tokens) + 1)

    @property
    def caching(self) -> bool:
        return bool(self.kvstore_url or (self.redis_url and self.volumes))


def load(argv: list[str] | None = None, env: dict[str, str] | None = None) -> EngineConfig:
    return load_config(EngineConfig, "engine", argv, env)
