"""The gateway's configuration: one dataclass, filled from CLI flags and DEEPINFER_GATEWAY_* env.

Precedence: CLI flag > environment variable > the default written here. Field `engines` is set
by `--engines URL,URL` or `DEEPINFER_GATEWAY_ENGINES=URL,URL`; every field follows that pattern.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping, Sequence

from services.gateway.tokenizer import DEFAULT_TOKENIZER_JSON

ENV_PREFIX = "DEEPINFER_GATEWAY_"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engines: tuple[str, ...] = ()        # engine base URLs, e.g. http://127.0.0.1:8200
    api_keys: str = ""                   # "key1:tenantA,key2:tenantB"
    open_access: bool = False            # local mode: no API key needed (tenant "public")
    admin_token: str = ""                # for our /admin/* and the engines' /admin/*; "" disables
    redis_url: str = "redis://127.0.0.1:6379/0"  # the prefix index; "" = every request a miss
    redis_cluster: bool = False
    index_prefix: str = "dikv"           # key prefix of the prefix index in Redis
    served_model: str = "deepseek-chat"  # the `model` clients send and /v1/models lists
    tokenizer_json: Path = DEFAULT_TOKENIZER_JSON
    token_cache_bytes: int = 256 << 20   # bytes of cached message token ids
    default_max_tokens: int = 4096       # when a request sets none (capped by the context left)
    max_body_bytes: int = 64 << 20       # a 128K-token conversation is ~0.5 MB of JSON
    lookup_timeout_s: float = 0.5        # a slower prefix index answer counts as a miss
    engine_poll_s: float = 2.0           # how often engines' /readyz and /admin/stats are read
    engine_connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 600.0  # also the longest gap between two streamed tokens
    drain_timeout_s: float = 30.0        # on shutdown, how long in-flight requests may finish

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("token_cache_bytes", "default_max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lookup_timeout_s", "engine_poll_s", "engine_connect_timeout_s",
                     "first_token_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for url in self.engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
        api_keys(self.api_keys)  # fails early on a malformed list

    @classmethod
    def load(cls, argv: Sequence[str] | None = None,
             environ: Mapping[str, str] | None = None) -> "GatewayConfig":
        environ = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(prog="python -m services.gateway",
                                         description="DeepInfer gateway")
        for field in fields(cls):
            parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                                default=None, help=f"env {ENV_PREFIX}{field.name.upper()}")
        flags = vars(parser.parse_args(argv))
        values = {}
        for field in fields(cls):
            raw = flags[field.name]
            if raw is None:
                raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _convert(field, raw)
        return cls(**values)


def _convert(field: dataclasses.Field, raw: str):
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if kind == "bool":
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise ValueError(f"{field.name}: expected a boolean, got {raw!r}")
        return raw.lower() in ("1", "true", "yes", "on")
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "Path":
        return Path(raw)
    if kind.startswith("tuple"):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    return raw


def api_keys(spec: str) -> dict[str, str]:
    """"key1:tenantA,key2:tenantB" -> {"key1": "tenantA", "key2": "tenantB"}."""
    keys: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, tenant = entry.rpartition(":")
        if not sep or not key or not tenant:
            raise ValueError("api_keys entries must look like KEY:TENANT")
        keys[key] = tenant
    return keys
