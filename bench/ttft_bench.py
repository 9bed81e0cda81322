"""ttft_bench: time to first token through the gateway on a miss and on hits from a freshly started
stack, from the page cache and from the engine's memory tier, against each hit's physical lower bound,
the in-process bound and the do-it-yourself transformers alternative, in one run.

    sudo .venv/bin/python -m bench.ttft_bench [--lengths 2K,8K] [--repeats 3]   # root: drop caches
    python -m bench.ttft_bench --url http://host:8000 --admin-token-file FILE --model-dir DIR --volume-dir DIR

Per prompt length L (L - 64 tokens of prefix, then a 64-token new suffix) and per repeat, with fresh
random token ids so a miss is a real miss:
  miss        the whole prompt, nothing cached
  first hit   a restarted stack's first request (every process stopped, page cache dropped, the same
              stack started again on the same data dir and durable index): a cached prefix + a new suffix
  cold hit    then, page cache dropped again, another cached prefix + a new suffix (a process that never
              read it, so nothing of it is mapped or cached)
  warm hit    the same prefix + another new suffix, the engine's memory tier emptied, page cache warm
  memory hit  the same prefix again, from the engine's pool
With --url (someone else's stack) there is no restart: no first hit, and the cold hit is only the page
cache dropped under a running engine (which keeps the segments it mapped). Stack start-up is timed
and reported, never counted in a TTFT. TTFT = client side, request sent -> first streamed chunk
(max_tokens 1). Saves are waited for before each hit.
Bounds, measured in this run: physical = max(prefix bytes / read bandwidth (raw device O_DIRECT for a
prefix on disk, memcpy for one in RAM), suffix FLOPs in the cheaper MLA form / jnp matmul peak)
(bench.ttft_bounds); in-process = max(prefix bytes / raw device, suffix compute of our own
Runner with the prefix's latents in its pool). transformers' DeepseekV3ForCausalLM (float32, sdpa) on the same
weights: miss = prefill from scratch, hit = torch.load of the prefix's DynamicCache + suffix prefill.
By default a fresh stack (preset mini, 1 engine) runs in a temporary directory under --dir.
Writes bench/out/<name>.json, bench/results/<name>.png and its BENCHMARKS.md section (bench.ttft_report).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import report
from bench.kv_bench import drop_caches
from bench.stack import BenchStack, GatewayDriver, peak_rss_bytes
from bench.ttft_bounds import matmul_peak, memcpy_gbps, raw_device, suffix_compute, suffix_flops
from bench.ttft_report import HITS, goals, summarize, table, write
from model.weights import read_identity

BLOCK_TOKENS = 64
COMMAND = "sudo .venv/bin/python -m bench.ttft_bench"  # root only to drop the page cache


def say(message: str) -> None:
    tqdm.write(f"[ttft_bench {time.strftime('%H:%M:%S')}] {message}")


def parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("K") else int(part))
    return sorted(out)


# -- phases --

def run_transformers(args, workdir: Path, lengths: list[int], build_model_dir: bool) -> tuple[dict, Path | None]:
    """The DIY baseline per length; also converts its weights for our stack when build_model_dir."""
    from bench import ttft_bounds as diy

    say(f"transformers: building {args.preset} (float32, random weights, seed 0)"
        + (" and converting it for DeepInfer" if build_model_dir else ""))
    if build_model_dir:
        model, model_dir = diy.build_same_weights(args.preset, workdir)
    else:
        import torch
        from transformers import DeepseekV3ForCausalLM
        torch.manual_seed(0)
        model, model_dir = DeepseekV3ForCausalLM(diy.hf_config(args.preset)).float().eval(), None
    results: dict = {}
    rng = np.random.default_rng(1)
    if args.no_transformers:
        results = {str(n): {"skipped": "--no-transformers"} for n in lengths}
    else:
        plan = []
        for n in lengths:
            ok, need = diy.fits(model, n)
            results[str(n)] = {"estimated_peak_bytes": need, "repeats": []}
            if not ok:
                results[str(n)]["skipped"] = (f"would not fit: ~{need / 2**30:.0f} GiB estimated peak "
                                              f"(mostly (heads, T, T) fp32 attention scores)")
                say(f"transformers {n}: skipped, {results[str(n)]['skipped']}")
            elif n > args.hf_max_tokens:
                results[str(n)]["skipped"] = f"longer than --hf-max-tokens {args.hf_max_tokens} (time)"
                say(f"transformers {n}: skipped, {results[str(n)]['skipped']}")
            else:
                plan.append(n)
        bar = tqdm(total=len(plan) * args.repeats, desc="transformers miss+hit", unit="run")
        for n in plan:
            for _ in range(args.repeats):
                times = diy.transformers_repeat(model, n, args.suffix, workdir / "prefix_cache.pt", args.drop, rng)
                results[str(n)]["repeats"].append(times._asdict())
                bar.update()
        bar.close()
    del model
    gc.collect()
    return results, model_dir


def misses_at(args, n: int) -> int:
    """Misses (fresh prefixes) per length: every repeat, except --long-misses at --long-from tokens and up,
    whose hit repeats then reuse those prefixes (each hit still has a new suffix, cold ones a dropped cache).
    At least two when the stack restarts for cold hits: a fresh stack's first request reads another prefix."""
    misses = args.repeats if n < args.long_from else max(1, min(args.repeats, args.long_misses))
    return max(2, misses) if args.restartable else misses


def run_stack_requests(args, driver: GatewayDriver, lengths: list[int], stack: BenchStack | None,
                       result: dict) -> dict:
    """Fills result["requests"] length by length, writing bench/out/<name>_partial.json after each, so a
    run cut short still leaves what it measured (--report-from renders it).

    Per repeat, with a restartable stack: restart (every process, page cache dropped), then
      first_hit   the fresh stack's first request: another cached prefix of the same length (cold disk,
                  and the process's first request of this shape: tracing, compile-cache reads)
      cold_hit    page cache dropped again, the repeat's prefix + a new suffix: cold disk, warm process
    then, in that process, a warm disk hit (page cache warm, memory tier emptied) and a memory hit."""
    out = result["requests"] = {}
    per_repeat = 4 if stack is not None else 3
    total = sum(misses_at(args, n) + 1 + per_repeat * args.repeats for n in lengths)
    bar = tqdm(total=total, desc="requests via gateway", unit="req")
    for n in lengths:
        rows: dict = {"miss": [], "first_hit": [], "cold_hit": [], "warm_hit": [], "memory_hit": [],
                      "restarts": [], "saves_wait_s": []}
        prefixes = []
        for _ in range(misses_at(args, n)):
            prefixes.append(driver.fresh_tokens(n - args.suffix))
            rows["miss"].append(driver.complete(prefixes[-1] + driver.fresh_tokens(args.suffix))._asdict())
            bar.update()
            rows["saves_wait_s"].append(driver.wait_for_saves())
        # compiles this length's hit shapes (into the persistent compilation cache, for restarts too)
        driver.complete(prefixes[0] + driver.fresh_tokens(args.suffix))
        driver.wait_for_saves()
        bar.update()
        engine_pid = stack.engine_pid if stack is not None else driver.engine_pid
        rows["engine_peak_rss_bytes"] = peak_rss_bytes(engine_pid) if engine_pid else None  # misses' peak
        for rep in range(args.repeats):
            prefix = prefixes[rep % len(prefixes)]
            if stack is not None:
                rows["restarts"].append(stack.restart(args.drop)._asdict())
                driver.engine_pid = stack.engine_pid if args.engines == 1 else None
                other = prefixes[(rep + 1) % len(prefixes)]
                rows["first_hit"].append(driver.complete(other + driver.fresh_tokens(args.suffix))._asdict())
                bar.update()
                driver.wait_for_saves()
            else:  # someone else's stack: the page cache is dropped, but the engine keeps what it mapped
                driver.drop_memory_tier()
            args.drop()
            rows["cold_hit"].append(driver.complete(prefix + driver.fresh_tokens(args.suffix))._asdict())
            bar.update()
            driver.wait_for_saves()
            # A warm disk hit: the memory tier emptied, the segments in the page cache (and mapped).
            driver.drop_memory_tier()
            rows["warm_hit"].append(driver.complete(prefix + driver.fresh_tokens(args.suffix))._asdict())
            bar.update()
            driver.wait_for_saves()
            # A memory hit: the same prefix again, still in the engine's pool from the request before.
            rows["memory_hit"].append(driver.complete(prefix + driver.fresh_tokens(args.suffix))._asdict())
            bar.update()
            driver.wait_for_saves()
        unexpected = [r["cached_tokens"] for r in rows["miss"] if r["cached_tokens"] != 0]
        unexpected += [r["cached_tokens"] for k in HITS for r in rows[k] if r["cached_tokens"] != n - args.suffix]
        if unexpected:
            say(f"{n}: unexpected cached token counts {unexpected}")
        out[str(n)] = rows
        report.write_json(args.name + "_partial", result)
        say(f"{n}: " + ", ".join(f"{k.replace('_', ' ')} {statistics.median(r['client_ttft_s'] for r in rows[k]):.2f} s"
                                 for k in ("miss",) + HITS if rows[k]))
    bar.close()
    return out


def measure(args) -> dict:
    if args.url and not (args.admin_token_file and args.model_dir):
        raise SystemExit("--url needs --admin-token-file and --model-dir (the lower bound runs that model in-process)")
    lengths = parse_lengths(args.lengths)
    for n in lengths:
        if n <= args.suffix or (n - args.suffix) % BLOCK_TOKENS:
            raise SystemExit(f"--lengths: {n} - suffix {args.suffix} must be a positive multiple of {BLOCK_TOKENS}")
    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    can_drop = drop_caches() if not args.no_drop else False
    args.drop = drop_caches if can_drop else (lambda: False)
    args.restartable = not args.url
    if not can_drop:
        say("page cache not dropped (--no-drop or not root): 'cold' hits are warm")
    own = not args.url
    result: dict = {"preset": args.preset, "lengths": lengths, "suffix": args.suffix,
                    "repeats": args.repeats, "own_stack": own, "engines": args.engines if own else None,
                    "cold_is_cold": can_drop, "phases_s": {},
                    "misses": {str(n): misses_at(args, n) for n in lengths}}
    begin = time.perf_counter()
    failed = True
    try:
        diy, model_dir = run_transformers(args, work, lengths, build_model_dir=own)
        result["transformers"] = diy
        result["same_weights"] = own
        model_dir = model_dir or Path(args.model_dir)
        result["phases_s"]["transformers"] = time.perf_counter() - begin

        mark = time.perf_counter()
        say(f"suffix compute in-process (Runner on {model_dir.name}), prefix latents in its pool")
        bar = tqdm(total=len(lengths) * (args.repeats + 1), desc="suffix compute", unit="run")
        compute = suffix_compute(model_dir, lengths, args.suffix, args.repeats, chunk_tokens=args.chunk_tokens,
                                 progress=bar)
        bar.close()
        result["suffix_compute"] = {str(c.tokens): c._asdict() for c in compute}
        result["phases_s"]["suffix_compute"] = time.perf_counter() - mark

        volume_dir = work if own else Path(args.volume_dir or work)
        say(f"raw device bandwidth of {volume_dir} (dd iflag=direct, {args.dd_mib} MiB)")
        result["raw_device"] = raw_device(volume_dir, args.dd_mib)._asdict()
        say(f"raw: {result['raw_device']['dd_gbps']:.2f} GB/s dd, {result['raw_device']['parallel_gbps']:.2f} GB/s "
            "8 parallel readers")

        say("physical bound: matmul peak (jnp, float32 and bfloat16) and memcpy bandwidth")
        result["matmul_peak"] = dict(matmul_peak()._asdict(), load_average=os.getloadavg()[0])
        result["memcpy_gbps"] = memcpy_gbps()
        say(f"matmul peak {result['matmul_peak']['float32_gflops']:.0f} GFLOP/s float32, "
            f"{result['matmul_peak']['bfloat16_gflops']:.0f} bfloat16; memcpy {result['memcpy_gbps']:.1f} GB/s")
        model_cfg, _ = read_identity(model_dir)
        result["model_config"] = model_cfg.to_json()
        result["suffix_flops"] = {str(n): suffix_flops(model_cfg, n - args.suffix, args.suffix)._asdict()
                                  for n in lengths}

        mark = time.perf_counter()
        stack = None
        if own:
            stack = BenchStack(args.preset, model_dir, work / "stack", args.engines)
            say(f"starting a stack ({args.engines} engine(s)) in {stack.cfg.data_dir}")
            # A long miss on a busy machine can take more than the gateway's default 600 s to its first token.
            os.environ.setdefault("DEEPINFER_GATEWAY_FIRST_TOKEN_TIMEOUT_S", "3600")
            stack.start()
            # ports: engine replicas take engine_port + i, so with >1 engine a clash is possible (rare)
            driver = GatewayDriver(stack.gateway_url, stack.admin_token, stack.engine_urls,
                                   engine_pid=stack.engine_pid if args.engines == 1 else None)
        else:
            admin_token = Path(args.admin_token_file).read_text().strip()
            driver = GatewayDriver(args.url, admin_token, engine_pid=args.engine_pid or None)
        result["phases_s"]["stack_start"] = time.perf_counter() - mark
        try:
            mark = time.perf_counter()
            run_stack_requests(args, driver, lengths, stack, result)
            result["phases_s"]["requests"] = time.perf_counter() - mark
        finally:
            if stack is not None:
                stack.stop()
        failed = False
    finally:
        if failed:
            say(f"failed: kept {work} (stack logs under stack/logs)")
        elif not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - begin
    result["load_average_end"] = os.getloadavg()[0]
    result["summary"] = summarize(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="", help="a running gateway (default: start a fresh stack)")
    parser.add_argument("--admin-token-file", default="", help="file holding the running stack's admin token "
                        "(with --url; e.g. DATA_DIR/secrets/admin_token): a token on the command line is seen by `ps`")
    parser.add_argument("--model-dir", default="", help="the running stack's model directory (with --url)")
    parser.add_argument("--volume-dir", default="", help="a directory on the volume's device (with --url)")
    parser.add_argument("--engine-pid", type=int, default=0, help="engine process id for VmHWM (with --url)")
    parser.add_argument("--preset", default="mini", help="model preset of the stack this bench starts")
    parser.add_argument("--engines", type=int, default=1, help="engine replicas of the stack this bench starts")
    parser.add_argument("--lengths", default="2K,8K",
                        help="prompt lengths in tokens (1K = 1024); 16K adds ~5 min of misses on mini, "
                        "hence not default")
    parser.add_argument("--suffix", type=int, default=64, help="new tokens after the cached prefix")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per point (median and min-max)")
    parser.add_argument("--long-from", type=int, default=16384, help="prompts this long count as slow points")
    parser.add_argument("--long-misses", type=int, default=1,
                        help="misses at slow points (their hit repeats reuse these prefixes)")
    parser.add_argument("--hf-max-tokens", type=int, default=8192,
                        help="longest prompt transformers runs (its 16K miss takes minutes even where it fits)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="the engine's prefill chunk (EngineConfig)")
    parser.add_argument("--dd-mib", type=int, default=1024, help="size of the raw-bandwidth test file")
    parser.add_argument("--dir", default=str(report.OUT / "ttft_bench"), help="work directory (on the device to test)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--no-drop", action="store_true", help="never drop the page cache")

    def done(result: dict) -> int:
        print(table(result))
        print("\n".join(goals(result)))
        return 0
    return report.main(parser, measure, write, name="ttft_bench", command=COMMAND, argv=argv, done=done)


if __name__ == "__main__":
    sys.exit(main())
