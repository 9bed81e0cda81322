"""decode_bench: one model step of the paged runner, in-process: decode batches and prefill segments,
in the default mode and in batch-invariant mode (every decode batch padded to the engine's max batch,
prefill cut into fixed segments), so the cost of invariance is measured, not guessed; and the engine's
bfloat16 serving (model/serving.py) against float32 serving of the same weights.

    python -m bench.decode_bench [--preset mini] [--batches 1,2,4,16,64] [--context 512] [--repeats 5]

Every row is the median over --repeats runs of the same shape, measured side by side in one process. Each kind
of CPU (AMX, AVX-512 without AMX, AVX2 alone) gets its own report section (its kernels take other paths).
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import report
from bench.moe_bench import median_seconds
from model import cpu_kernels
from model.config import preset
from model.paged_runner import DecodeRow, LatentPool, PagedRunner
from model.runner import _pow2
from model.sampling import SamplingParams, SamplingRow, sample_batch
from model.serving import serving_model
from model.weights import init_model

COMMAND = "python -m bench.decode_bench"
_argmax = jax.jit(lambda logits_BV: jnp.argmax(logits_BV, axis=-1))
DEFAULT_CONTEXT = 512
MODES = ("default", "invariant", "float32", "xla_view", "xla_products", "float32_attention")


def measure(args) -> dict:
    cfg = preset(args.preset)
    checkpoint = init_model(cfg)
    model = serving_model(checkpoint, "bfloat16")
    B = 64
    pages_per_seq = -(-(args.context + 1) // B)
    batches = sorted(args.batches)
    pool = LatentPool(cfg, 1 + max(batches) * pages_per_seq + -(-args.prefill // B), B)
    default = PagedRunner(model, cfg, pool)
    invariant = PagedRunner(model, cfg, pool, fixed_batch=_pow2(args.max_batch))
    float32 = PagedRunner(serving_model(checkpoint, "float32"), cfg, pool)
    xla_view = PagedRunner(model, cfg, pool, decode_kernel=False)  # decode attention over gathered views
    # products of 1-4 rows by XLA, not the few-row kernel
    xla_products = PagedRunner(serving_model(checkpoint, "bfloat16", few_row_kernel=False), cfg, pool)
    # decode attention on the kernel's float32 path (its path before the AMX one, and on CPUs without AMX), where
    # the kernel builds, even on a CPU where XLA serves
    kernel = cpu_kernels.available("cpu")[0] and cpu_kernels.supports(cfg.latent_dim, cfg.kv_lora_rank)
    float32_attention = PagedRunner(model, cfg, pool, decode_kernel=kernel or None, decode_kernel_path="float32")
    tables = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(max(batches))]
    rng = np.random.default_rng(0)
    for table in tables:  # every sequence holds a context of --context tokens
        default.prefill(rng.integers(0, cfg.vocab_size, args.context), 0, table, False)
    greedy = SamplingRow(SamplingParams(), 0, 0)
    out = {"preset": args.preset, "context": args.context, "max_batch": args.max_batch, "machine": report.machine(),
           "decode_kernel": default.decode_kernel, "few_row_kernel": model.head.lm_head.few_rows,
           "few_rows_max": cpu_kernels.few_rows_max(), "amx": cpu_kernels.decode_amx_available(),
           "cpu_kind": cpu_kernels.cpu_kind(),
           "load_average_start": os.getloadavg()[0], "decode": {}, "prefill": {}}
    for n in batches:
        rows = [DecodeRow(5, args.context, tables[i]) for i in range(n)]
        step = {}
        for name, runner in (("default", default), ("invariant", invariant), ("float32", float32),
                             ("xla_view", xla_view), ("xla_products", xla_products),
                             ("float32_attention", float32_attention)):
            step[name] = median_seconds(lambda: sample_batch(runner.decode(rows), [greedy] * n), args.repeats)
        out["decode"][str(n)] = step | {f"tokens_per_s_{name}": n / step[name] for name in MODES}
        # The host's share of a step: time until decode() has dispatched (Python before the device runs), and
        # greedy sampling of the step's logits (sample_batch's two-reduction argmax beside jnp.argmax).
        logits = jax.block_until_ready(default.decode(rows))
        out["decode"][str(n)] |= {
            "dispatch_s": median_seconds(lambda: default.decode(rows), args.repeats, wait=False),
            "greedy_s": median_seconds(lambda: sample_batch(logits, [greedy] * n).tokens, args.repeats),
            "argmax_s": median_seconds(lambda: np.asarray(_argmax(logits))[:n], args.repeats)}
        print(f"decode batch {n}: {step['default'] * 1000:.1f} ms default, {step['invariant'] * 1000:.1f} ms "
              f"invariant, {step['float32'] * 1000:.1f} ms float32, {step['xla_view'] * 1000:.1f} ms xla view, "
              f"{step['xla_products'] * 1000:.1f} ms xla products, {step['float32_attention'] * 1000:.1f} ms float32 "
              f"attention; dispatch "
              f"{out['decode'][str(n)]['dispatch_s'] * 1000:.2f} ms, greedy {out['decode'][str(n)]['greedy_s'] * 1000:.2f} "
              f"ms (jnp.argmax {out['decode'][str(n)]['argmax_s'] * 1000:.2f} ms)", flush=True)
    prompt = rng.integers(0, cfg.vocab_size, args.prefill)
    table = list(range(1 + max(batches) * pages_per_seq, pool.num_pages))

    def segments(size: int, runner: PagedRunner, keep: bool):
        def run():
            context = object() if keep else None  # the sequence, as the engine gives it (not in invariant mode)
            for start in range(0, args.prefill, size):
                end = min(args.prefill, start + size)
                last = end == args.prefill
                logits = runner.prefill(prompt[start:end], start, table, last, context, keep=keep and not last)
            np.asarray(logits)
        return run

    for name, size, runner, keep in (("solo", args.solo_tokens, default, False),
                                     ("invariant", args.step_tokens, default, False),
                                     ("kept", args.step_tokens, default, True),
                                     ("float32", args.solo_tokens, float32, False)):
        out["prefill"][name] = {"segment_tokens": size,
                                "seconds": median_seconds(segments(size, runner, keep), args.repeats)}
        print(f"prefill {args.prefill} tokens in {size}-token segments{', kept' if keep else ''}: "
              f"{out['prefill'][name]['seconds']:.2f} s", flush=True)
    out["load_average_end"] = os.getloadavg()[0]
    return out


def write(result: dict) -> None:
    rows = [[n, f"{d['default'] * 1000:.1f}", f"{d['tokens_per_s_default']:.1f}", f"{d['invariant'] * 1000:.1f}",
             f"{d['tokens_per_s_invariant']:.1f}", f"{d['invariant'] / d['default']:.2f}x",
             f"{d['float32'] * 1000:.1f}", f"{d['float32'] / d['default']:.2f}x",
             f"{d['xla_view'] * 1000:.1f}", f"{d['xla_view'] / d['default']:.2f}x",
             f"{d['xla_products'] * 1000:.1f}", f"{d['xla_products'] / d['default']:.2f}x",
             f"{d['float32_attention'] * 1000:.1f}", f"{d['float32_attention'] / d['default']:.2f}x"]
            for n, d in sorted(result["decode"].items(), key=lambda kv: int(kv[0]))]
    p = result["prefill"]
    one = result["decode"].get("1")
    scaling = [f"- decode tokens/s at batch {n} / batch 1: {d['tokens_per_s_default'] / one['tokens_per_s_default']:.2f}x "
               f"(float32 serving: {d['tokens_per_s_float32'] / one['tokens_per_s_float32']:.2f}x)"
               for n, d in sorted(result["decode"].items(), key=lambda kv: int(kv[0])) if one and n != "1"]
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.",
            f"Model `{result['preset']}`, every sequence at {result['context']} tokens of context; median of the "
            "repeats, all runners side by side in one process. Default and invariant: the engine's bfloat16 "
            "serving (model/serving.py: projections stored (out, in) in bfloat16, float32 accumulation; decode "
            "attention on bf16 latents); float32: the same weights served in float32 (`--dtype float32`). "
            f"Invariant mode pads each decode batch to {result['max_batch']} rows. Decode attention: "
            + ("the CPU kernel over the pages in place (model/cpu_kernels.py; its best path here, AMX tile products "
               "where the CPU has AMX); float32 attention: the same model with the kernel's float32 path; xla view: "
               "the same model with attention by XLA's products over gathered dense views (as on a GPU/TPU, or "
               "without a compiler)."
               if result.get("decode_kernel") else "XLA's products over gathered views (the CPU kernel was "
               "unavailable), in every column.")
            + (f" Products of 1-{result.get('few_rows_max', 4)} rows (decode batches of as many sequences): our "
               "few-row kernel (model/cpu_kernels.py); xla products: the same model with XLA's bfloat16 products "
               "there (one row computed as two)."
               if result.get("few_row_kernel") else " Products: XLA's in every column (the few-row kernel was "
               "unavailable, or does not serve on a CPU without AVX-512 or AMX)."), "",
            report.markdown_table(["batch", "default step ms", "default tok/s", "invariant step ms",
                                   "invariant tok/s", "invariant / default", "float32 step ms",
                                   "float32 / bfloat16", "xla view step ms", "xla view / default",
                                   "xla products step ms", "xla products / default",
                                   "float32 attention step ms", "float32 attention / default"], rows), "",
            f"Prefill of {result['prefill_tokens']} tokens: {p['solo']['seconds']:.2f} s in "
            f"{p['solo']['segment_tokens']}-token segments (default, nothing else running), "
            f"{p['invariant']['seconds']:.2f} s in {p['invariant']['segment_tokens']}-token segments (invariant "
            f"mode's fixed cuts): {p['invariant']['seconds'] / p['solo']['seconds']:.2f}x"
            + (f"; the same cuts keeping the expanded form's keys and values from one segment for the next (the "
               f"default mode's long prompts over gathered views: PagedRunner's `keep`): {p['kept']['seconds']:.2f} s "
               f"({p['kept']['seconds'] / p['solo']['seconds']:.2f}x)" if "kept" in p else "")
            + "; served in float32, "
            f"{p['float32']['seconds']:.2f} s in {p['float32']['segment_tokens']}-token segments "
            f"({p['float32']['seconds'] / p['solo']['seconds']:.2f}x bfloat16's).", "", *scaling]
    host = [[n, f"{d['dispatch_s'] * 1000:.2f}", f"{d['greedy_s'] * 1000:.2f}", f"{d['argmax_s'] * 1000:.2f}",
             f"{d['argmax_s'] / d['greedy_s']:.1f}x"]
            for n, d in sorted(result["decode"].items(), key=lambda kv: int(kv[0])) if "dispatch_s" in d]
    if host:
        body += ["", "The host's share of a default step: time until `decode()` has dispatched the step (Python "
                 "before the device runs), and greedy sampling of its logits: `sample_batch` (two plain reductions, "
                 "model/sampling.py `argmax_tokens`) beside `jnp.argmax` on the same logits.", "",
                 report.markdown_table(["batch", "dispatch ms", "greedy sampling ms", "jnp.argmax ms",
                                        "argmax / ours"], host)]
    body.append(f"\n![decode_bench](bench/results/{plot(result)})")
    other = "" if result["context"] == DEFAULT_CONTEXT else f", context {result['context']}"
    other += report.CPU_SECTIONS[report.cpu_kind(result)]
    report.update_section(f"Decode batching and batch invariance (decode_bench{other})", "\n".join(body))


def plot(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = sorted(int(n) for n in result["decode"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in zip(MODES, ("o-", "s--", "^:", "x-.", "d--", "v:")):
        ax.plot(ns, [result["decode"][str(n)][f"tokens_per_s_{mode}"] for n in ns], style, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences in the decode batch")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title(f"decode_bench, {result['preset']}, context {result['context']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    other = "" if result["context"] == DEFAULT_CONTEXT else f"_context{result['context']}"
    other += report.CPU_FIGURES[report.cpu_kind(result)]
    return report.save_figure(fig, f"decode_bench{other}.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="decode_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 16, 64])
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help="tokens of context of every sequence (another than the default gets its own report section)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--solo-tokens", type=int, default=2048)
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-report", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    result["prefill_tokens"] = args.prefill
    result["command"] = report.command_line(COMMAND, argv)
    report.write_json("decode_bench", result)
    if not args.no_report:
        write(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
