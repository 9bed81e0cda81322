"""The server secrets of one deployment, shared by all its services and hosts.

    service_token   bearer credential of the internal plane (kvstore data, engine /internal/*)
    salt_key        tenant salts are HMAC(salt_key, tenant) (gateway)
    mac_key         every stored block carries a MAC under it (kvstore, engines)
    admin_token     bearer token of /admin/* (and /metrics) on every service
    redis_password  the services' Valkey/Redis user

`deepinfer up` takes each from DEEPINFER_UP_<NAME> or DEEPINFER_UP_<NAME>_FILE when given (several
hosts sharing one cache must share these), else from DATA_DIR/secrets/<name>, created there with
32 random bytes (hex) and mode 0600 on first start.
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Mapping, NamedTuple

from services.valkey_process import write_private


class DeploymentSecrets(NamedTuple):
    service_token: str
    salt_key: str
    mac_key: str
    admin_token: str
    redis_password: str

    def __repr__(self) -> str:  # never in a log line or a traceback
        return "DeploymentSecrets(...)"


def load_or_create(directory: Path, given: Mapping[str, str]) -> DeploymentSecrets:
    """Each secret from `given` (name -> value; empty = not given), else its file in `directory`
    (which must not be readable by others), else a new random one written there (0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    values = {}
    for name in DeploymentSecrets._fields:
        if given.get(name):
            values[name] = given[name]
            continue
        path = directory / name
        if path.exists():
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                raise PermissionError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
            values[name] = path.read_text(encoding="utf-8").strip()
        if not values.get(name):
            values[name] = secrets.token_hex(32)
            write_private(path, values[name] + "\n")
    return DeploymentSecrets(**values)


# The secret fields each service reads (DEEPINFER_<SERVICE>_<FIELD>), from the deployment's secrets.
SERVICE_SECRETS = {
    "kvstore": ("service_token", "mac_key", "admin_token", "redis_password"),
    "engine": ("service_token", "mac_key", "admin_token", "redis_password"),
    "gateway": ("service_token", "salt_key", "admin_token", "redis_password"),
}


def service_environment(service: str, deployment: DeploymentSecrets, base: Mapping[str, str],
                        extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one service's process: `base`, its secrets as DEEPINFER_<SERVICE>_* (any
    inherited variables or *_FILE pointers for them removed), and `extra` secret fields."""
    fields = dict(zip(SERVICE_SECRETS[service], (getattr(deployment, n) for n in SERVICE_SECRETS[service])))
    fields |= dict(extra or {})
    env = dict(base)
    for name, value in fields.items():
        var = f"DEEPINFER_{service.upper()}_{name.upper()}"
        env.pop(var + "_FILE", None)
        env[var] = value
    return env
