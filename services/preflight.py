"""Checks `deepinfer up` makes before it starts anything: one line per problem, naming the flag to change.

    problems = preflight(cfg)   # [] when the stack can start
    port 8000 is in use (another DeepInfer? see deepinfer status); choose one with --gateway-port

Each check is about something a user controls (a port, the data dir, a model, a Redis URL, a preset
name); a failure the user cannot cause is not a preflight problem but a logged error.
A port free now can still be taken before a service binds it: the launcher then sees that service
exit (and never takes the port's other listener for it, see services.common.instance).
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from model.config import PRESETS
from services.run_file import RunFile

if TYPE_CHECKING:
    from services.launcher import StackConfig

MIN_FREE_BYTES = 512 << 20  # weights of the mini preset (~300 MiB) plus logs and first segments


class StartRefused(Exception):
    """The stack cannot start as configured; str() is one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class PortClaim(NamedTuple):
    port: int
    flag: str   # the flag that chooses it, e.g. --gateway-port
    hint: str   # more to say after "choose one with FLAG", e.g. ", or use a running Redis with --redis-url"


def port_claims(cfg: "StackConfig") -> list[PortClaim]:
    claims = [PortClaim(cfg.gateway_port, "--gateway-port", ""), PortClaim(cfg.kvstore_port, "--kvstore-port", "")]
    engines = cfg.engines + cfg.prefill_engines + cfg.decode_engines
    span = f" (the {engines} engines take consecutive ports from it)" if engines > 1 else ""
    claims += [PortClaim(cfg.engine_port + i, "--engine-port", span) for i in range(engines)]
    if not cfg.redis_url:
        claims.append(PortClaim(cfg.redis_port, "--redis-port", ", or use a running Redis with --redis-url"))
    return claims


def port_problems(host: str, claims: list[PortClaim]) -> list[str]:
    problems, owner = [], {}
    for claim in claims:
        if not 0 < claim.port < 65536:
            problems.append(f"port {claim.port} is not a TCP port (1..65535); choose one with {claim.flag}")
        elif claim.port in owner and owner[claim.port] != claim.flag:
            problems.append(f"port {claim.port} is given to both {owner[claim.port]} and {claim.flag}; "
                            f"choose another with {claim.flag}")
        else:
            owner[claim.port] = claim.flag
            why = _bind_error(host, claim.port)
            if why == errno.EADDRINUSE:
                problems.append(f"port {claim.port} is in use (another DeepInfer? see deepinfer status); "
                                f"choose one with {claim.flag}{claim.hint}")
            elif why is not None:
                problems.append(f"cannot listen on {host}:{claim.port} ({os.strerror(why)}); "
                                f"choose another port with {claim.flag} or another address with --host")
    return problems


def _bind_error(host: str, port: int) -> int | None:
    """errno of binding host:port the way the services will (SO_REUSEADDR, as asyncio does), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            return error.errno or errno.EINVAL
    return None


def data_dir_problems(data_dir: Path) -> list[str]:
    """The data dir can be created and written, has room, and no running stack uses it."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / ".deepinfer-write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as error:
        return [f"data dir {data_dir} is not usable ({error.strerror or error}); "
                "choose another with --data-dir"]
    free = shutil.disk_usage(data_dir).free
    if free < MIN_FREE_BYTES:
        return [f"data dir {data_dir} has only {free >> 20} MiB free (needs {MIN_FREE_BYTES >> 20} MiB); "
                "free some space or choose another disk with --data-dir"]
    running = RunFile.read(data_dir)
    if running is not None and running.launcher_alive():
        return [f"a DeepInfer stack from data dir {data_dir} is running (launcher pid {running.launcher_pid}); "
                f"see deepinfer status --data-dir {data_dir}, or stop it with deepinfer stop --data-dir {data_dir}"]
    return []


def volume_problems(volumes: list[str]) -> list[str]:
    problems = []
    for volume in volumes:
        if "://" in volume or volume.startswith("{"):  # an object store or tensorstore spec: the kvstore checks it
            continue
        try:
            Path(volume).mkdir(parents=True, exist_ok=True)
            probe = Path(volume) / ".deepinfer-write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as error:
            problems.append(f"volume {volume} is not usable ({error.strerror or error}); fix or drop that --volume")
    return problems


def model_problems(cfg: "StackConfig") -> list[str]:
    if not cfg.model_dir:
        if cfg.preset not in PRESETS:
            return [f"unknown preset {cfg.preset!r}; choose one of {', '.join(sorted(PRESETS))} with --preset"]
        return []
    why = model_dir_problem(Path(cfg.model_dir), cfg.cache_dtype)
    return [why] if why else []


def model_dir_problem(path: Path, cache_dtype: str) -> str | None:
    """Why `path` is not a usable model directory (None if it is)."""
    from model.weights import read_identity

    if not path.is_dir():
        return (f"model dir {path} does not exist; create one with deepinfer model init or deepinfer model convert, "
                "or fix --model-dir")
    try:
        read_identity(path, cache_dtype)
    except FileNotFoundError as error:
        return f"model dir {path} is not a DeepInfer model ({Path(error.filename or '?').name} is missing); fix --model-dir"
    except (ValueError, KeyError, TypeError) as error:
        return f"model dir {path} is corrupt ({type(error).__name__}: {error}); fix --model-dir or convert the model again"
    return None


def redis_problems(url: str, cluster: bool, password: str | None = None) -> list[str]:
    """A given Redis URL parses and answers PING within 2 s, as the services' user (URL) with its password."""
    if not url:
        return []
    import redis

    try:
        client = redis.Redis.from_url(url, password=password or None, socket_connect_timeout=2.0, socket_timeout=2.0)
    except ValueError as error:
        return [f"--redis-url {url!r} is not a Redis URL ({error}); it looks like redis://HOST:PORT/DB"]
    try:
        client.ping()
    except (redis.AuthenticationError, redis.ResponseError) as error:
        if not isinstance(error, redis.AuthenticationError) and "NOAUTH" not in str(error):
            raise
        said = "refused the password it was given" if password else "needs a password"
        return [f"the Redis at --redis-url {url} {said} ({error}); "
                "give its user's password as DEEPINFER_UP_REDIS_PASSWORD or DEEPINFER_UP_REDIS_PASSWORD_FILE"]
    except redis.RedisError as error:
        kind = "Redis Cluster node" if cluster else "Redis"
        return [f"cannot reach the {kind} at --redis-url {url} ({error}); fix --redis-url, "
                "or leave it out to use the embedded Valkey"]
    finally:
        client.close()
    return []


def _redis_password(cfg: "StackConfig", data_dir: Path) -> str | None:
    """The password the services will use: given, or the deployment's stored one (None before the first start)."""
    stored = data_dir / "secrets" / "redis_password"
    if cfg.redis_password:
        return cfg.redis_password
    try:
        return stored.read_text().strip() or None
    except OSError:
        return None


def preflight(cfg: "StackConfig", data_dir: Path, volumes: list[str]) -> list[str]:
    """Every problem found, in the order a user would fix them; [] when the stack can start."""
    problems = data_dir_problems(data_dir)
    if problems:  # said once for the dir, not again for each volume inside it
        volumes = [v for v in volumes if not Path(v).absolute().is_relative_to(data_dir)]
    problems += model_problems(cfg)
    problems += port_problems(cfg.host, port_claims(cfg))
    problems += volume_problems(volumes)
    problems += redis_problems(cfg.redis_url, cfg.redis_cluster, _redis_password(cfg, data_dir))
    return problems
