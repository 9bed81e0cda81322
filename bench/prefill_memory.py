"""Peak memory of one long prefill on a preset (issue: 32K tokens on `mini` under weights + 3 GiB).

    python -m bench.prefill_memory [--preset mini] [--tokens 32768]

Samples the process's RSS every 50 ms during the prefill and reports the peak above the RSS after the
weights are loaded, and appends the result to BENCHMARKS.md's "Long-prompt memory" section.
"""
from __future__ import annotations

import argparse
import gc
import threading
import time

import jax
import numpy as np

from bench.report import machine, update_section
from model.config import preset
from model.runner import ModelRunner
from model.weights import init_model


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--tokens", type=int, default=32_768)
    args = parser.parse_args(argv)
    cfg = preset(args.preset)
    model = init_model(cfg, progress=True)
    gc.collect()
    runner = ModelRunner(model, cfg)
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves((runner.embed_VD, runner.layers, runner.head[1]))
                  if hasattr(leaf, "nbytes"))
    base = peak = rss_bytes()
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes())
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens)
    print(f"prefill of {args.tokens} tokens on {args.preset} ...", flush=True)
    begin = time.perf_counter()
    runner.prefill(tokens)
    seconds = time.perf_counter() - begin
    done.set()
    line = (f"{args.tokens:,}-token prefill on `{args.preset}`: peak RSS {(peak - base) / 2**30:.2f} GiB above the "
            f"loaded process ({base / 2**30:.2f} GiB, weights {weights / 2**30:.2f} GiB); goal: under weights + 3 GiB. "
            f"Prefill took {seconds:.0f} s.")
    print(line)
    update_section("Long-prompt memory (prefill_memory)", f"Command: `python -m bench.prefill_memory --preset "
                   f"{args.preset} --tokens {args.tokens}`\n\nMachine: {machine()}.\n\n- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
