"""reconcile_bench: how fast the kvstore reconciles its volumes with the index (segments/s).

Writes `--segments` segment objects of `--blocks` blocks (mini geometry: 8 layers x 576 dims x
64-token blocks, bf16) over `--volumes` volume directories under --dir, then times three passes
of `Reconciler.run()` against a durable embedded Valkey (AOF fsync every second, as `deepinfer up`):
  lost index    Valkey flushed: every segment republished (header read, size check, ledger record,
                one index entry per block)
  intact index  everything known: header read and size check only
  cold          intact again, page cache dropped first (root only), so every header read hits the disk
Reconciliation reads a segment's header and checks its size; it never reads latents. So each
object is its real header followed by a sparse hole of the data's size (same names, same sizes,
same header bytes as a save writes; 36 MiB of data per 64-block segment would not fit on the disk).
Writes bench/out/reconcile_bench.json and the "Reconciliation (reconcile_bench)" section of BENCHMARKS.md.

    .venv/bin/python -m bench.lab.reconcile_bench [--dir DIR] [--segments 4000] [--blocks 64] [--volumes 4]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bench import report
from bench.kv_bench import FINGERPRINT, GEOMETRY, MAC_KEY, drop_caches, free_port
from kvstore import BlockStore, PrefixIndex, Reconciler, open_redis
from kvstore.hashing import HASH_BYTES
from kvstore.retention import DAY_S
from kvstore.block_mac import BlockMac
from kvstore.segment import SegmentPublication, encode_header
from kvstore.volume import segment_key
from services.launcher import durable_valkey

COMMAND = ".venv/bin/python -m bench.lab.reconcile_bench"


def progress(message: str) -> None:
    print(f"[reconcile_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_segments(volumes: list[Path], count: int, blocks: int) -> int:
    """`count` segment objects spread round-robin over `volumes`; returns bytes per object."""
    rng = np.random.default_rng(0)
    size = 0
    written_at = int(time.time()) - 3600
    for i in range(count):
        hashes = [rng.bytes(HASH_BYTES) for _ in range(blocks)]
        checksums = rng.integers(0, 1 << 63, (GEOMETRY.num_layers, blocks), dtype=np.uint64)
        publication = SegmentPublication(hashes[0], "chat", 7 * DAY_S, written_at + 7 * DAY_S)
        head = encode_header(FINGERPRINT, GEOMETRY, "bench", hashes, checksums, BlockMac(MAC_KEY), publication=publication)
        size = len(head) + blocks * GEOMETRY.num_layers * GEOMETRY.block_bytes
        path = volumes[i % len(volumes)] / segment_key(secrets.token_hex(16))
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(size)  # a hole where the latents would be
    return size


async def timed_pass(store: BlockStore, concurrency: int) -> dict:
    done = await Reconciler(store, min_age_s=0, concurrency=concurrency).run()
    assert not done.busy and not done.quarantined, done
    return {"seconds": done.seconds, "segments": done.segments, "segments_per_s": done.segments_per_s,
            "outcomes": dict(done.outcomes)}


async def run(args: argparse.Namespace) -> dict:
    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    volumes = [work / "volumes" / f"ssd{i}" for i in range(args.volumes)]
    for volume in volumes:
        (volume / "segments").mkdir(parents=True)
    progress(f"writing {args.segments} segments of {args.blocks} blocks over {args.volumes} volumes in {work}")
    object_bytes = write_segments(volumes, args.segments, args.blocks)
    result: dict = {"segments": args.segments, "blocks_per_segment": args.blocks, "volumes": args.volumes,
                    "object_bytes": object_bytes, "concurrency": args.concurrency,
                    "machine": report.machine(), "load_average_start": os.getloadavg()[0]}
    valkey = durable_valkey(work / "valkey", "127.0.0.1", free_port(), "reconcile-bench-password")
    valkey.start()
    client = open_redis(valkey.url, password="reconcile-bench-password")
    store = await BlockStore.open([str(v) for v in volumes], GEOMETRY, FINGERPRINT, PrefixIndex(client),
                                  mac_key=MAC_KEY, threads=8)
    try:
        await client.flushall()
        result["lost_index"] = await timed_pass(store, args.concurrency)
        assert result["lost_index"]["outcomes"].get("republished") == args.segments, result["lost_index"]
        progress(f"lost index: {result['lost_index']['segments_per_s']:.0f} segments/s")
        result["intact_index"] = await timed_pass(store, args.concurrency)
        assert result["intact_index"]["outcomes"].get("known") == args.segments, result["intact_index"]
        progress(f"intact index: {result['intact_index']['segments_per_s']:.0f} segments/s")
        result["cold_is_cold"] = drop_caches()
        result["intact_index_cold"] = await timed_pass(store, args.concurrency)
        progress(f"intact index, page cache dropped: {result['intact_index_cold']['segments_per_s']:.0f} segments/s")
    finally:
        await store.close()
        await client.aclose()
        valkey.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_end"] = os.getloadavg()[0]
    return result


def write_section(r: dict) -> None:
    rows = [[name, f"{r[key]['seconds']:.2f}", f"{r[key]['segments_per_s']:.0f}",
             f"{r[key]['segments_per_s'] * r['blocks_per_segment']:.0f}"]
            for name, key in (("index lost: every segment republished", "lost_index"),
                              ("index intact: every segment known", "intact_index"),
                              ("index intact, page cache dropped first" + ("" if r["cold_is_cold"] else
                                                                          " (not root: NOT dropped)"),
                               "intact_index_cold"))]
    body = "\n".join([
        f"One reconciliation pass (`Reconciler.run()`) over {r['segments']} segments of {r['blocks_per_segment']} "
        f"blocks (mini geometry, {r['object_bytes'] / 2**20:.1f} MiB each) on {r['volumes']} volume directories of "
        f"this machine's disk, {r['concurrency']} segments in flight, against an embedded Valkey with AOF (fsync "
        "every second). A pass reads each header (4 KiB, 8 KiB for 64 blocks) and checks the size; it never reads "
        "latents, so the objects are real headers followed by sparse holes of the data's size.",
        "",
        "```",
        r["command"] + "   # as root: the cold pass drops the page cache",
        "```",
        "",
        report.markdown_table(["pass", "seconds", "segments/s", "blocks/s"], rows),
        "",
        f"- machine: {r['machine']}; 1-minute load average {r['load_average_start']:.1f} at the start, "
        f"{r['load_average_end']:.1f} at the end (a shared machine).",
    ])
    report.update_section("Reconciliation (reconcile_bench)", body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(report.OUT / "reconcile_bench"), help="work directory on the disk to test")
    parser.add_argument("--segments", type=int, default=4000, help="segment objects")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per segment")
    parser.add_argument("--volumes", type=int, default=4, help="volume directories (all under --dir)")
    parser.add_argument("--concurrency", type=int, default=32, help="segments reconciled at once")
    return report.main(parser, lambda args: asyncio.run(run(args)), write_section, name="reconcile_bench",
                       command=COMMAND, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
