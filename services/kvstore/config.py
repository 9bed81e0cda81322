"""KvstoreConfig: every setting of the kvstore service, with its one default."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore import CacheGeometry
from kvstore.latent_format import cache_fingerprint, check_latent_format, fp8_dims
from services.common.logs import check_log_format
from kvstore.quota import parse_quotas
from kvstore.store import IO_THREADS, READ_AHEAD_LAYERS
from services.common.config import check_redis_url, secret_field


@dataclass(slots=True)
class KvstoreConfig:
    """The kvstore service: latent block segments on volumes, indexed in Redis."""

    fingerprint: str = field(metadata={"help": "model fingerprint this kvstore stores caches of"})
    num_layers: int = field(metadata={"help": "cache geometry: model layers"})
    latent_dim: int = field(default=576, metadata={"help": "cache geometry: latent dims per token"})
    block_tokens: int = field(default=64, metadata={"help": "cache geometry: tokens per block"})
    dtype: str = field(default="bfloat16", metadata={"help": "cache geometry: cache dtype"})
    latent_format: str = field(default="bf16", metadata={"help": "latents on disk: bf16 or fp8 (the engines')"})
    rope_dim: int = field(default=64, metadata={"help": "cache geometry: RoPE dims of a latent (kept bf16 in fp8)"})
    volumes: list[str] = field(default_factory=list, metadata={
        "flag": "volume", "help": "a volume: directory or tensorstore kvstore URL (repeatable)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8100, metadata={"help": "port to bind"})
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "prefix index Redis URL"})
    redis_cluster: bool = field(default=False, metadata={"help": "the Redis URL is a Redis Cluster node"})
    index_prefix: str = field(default="dikv", metadata={"help": "Redis key prefix"})
    kv_events: bool = field(default=True, metadata={
        "help": "publish the blocks that enter and leave the index (saves, evictions, expiry sweeps, purges) as KV "
                "events of medium disk on the engines' Redis stream"})
    kv_events_max_len: int = field(default=100_000, metadata={
        "help": "entries the KV event stream keeps (MAXLEN ~; the engines' --kv-events-max-len)"})
    admin_token: str = secret_field("bearer token for /admin/* (empty: admin off)")
    service_token: str = secret_field("bearer token every data endpoint needs (empty: all closed)")
    mac_key: str = secret_field("key of the segments' block MACs (empty: saves refused, reads are misses)")
    redis_password: str = secret_field("password of the prefix index's Redis user")
    budget_gib: float = field(default=0.0, metadata={
        "help": "byte budget per volume in GiB (0: 80% of each volume's file system, recorded in the volume)"})
    tenant_quota_gib: float = field(default=0.0, metadata={"help": "bytes on disk per tenant, GiB (0: no quota)"})
    tenant_quotas: str = field(default="", metadata={
        "help": "per-tenant GiB over --tenant-quota-gib: TENANT=GIB,TENANT=GIB"})
    max_body_mib: int = field(default=512, metadata={"help": "largest request body accepted (MiB)"})
    max_segment_blocks: int = field(default=64, metadata={"help": "blocks per segment at most"})
    read_ahead: int = field(default=READ_AHEAD_LAYERS, metadata={"help": "layers in flight per prefetch"})
    io_threads: int = field(default=IO_THREADS, metadata={"help": "threads for volume reads and checksums"})
    read_mode: str = field(default="mmap", metadata={"help": "file volume reads: mmap, pread or tensorstore"})
    sweep_interval_s: float = field(default=60.0, metadata={"help": "seconds between expiry sweeps (0: off)"})
    reader_grace_s: float = field(default=30.0, metadata={"help": "seconds a retired segment stays readable"})
    reconcile_interval_s: float = field(default=3600.0, metadata={
        "help": "seconds between reconciliations of index and volumes after the one at start (0: only at start)"})
    reconcile_min_age_s: float = field(default=60.0, metadata={
        "help": "an unpublished segment younger than this is left to its writer, not republished"})
    log_format: str = field(default="text", metadata={"help": "log lines: text or json"})

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        if not self.volumes:
            raise ValueError("at least one --volume (DEEPINFER_KVSTORE_VOLUMES) is required")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.kv_events_max_len < 1:
            raise ValueError(f"--kv-events-max-len must be >= 1, got {self.kv_events_max_len}")
        if self.budget_gib < 0 or self.max_body_mib < 1:
            raise ValueError("--budget-gib must be >= 0 and --max-body-mib >= 1")
        if self.tenant_quota_gib < 0:
            raise ValueError(f"--tenant-quota-gib must be >= 0, got {self.tenant_quota_gib}")
        parse_quotas(self.tenant_quotas)  # names a malformed entry at startup
        if self.reconcile_interval_s < 0 or self.reconcile_min_age_s < 0:
            raise ValueError("--reconcile-interval-s and --reconcile-min-age-s must be >= 0")
        check_log_format(self.log_format)
        check_latent_format(self.latent_format, "--latent-format")

    @property
    def geometry(self) -> CacheGeometry:
        return CacheGeometry(self.num_layers, self.latent_dim, self.block_tokens, self.dtype,
                             fp8_dims(self.latent_format, self.latent_dim, self.rope_dim))

    @property
    def cache_fingerprint(self) -> str:
        """What the stored blocks are keyed by: the model fingerprint, bound to the latent format."""
        return cache_fingerprint(self.fingerprint, self.latent_format)

    @property
    def budget_bytes(self) -> int | None:
        return int(self.budget_gib * (1 << 30)) or None
