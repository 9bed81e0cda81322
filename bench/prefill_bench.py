"""Prefill tokens/s of a 2-layer DeepSeek-V2-Lite-shaped model: one-pass vs blockwise attention, side by side.

    python -m bench.prefill_bench [--layers 2] [--tokens 4096 16384] [--repeats 3] [--dtype float32]

V2-Lite's real widths (hidden 2048, 16 heads, kv_lora 512, qk_nope 128, rope 64, v 128, 64 routed experts
top-6 + 2 shared, expert intermediate 1408, layer 0 dense with intermediate 10944, vocab 102400), the layer
count cut to --layers, random weights drawn with jax.random (`init_on_device`), a bf16 latent cache (the
preset's). Both runners share the weights and differ only in attention:
- one pass (key_block=0): every score of a chunk at once, (N, T, view) float32, so the chunk shrinks as
  the prompt grows (the budget rule of `ModelRunner.chunk_size`);
- blockwise (key_block=512): online softmax over 512-row key blocks, the chunk stays at --chunk-tokens.
Per length: one warm-up run of each (compiles), then --repeats pairs run back to back (one pass,
blockwise), so load on this shared machine hits both alike; medians of each and of the pairs' ratios.
--small cuts every width (the CPU test's shape).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx

from bench.accelerator_check import SMALL
from bench.report import RESULTS, machine, markdown_table, update_section, write_json
from model.config import preset
from model.mla import KEY_BLOCK
from model.runner import ModelRunner
from model.weights import init_on_device

VARIANTS = {"one_pass": 0, "blockwise": KEY_BLOCK}  # name -> ModelRunner key_block


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


class PeakRss:
    """Samples this process's resident memory every 50 ms while running."""

    def __init__(self):
        self.peak, self._done = rss_bytes(), threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._done.set()
        return max(self.peak, rss_bytes())


def timed_prefill(runner: ModelRunner, tokens: np.ndarray) -> float:
    begin = time.perf_counter()
    jax.block_until_ready(runner.prefill_on_device(tokens)[0])
    return time.perf_counter() - begin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16_384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="weights and compute dtype")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="every width cut down (tests)")
    parser.add_argument("--no-report", action="store_true", help="do not write BENCHMARKS.md or the PNG")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    cfg = preset("deepseek-v2-lite", num_layers=args.layers, param_dtype=args.dtype, **(SMALL if args.small else {}))
    load_start = os.getloadavg()
    watch = PeakRss()
    model = init_on_device(cfg)
    gc.collect()
    runners = {name: ModelRunner(model, cfg, chunk_tokens=args.chunk_tokens, key_block=block)
               for name, block in VARIANTS.items()}
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"weights {weights / 2**30:.2f} GiB, RSS {rss_bytes() / 2**30:.2f} GiB", flush=True)
    rows = []
    for n in args.tokens:
        tokens = np.random.default_rng(n).integers(0, cfg.vocab_size, n)
        for runner in runners.values():  # warm-up: compiles every chunk and view shape of this length
            timed_prefill(runner, tokens)
        runs = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                runs[name].append(timed_prefill(runner, tokens))
        ratios = sorted(a / b for a, b in zip(runs["one_pass"], runs["blockwise"]))
        row = {"tokens": n, "runs_s": runs, "ratio_one_pass_over_blockwise": statistics.median(ratios),
               "ratio_min": ratios[0], "ratio_max": ratios[-1]}
        for name, runner in runners.items():
            row[name] = {"chunk": min(runner.chunk_size(n), n), "seconds": statistics.median(runs[name]),
                         "tokens_per_s": n / statistics.median(runs[name])}
        rows.append(row)
        print(row, flush=True)
        # Written after every length, so a run stopped during a long one keeps the shorter ones.
        results = {"command": " ".join(argv if argv is not None else sys.argv[1:]), "machine": machine(),
                   "backend": jax.default_backend(), "dtype": args.dtype, "cache_dtype": cfg.cache_dtype,
                   "layers": args.layers, "small": args.small, "repeats": args.repeats, "key_block": KEY_BLOCK,
                   "chunk_tokens": args.chunk_tokens, "weights_bytes": weights, "peak_rss_bytes": watch.peak,
                   "load_average": [load_start[0], os.getloadavg()[0]], "rows": rows}
        write_json("prefill_bench", results)
        if not args.no_report:
            plot(results)
            write_section(results)
    watch.stop()
    return 0


def write_section(results: dict) -> None:
    table = markdown_table(
        ["prompt tokens", "one pass: chunk", "one pass tokens/s", "blockwise: chunk", "blockwise tokens/s",
         "one pass time / blockwise time (median, min-max)"],
        [[r["tokens"], r["one_pass"]["chunk"], f"{r['one_pass']['tokens_per_s']:,.0f}", r["blockwise"]["chunk"],
          f"{r['blockwise']['tokens_per_s']:,.0f}",
          f"{r['ratio_one_pass_over_blockwise']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"]
         for r in results["rows"]])
    update_section("Prefill attention (prefill_bench)", f"""Command: `nice -n 5 python -m bench.prefill_bench {results['command']}`

Machine: {results['machine']}; JAX backend `{results['backend']}`. A {results['layers']}-layer DeepSeek-V2-Lite-shaped
model{' (widths cut down: --small)' if results['small'] else ' at full widths'}, random {results['dtype']} weights from
jax.random ({results['weights_bytes'] / 2**30:.2f} GiB), {results['cache_dtype']} latent cache, one prompt prefilled from
scratch per run. "one pass" holds every score of a chunk at once, so its chunk is what the 512 MiB attention
budget allows at that length; "blockwise" is online softmax over {results['key_block']}-row key blocks with
--chunk-tokens {results['chunk_tokens']}-token chunks. Median of {results['repeats']} runs each after a warm-up, run
in alternating pairs; the ratio is the median of the pairs' ratios. Peak RSS of the process
{results['peak_rss_bytes'] / 2**30:.2f} GiB. 1-minute load average {results['load_average'][0]:.1f} at the start,
{results['load_average'][1]:.1f} at the end (this machine is shared, and the run is niced): compare the two forms
within a row, where each pair ran back to back; tokens/s across rows also follow the load of their moment.

{table}

![prefill bench](bench/results/prefill_bench.png)""")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, (name, label) in zip((-0.2, 0.2), (("one_pass", "one pass"), ("blockwise", "blockwise"))):
        values = [r[name]["tokens_per_s"] for r in rows]
        bars = ax.bar(x + offset, values, width=0.4, label=label)
        ax.bar_label(bars, labels=[f"chunk {r[name]['chunk']}" for r in rows], fontsize=8)
    ax.set_xticks(x, [f"{r['tokens']:,} tokens" for r in rows])
    ax.set_ylabel("prefill tokens/s (median)")
    ax.set_title(f"{results['layers']}-layer V2-Lite-shaped model, {results['dtype']}, {results['backend']}\n"
                 "(pairs run back to back per length; compare within a length)", fontsize=10)
    ax.legend()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(RESULTS / "prefill_bench.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
