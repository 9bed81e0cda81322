"""Mooncake trace replay: prefix-cache hit ratio against capacity, and a live slice through a real stack.

    python -m bench.trace_bench            (or: deepinfer bench trace)
      [--trace PATH] [--capacities 1M 3M 10M 50M inf] [--volumes 4]
      [--sessions 8] [--min-turns 3] [--scale 16] [--time-scale 6] [--max-output 8] [--preset tiny]
      [--admit-after 1 2 3] [--admission-capacities 1M inf] [--no-live] [--no-report] [--quiet]

1. Index level, the whole trace (seconds, no model): DeepInfer's rules (64-token blocks, one prompt
   token always left to prefill, prompt and answer blocks saved after each request) on an in-memory
   mirror of BlockStore's capacity rules (least-recently-hit segments evicted per volume), at each
   capacity, next to the ceiling the trace allows (every prompt token of a hash id seen before);
   bytes read and written for the `mini` and `deepseek-v3` cache geometries.
2. Live: the first --sessions sessions of >= --min-turns requests (all their turns, over the hour:
   chosen for multi-turn reuse, so NOT the trace's mix), hash ids scaled to
   512/--scale tokens, arrivals --time-scale times faster, answers capped at --max-output tokens,
   sent as streaming /v1/completions with token-id prompts to a fresh stack (`deepinfer up`'s
   launcher, --preset): hit ratio (next to the index model's prediction for the same slice),
   TTFT p50/p90/p99 for hits and misses, throughput, errors.
3. Admission (index level, seconds): for each --admit-after N and capacity, bytes written, hit ratio and hit
   tokens on the Mooncake trace and on an agent-like workload (bench.trace_format.agent_trace); the suggested
   default is the N whose hit ratio stays within 1 point of N = 1 everywhere while writing the least. The model
   has no memory tier: a block's sightings before it is written are misses here, where an engine that still
   holds it in memory serves them.
Writes bench/out/trace_bench.json, bench/results/trace_*.png and the BENCHMARKS.md section.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench import report
from bench.trace_format import (DEFAULT_TRACE, MOONCAKE_HASH_TOKENS, agent_trace, load_trace, scale_request,
                                session_slice)
from bench.trace_live import LiveRequest, percentile, replay_live
from bench.trace_replay import ReplayResult, capacity_budget, replay, replay_timed, trace_ceiling
from bench.trace_store_model import StoreModel
from kvstore import CacheGeometry
from model.config import preset

GEOMETRIES = ("mini", "deepseek-v3")
HIT_FRACTION = 0.5  # a live request is a "hit" when at least this much of its prompt came from the cache


def geometry_of(name: str, block_tokens: int = 64) -> CacheGeometry:
    cfg = preset(name)
    return CacheGeometry(cfg.num_layers, cfg.latent_dim, block_tokens, cfg.cache_dtype)


def parse_tokens(text: str) -> int | None:
    """'10M', '3k', '50000' -> tokens; 'inf' / '0' -> None (unbounded)."""
    t = text.strip().lower()
    if t in ("inf", "unbounded", "0"):
        return None
    scale = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be tokens like 10M or 'inf', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"capacity must be > 0 tokens, got {text!r}")
    return int(value)


def capacity_label(tokens: int | None) -> str:
    if tokens is None:
        return "unbounded"
    return f"{tokens / 1e6:g}M" if tokens >= 1_000_000 else f"{tokens:,}"


# ---- index level -------------------------------------------------------------------------------

def capacity_row(tokens: int | None, result: ReplayResult, seconds: float) -> dict:
    miss_tokens = result.input_tokens - result.hit_tokens
    geometries = {}
    for name in GEOMETRIES:
        g = geometry_of(name)
        read, written = result.bytes_read(g), result.bytes_written(g)
        geometries[name] = {
            "bytes_read": read, "bytes_written": written,
            "read_bytes_per_hit_token": g.num_layers * g.row_bytes,
            "written_bytes_per_miss_token": written / miss_tokens if miss_tokens else 0.0,
            "read_GBps_avg": read / seconds / 1e9, "written_GBps_avg": written / seconds / 1e9}
    return {"capacity_tokens": tokens, "label": capacity_label(tokens), "hit_ratio": result.hit_ratio,
            "hit_tokens": result.hit_tokens, "input_tokens": result.input_tokens,
            "hit_requests": result.hit_requests, "mostly_hit_requests": result.mostly_hit_requests,
            "stranded_tokens": result.stranded_tokens,
            "saved_blocks": result.saved_blocks,
            "evictions": result.evictions, "failed_saves": result.failed_saves, "live_blocks": result.live_blocks,
            "bytes": geometries}


def index_level(args: argparse.Namespace) -> dict:
    trace = load_trace(args.trace)
    seconds = max(1.0, (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000)
    ceiling_hits, inputs = trace_ceiling(trace, MOONCAKE_HASH_TOKENS)
    sizing = geometry_of(args.geometry)
    rows = []
    for tokens in args.capacities:
        store = StoreModel(sizing, args.volumes, capacity_budget(tokens, sizing, args.volumes))
        steps = tqdm(trace, desc=f"replay {capacity_label(tokens):>9}", unit="req", disable=args.quiet)
        rows.append(capacity_row(tokens, replay(steps, store, MOONCAKE_HASH_TOKENS), seconds))
    return {"trace": str(args.trace), "requests": len(trace), "trace_seconds": seconds,
            "input_tokens": inputs, "output_tokens": sum(r.output_length for r in trace),
            "ceiling": {"hit_tokens": ceiling_hits, "hit_ratio": ceiling_hits / inputs},
            "sizing_geometry": args.geometry, "volumes": args.volumes, "capacity": rows}


ADMISSION_POINTS = 0.01  # a default N may lose at most this much hit ratio against N = 1, anywhere


def admission(args: argparse.Namespace) -> dict:
    """Bytes written, hit ratio and hit tokens per --admit-after N and capacity, on the trace and an agent workload."""
    sizing = geometry_of(args.geometry)
    workloads = []
    for name, trace in (("Mooncake conversation trace", load_trace(args.trace)), ("agent-like (generated)",
                                                                                  agent_trace())):
        ceiling_hits, inputs = trace_ceiling(trace, MOONCAKE_HASH_TOKENS)
        rows = []
        for tokens in args.admission_capacities:
            for n in args.admit_after:
                store = StoreModel(sizing, args.volumes, capacity_budget(tokens, sizing, args.volumes))
                steps = tqdm(trace, desc=f"admit {n} {capacity_label(tokens):>9}", unit="req", disable=args.quiet)
                result = replay(steps, store, MOONCAKE_HASH_TOKENS, admit_after=n)
                rows.append({"capacity_tokens": tokens, "label": capacity_label(tokens), "admit_after": n,
                             "hit_ratio": result.hit_ratio, "hit_tokens": result.hit_tokens,
                             "saved_blocks": result.saved_blocks, "bytes_written": result.bytes_written(sizing),
                             "bytes_read": result.bytes_read(sizing)})
        workloads.append({"name": name, "requests": len(trace), "input_tokens": inputs,
                          "ceiling_hit_ratio": ceiling_hits / inputs, "rows": rows})
    return {"geometry": args.geometry, "workloads": workloads, "default": admission_default(workloads)}


def admission_default(workloads: list[dict]) -> int:
    """The N within ADMISSION_POINTS of N = 1's hit ratio on every workload and capacity that writes the least."""
    rows = {(w["name"], r["label"], r["admit_after"]): r for w in workloads for r in w["rows"]}

    def within(n: int) -> bool:
        return all(rows[(w, c, 1)]["hit_ratio"] - r["hit_ratio"] <= ADMISSION_POINTS
                   for (w, c, m), r in rows.items() if m == n)

    def written(n: int) -> int:
        return sum(r["bytes_written"] for (_, _, m), r in rows.items() if m == n)
    return min((n for n in sorted({m for _, _, m in rows}) if within(n)), key=written)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- live --------------------------------------------------------------------------------------

def live_slice(args: argparse.Namespace) -> list:
    picked = session_slice(load_trace(args.trace), args.sessions, args.min_turns)
    scaled = [scale_request(r, args.scale) for r in picked]
    return [r._replace(output_length=min(r.output_length, args.max_output)) for r in scaled]


def summarize_live(results: list[LiveRequest], predicted: ReplayResult, timed: ReplayResult, wall_s: float) -> dict:
    ok = [r for r in results if not r.error]
    hits = [r for r in ok if r.hit_tokens >= HIT_FRACTION * r.prompt_tokens]
    misses = [r for r in ok if r.hit_tokens < HIT_FRACTION * r.prompt_tokens]

    def ttft(group: list[LiveRequest]) -> dict:
        values = [r.ttft_s for r in group]
        return {"requests": len(group), "p50_s": percentile(values, 50), "p90_s": percentile(values, 90),
                "p99_s": percentile(values, 99),
                "prompt_tokens_mean": sum(r.prompt_tokens for r in group) / len(group) if group else 0.0}

    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": sorted({r.error for r in results if r.error})[:5],
        "arrival_span_s": results[-1].arrival_s if results else 0.0, "wall_s": wall_s,
        "hit_ratio": sum(r.hit_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "predicted_hit_ratio": predicted.hit_ratio,
        "requests_matching_prediction": _matching(results, predicted),
        "timed_predicted_hit_ratio": timed.hit_ratio,
        "requests_matching_timed_prediction": _matching(results, timed),
        "ttft": {"all": ttft(ok), "hit": ttft(hits), "miss": ttft(misses)},
        "throughput": {"requests_per_s": len(ok) / wall_s, "prompt_tokens_per_s": prompt_tokens / wall_s,
                       "completion_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s},
        "per_request": [r._asdict() for r in results],
    }


def _matching(results: list[LiveRequest], predicted: ReplayResult) -> int:
    return sum(r.hit_tokens == p for r, p in zip(results, predicted.per_request_hits) if not r.error)


def timed_prediction(requests: list, results: list[LiveRequest], hash_tokens: int, preset_name: str,
                     volumes: int) -> ReplayResult:
    """The index model with each save landing when the live run says it started (first token, end
    of stream); a failed request saves nothing."""
    times = [(r.arrival_s, r.arrival_s + r.ttft_s, r.arrival_s + r.latency_s) if not r.error
             else (r.arrival_s, math.inf, math.inf) for r in results]
    return replay_timed(requests, StoreModel(geometry_of(preset_name), volumes), hash_tokens, times)


def live(args: argparse.Namespace) -> dict:
    from services.launcher import Stack, StackConfig

    requests = live_slice(args)
    hash_tokens = MOONCAKE_HASH_TOKENS // args.scale
    predicted = replay(requests, StoreModel(geometry_of(args.preset), args.volumes), hash_tokens)
    data = Path(tempfile.mkdtemp(prefix="trace_bench_"))
    cfg = StackConfig(preset=args.preset, data_dir=str(data), gateway_port=free_port(), kvstore_port=free_port(),
                      engine_port=free_port(), redis_port=free_port(), engines=1, ready_timeout_s=600,
                      volumes=[str(data / "volumes" / f"vol{i}") for i in range(args.volumes)])
    stack = Stack(cfg, quiet=args.quiet)
    try:
        begin = time.perf_counter()
        stack.start()
        started_s = time.perf_counter() - begin
        load_average = os.getloadavg()[0]
        begin = time.perf_counter()
        results = asyncio.run(replay_live(stack.gateway_url, requests, hash_tokens, args.time_scale,
                                          progress=not args.quiet))
        wall_s = time.perf_counter() - begin
    finally:
        stack.stop()
        shutil.rmtree(data, ignore_errors=True)
    timed = timed_prediction(requests, results, hash_tokens, args.preset, args.volumes)
    summary = summarize_live(results, predicted, timed, wall_s)
    return {"preset": args.preset, "sessions": args.sessions, "min_turns": args.min_turns, "scale": args.scale, "hash_tokens": hash_tokens,
            "time_scale": args.time_scale, "max_output": args.max_output, "stack_start_s": started_s,
            "load_average_at_start": load_average, **summary}


# ---- main --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer bench trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument("--capacities", type=parse_tokens, nargs="+",
                        default=[1_000_000, 3_000_000, 10_000_000, 50_000_000, None],
                        help="store capacities in tokens (10M, 3k, inf)")
    parser.add_argument("--volumes", type=int, default=4, help="volumes sharing the capacity (as `deepinfer up`)")
    parser.add_argument("--geometry", default="deepseek-v3", choices=GEOMETRIES,
                        help="cache geometry that turns capacity tokens into the byte budget")
    parser.add_argument("--admit-after", type=int, nargs="+", default=[1, 2, 3],
                        help="admission: write a block on its N-th sighting, for each N given (1 must be among them)")
    parser.add_argument("--admission-capacities", type=parse_tokens, nargs="+", default=[1_000_000, None],
                        help="admission: store capacities in tokens")
    parser.add_argument("--no-admission", action="store_true", help="skip the admission table")
    parser.add_argument("--no-live", action="store_true", help="index level only")
    parser.add_argument("--sessions", type=int, default=8, help="live: the first N sessions, all their turns")
    parser.add_argument("--min-turns", type=int, default=3, help="live: only sessions of at least this many requests")
    parser.add_argument("--scale", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64],
                        help="live: a hash id stands for 512/scale tokens (16: two ids per 64-token block)")
    parser.add_argument("--time-scale", type=float, default=6.0, help="live: arrivals this many times faster")
    parser.add_argument("--max-output", type=int, default=8, help="live: answer tokens at most (after scaling)")
    parser.add_argument("--preset", default="tiny", help="live: model preset of the stack")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def measure(args) -> dict:
    if args.volumes < 1 or args.sessions < 1 or args.max_output < 1 or args.time_scale <= 0:
        raise SystemExit("--volumes, --sessions, --max-output must be >= 1 and --time-scale > 0")
    if not args.trace.exists():
        raise SystemExit(f"--trace: {args.trace} does not exist")
    if 1 not in args.admit_after or min(args.admit_after) < 1:
        raise SystemExit("--admit-after: each N must be >= 1, and 1 (write everything) must be among them")
    result = {"index": index_level(args)}
    if not args.no_admission:
        result["admission"] = admission(args)
    if not args.no_live:
        result["live"] = live(args)
    return result


def main(argv: list[str] | None = None) -> int:
    from bench.trace_report import write_report

    def done(result: dict) -> int:
        print_summary(result)
        return 1 if result.get("live", {}).get("errors", 0) else 0
    return report.main(build_parser(), measure, lambda result: write_report(result, HIT_FRACTION),
                       name="trace_bench", command="python -m bench.trace_bench", argv=argv, done=done)


def print_summary(result: dict) -> None:
    index = result["index"]
    print(f"ceiling {index['ceiling']['hit_ratio']:.1%}; " + ", ".join(
        f"{row['label']}: {row['hit_ratio']:.1%}" for row in index["capacity"]))
    if "admission" in result:
        print(f"admission: suggested --admit-after {result['admission']['default']}")
    if "live" in result:
        live_result = result["live"]
        t = live_result["ttft"]
        print(f"live: {live_result['requests']} requests, {live_result['errors']} errors, hit ratio "
              f"{live_result['hit_ratio']:.1%} (model: {live_result['predicted_hit_ratio']:.1%} unloaded, "
              f"{live_result['timed_predicted_hit_ratio']:.1%} with the run's timings, "
              f"{live_result['requests_matching_timed_prediction']} requests exact), TTFT p50 hit "
              f"{t['hit']['p50_s']:.3f} s / miss {t['miss']['p50_s']:.3f} s")


if __name__ == "__main__":
    raise SystemExit(main())
