"""The real stack for fault tests: the launcher's processes, a TCP link between the engines and the
kvstore service that a test can slow down, and an audit of the prefix index against the volumes.

Nothing here hooks into the services: faults are real signals to real processes, a real slow
socket, real bytes changed on disk, real mounts.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from openai import OpenAI

from kvstore import BlockStore, CacheGeometry, Hit, PrefixIndex, SegmentRun, block_hashes, open_redis
from model.weights import read_identity
from services.gateway.chat_template import ChatMessage, render_chat
from services.gateway.tenants import PUBLIC_TENANT, tenant_salt
from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import shared_tokenizer
from services.launcher import Stack, _ready
from tests.conftest import free_port
from tests.stack_probes import ADMIN_TOKEN

B = 64
WORDS = ("latent", "segment", "volume", "prefix", "suffix", "block", "tenant", "layer", "engine", "index")


def prompt(tag: str, words: int = 300) -> str:
    """A user message of about 2 tokens per word whose first block is unique to `tag`."""
    return f"Fault test {tag}: " + " ".join(f"{WORDS[i % 10]}{i % 89}" for i in range(words))


class SlowLink:
    """A TCP proxy on its own thread between the engines and the kvstore service.

    Bytes flow both ways unchanged; while slow, every chunk coming back from the kvstore is held
    `delay_s` first (a congested or throttled storage link). fast() releases held chunks at once.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.delay_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slow-link", daemon=True)

    def start(self) -> "SlowLink":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    async def _listen(self):
        self._fast = asyncio.Event()
        self._fast.set()
        return await asyncio.start_server(self._connection, "127.0.0.1", self.port)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the kvstore is down: the engine sees its connection closed
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, upstream_w, False), self._pipe(upstream_r, client_w, True))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: bool) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                if held and not self._fast.is_set():
                    try:
                        await asyncio.wait_for(self._fast.wait(), self.delay_s)
                    except TimeoutError:
                        pass
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def slow(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._loop.call_soon_threadsafe(self._fast.clear)

    def fast(self) -> None:
        self._loop.call_soon_threadsafe(self._fast.set)

    def stop(self) -> None:
        self.fast()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


SILENCE_S = 10.0  # the fault stack's gateway --first-token-timeout-s


class FaultStack(Stack):
    """The launcher's Stack, remembering each process's command line so that a test restarts
    exactly what it killed, with the engines' kvstore URL pointing through a SlowLink."""

    def __init__(self, cfg, link: SlowLink):
        super().__init__(cfg, quiet=True)
        self.link = link
        self.commands: dict[str, tuple[str, list[str]]] = {}
        self.secret_fields: dict[str, dict[str, str] | None] = {}

    def _spawn(self, name: str, module: str, args: list[str], secret_fields: dict[str, str] | None = None) -> None:
        args = list(args)
        if "--kvstore-url" in args:
            args[args.index("--kvstore-url") + 1] = self.link.url
        # A short silence timeout (engines beat twenty times within it), so a stopped engine is
        # failed over in seconds.
        if module == "services.engine" and "--heartbeat-s" not in args:
            args += ["--heartbeat-s", "0.5"]
        # These faults are the disk tier's: with the memory tier on, a repeat served from an engine's
        # pool would never touch the broken part.
        if module == "services.engine" and "--no-memory-tier" not in args:
            args.append("--no-memory-tier")
        # Two sequences per engine at most, so that a third request deterministically waits in the queue.
        if module == "services.engine" and "--max-batch" not in args:
            args += ["--max-batch", "2"]
        if module == "services.gateway" and "--first-token-timeout-s" not in args:
            args += ["--first-token-timeout-s", str(SILENCE_S)]
        self.commands[name] = (module, args)
        self.secret_fields.setdefault(name, secret_fields)
        super()._spawn(name, module, args, self.secret_fields[name])

    def url(self, name: str) -> str:
        return self._urls()[name]

    def kill(self, name: str, sig: int = signal.SIGKILL, wait_s: float = 40.0) -> int:
        proc = self.procs[name]
        proc.send_signal(sig)
        return proc.wait(wait_s)

    def restart(self, name: str, args: list[str] | None = None, timeout_s: float = 180.0) -> None:
        """Start `name` again (with its original arguments unless given) and wait until it is ready."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(40)
        module, original = self.commands[name]
        self._spawn(name, module, original if args is None else args)
        if args is not None:
            self.commands[name] = (module, original)  # the next plain restart is the original again
        deadline = time.monotonic() + timeout_s
        while not _ready(self.url(name)):
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}:\n{self.tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {timeout_s} s:\n{self.tail(name)}")
            time.sleep(0.2)
        if name.startswith("engine"):
            self.wait_routable(name)

    def wait_routable(self, name: str, timeout_s: float = 30.0) -> None:
        """The gateway probes engines every 2 s; wait until it routes to `name` again."""
        url = self.url(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            body = admin_json(self, self.gateway_url + "/admin/stats")
            if any(e["url"] == url and e["routable"] for e in body["engines"]):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the gateway does not route to {name} again")

    @property
    def volume_args(self) -> list[str]:
        args = self.commands["kvstore"][1]
        return [args[i + 1] for i, a in enumerate(args) if a == "--volume"]


def admin_json(stack: Stack, url: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {stack.admin_token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)





def admin_post(stack: Stack, url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {stack.admin_token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _samples(url: str) -> list[tuple[str, float]]:
    """(name plus labels, value) of every Prometheus sample at url/metrics, read with the admin token
    (the fault stack's is ADMIN_TOKEN) as an operator's scraper does; none if the service is down."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return []
    return [(line.split(" ")[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
            if line and not line.startswith("#")]


def metric(url: str, series: str) -> float:
    """Sum of the Prometheus samples named exactly `series` (name plus labels) at url/metrics; 0 if
    none (or the service is down)."""
    return sum(value for key, value in _samples(url) if key == series)


def metric_total(url: str, name: str) -> float:
    """Sum of every sample of metric `name` at url/metrics, whatever its labels; 0 if none."""
    return sum(value for key, value in _samples(url) if key.split("{")[0] == name)


def engines_metric(stack: Stack, series: str) -> float:
    return sum(metric(url, series) for url in stack.engine_urls)


def client(stack: Stack, timeout_s: float = 120.0) -> OpenAI:
    return OpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def chat(stack: Stack, content: str, max_tokens: int = 8, timeout_s: float = 120.0):
    """(answer text, usage) of one greedy chat completion through the gateway."""
    reply = _greedy(stack, content, max_tokens, timeout_s)
    return reply.choices[0].message.content, reply.usage


def _greedy(stack: Stack, content: str, max_tokens: int, timeout_s: float, **extra):
    return client(stack, timeout_s).chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, **extra)


NEAR_TIE = 0.05  # logprob nats: how close two candidates may be for float rounding to order them either way


def chat_logprobs(stack: Stack, content: str, max_tokens: int = 8, timeout_s: float = 120.0):
    """(answer's logprob entries, usage) of one greedy chat completion through the gateway: each entry has the
    token, its logprob and the top 2 candidates (`same_answer` compares two answers by them)."""
    reply = _greedy(stack, content, max_tokens, timeout_s, logprobs=True, top_logprobs=2)
    return reply.choices[0].logprobs.content, reply.usage


def same_answer(first, second) -> str:
    """'' when two greedy answers (logprob entries) are the same answer up to float rounding, else why not.

    A hit and a miss, or one prompt computed among other requests and alone, sum in different orders (default
    mode is not batch-invariant): their logprobs agree within NEAR_TIE, and their tokens agree up to the first
    position where the first answer's top two candidates were within NEAR_TIE of each other (a near-tie that
    rounding may order either way; past it the answers may part). A wrong latent (a torn or misplaced block)
    moves logprobs far more than that."""
    for i, (a, b) in enumerate(zip(first, second)):
        if a.token == b.token:
            if abs(a.logprob - b.logprob) > NEAR_TIE:
                return f"token {i} {a.token!r}: logprob {a.logprob:.4f} against {b.logprob:.4f}"
            continue
        close = {t.token: t.logprob for t in a.top_logprobs}
        if b.token in close and a.logprob - close[b.token] <= NEAR_TIE:
            return ""  # a near-tie: the answers may part from here
        candidates = [(t.token, t.logprob) for t in a.top_logprobs]
        return f"token {i}: {a.token!r} against {b.token!r}, not a near-tie ({candidates})"
    return "" if len(first) == len(second) else f"{len(first)} tokens against {len(second)}"


def pinned(stack: Stack, engine: int) -> dict:
    """Headers that make the gateway run a request on engine `engine` (admin only)."""
    return {"X-DeepInfer-Engine": str(engine), "X-DeepInfer-Admin-Token": stack.admin_token}


def streamed(stack: Stack, content: str, max_tokens: int = 8, timeout_s: float = 120.0, engine: int | None = None):
    """(seconds to the first answer token, answer text, usage) of one greedy streamed completion."""
    begin = time.perf_counter()
    stream = client(stack, timeout_s).chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers=pinned(stack, engine) if engine is not None else None)
    ttft, parts, usage = None, [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - begin
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return ttft, "".join(parts), usage


def wait_for_saves(stack: Stack, timeout_s: float = 60.0) -> None:
    """Saves run after the response; wait until no live engine has one pending."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = 0
        for name, url in stack._urls().items():
            if name.startswith("engine") and stack.procs[name].poll() is None:
                pending += admin_json(stack, url + "/admin/stats")["pending_saves"]
        if not pending:
            return
        time.sleep(0.05)
    raise TimeoutError("engines still have saves pending")


def segment_files(volumes: list[str]) -> dict[Path, float]:
    """Every segment object on the volumes -> its mtime."""
    found = {}
    for volume in volumes:
        for path in (Path(volume) / "segments").glob("*"):
            if len(path.name) == 32:
                found[path] = path.stat().st_mtime
    return found


def _store_identity(stack: Stack) -> tuple[CacheGeometry, str]:
    model_cfg, fingerprint = read_identity(stack.data / "models" / stack.cfg.preset)
    return CacheGeometry(model_cfg.num_layers, model_cfg.latent_dim, B, model_cfg.cache_dtype), fingerprint


async def read_saved_prefixes(stack: Stack, volumes: list[str], contents: list[str]) -> list[int]:
    """For each user message (open-access tenant), what a fresh BlockStore over `volumes` finds in the
    index and reads back verified: the tokens of the full hit, or 0 for a miss. Raises AssertionError
    if a hit reads back shorter than the index promised (torn, missing or wrong data)."""
    geometry, fingerprint = _store_identity(stack)
    token_cache = TokenCache(shared_tokenizer(), 16 << 20)
    redis = open_redis(stack.redis_url, cluster=stack.cfg.redis_cluster, password=stack.secrets.redis_password)
    index = PrefixIndex(redis)
    store = await BlockStore.open(volumes, geometry, fingerprint, index, mac_key=stack.secrets.mac_key, threads=2,
                                  budget_bytes=1 << 40)
    try:
        found = []
        for content in contents:
            tokens = render_chat([ChatMessage("user", content)], token_cache)
            salt = tenant_salt(stack.secrets.salt_key, PUBLIC_TENANT)
            hashes = block_hashes(tokens, fingerprint, salt, B)[:(len(tokens) - 1) // B]
            hit = await index.lookup(hashes)
            prefetch = store.prefetch(hit)
            valid = await prefetch.valid_tokens()
            await prefetch.aclose()
            assert valid == hit.blocks * B, f"the index promised {hit.blocks} blocks, {valid // B} read back verified"
            found.append(valid)
        assert store.stats.verification_failures == 0
        return found
    finally:
        await store.close()
        await redis.aclose()


async def audit_index(stack: Stack, volumes: list[str]) -> int:
    """Every block entry of the prefix index names a segment that exists on one of `volumes` and whose
    header and checksums verify for that block in every layer, read by a fresh BlockStore. Returns
    the number of entries checked; raises AssertionError naming the first bad one."""
    geometry, fingerprint = _store_identity(stack)
    redis = open_redis(stack.redis_url, cluster=stack.cfg.redis_cluster, password=stack.secrets.redis_password)
    # A reader's budget never matters, but object-store volumes need one stated.
    store = await BlockStore.open(volumes, geometry, fingerprint, PrefixIndex(redis), mac_key=stack.secrets.mac_key,
                                  threads=2, budget_bytes=1 << 40)
    try:
        entries = 0
        async for key in redis.scan_iter(match=b"dikv:{*}:b:*", count=1000):
            value = await redis.get(key)
            if value is None or key[38:42] != b"}:b:":
                continue  # expired meanwhile, or not a block entry
            root, block_hash = bytes.fromhex(key[6:38].decode()), key[42:]
            volume, segment, ordinal, n_blocks, offset = value.decode().split("|")
            hit = Hit(root, (block_hash,), (SegmentRun(volume, segment, int(ordinal), 1, int(n_blocks), int(offset)),))
            for layer in range(geometry.num_layers):
                read = await store.read_layer(hit, layer)
                assert read.valid_blocks == 1, f"index entry {key!r} -> {value!r} does not read back verified"
            entries += 1
        assert store.stats.verification_failures == 0
        return entries
    finally:
        await store.close()
        await redis.aclose()
