"""decode_bench: one model step of the runner (model/runner.py), in-process: decode batches and prefill segments,
in the default mode and in batch-invariant mode (every decode batch padded to the engine's max batch,
prefill cut into fixed segments), so the cost of invariance is measured, not guessed; the engine's
bfloat16 serving (model/serving.py) against float32 serving of the same weights; and the same model over other
attention backends and options (model/attention/).

    python -m bench.lab.decode_bench [--preset mini] [--batches 1,2,4,16,64] [--context 512] [--repeats 5]

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
from bench.lab.moe_bench import median_seconds
from model import cpu_kernels
from model.attention import make_backend
from model.config import preset
from model.latent_pool import LatentPool, pow2
from model.runner import DecodeRow, Runner, Segment
from model.sampling import SamplingParams, SamplingRow, sample_batch
from model.serving import serving_model
from model.weights import init_model

COMMAND = "python -m bench.lab.decode_bench"
_argmax = jax.jit(lambda logits_BV: jnp.argmax(logits_BV, axis=-1))
DEFAULT_CONTEXT = 512
MODES = ("default", "invariant", "float32", "xla_attention", "xla_products", "float32_attention")


def backend(cfg, dtype: str, page: int, **cpu_options):
    """The backend the engine picks on this CPU for a model served at `dtype`; where that is the cpu backend,
    with `cpu_options` (kernels named on or off)."""
    chosen = make_backend("auto", cfg, "cpu", dtype, page_tokens=page)
    if chosen.name != "cpu" or not cpu_options:
        return chosen
    return make_backend("cpu", cfg, "cpu", dtype, page_tokens=page, **cpu_options)


def measure(args) -> dict:
    cfg = preset(args.preset)
    checkpoint = init_model(cfg)
    model = serving_model(checkpoint, "bfloat16")
    B = 64
    pages_per_seq = -(-(args.context + 1) // B)
    batches = sorted(args.batches)
    pool = LatentPool(cfg, 1 + max(batches) * pages_per_seq + -(-args.prefill // B), B)
    default = Runner(model, cfg, pool, backend(cfg, "bfloat16", B))
    invariant = Runner(model, cfg, pool, backend(cfg, "bfloat16", B), fixed_batch=pow2(args.max_batch))
    float32 = Runner(serving_model(checkpoint, "float32"), cfg, pool, backend(cfg, "float32", B))
    # decode attention by the xla backend: each sequence's pages read through its table a key block at a time
    xla_attention = Runner(model, cfg, pool, make_backend("xla", cfg, "cpu", "bfloat16", page_tokens=B))
    # products of 1-4 rows by XLA, not the few-row kernel: the model's projections and attention's W_UK / W_UV
    xla_products = Runner(serving_model(checkpoint, "bfloat16", few_row_kernel=False), cfg, pool,
                          backend(cfg, "bfloat16", B, few_rows=False))
    # decode attention on the kernel's float32 path (its path before the AMX one, and on CPUs without AMX), where
    # the kernel builds, even on a CPU where XLA serves
    kernel = cpu_kernels.available("cpu")[0] and cpu_kernels.supports(cfg.latent_dim, cfg.kv_lora_rank)
    float32_attention = Runner(model, cfg, pool, make_backend("cpu", cfg, "cpu", "bfloat16", page_tokens=B,
                                                              decode_kernel=True, decode_path="float32")
                               if kernel else backend(cfg, "bfloat16", B))
    tables = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(max(batches))]
    rng = np.random.default_rng(0)
    for table in tables:  # every sequence holds a context of --context tokens
        default.prefill([Segment(rng.integers(0, cfg.vocab_size, args.context), 0, table)], want_logits=False).run()
    greedy = SamplingRow(SamplingParams(), 0, 0)
    out = {"preset": args.preset, "context": args.context, "max_batch": args.max_batch, "machine": report.machine(),
           "backend": default.backend.name, "decode_kernel": getattr(default.backend, "decode_kernel", False),
           "few_row_kernel": model.head.lm_head.few_rows,
           "few_rows_max": cpu_kernels.few_rows_max(), "amx": cpu_kernels.decode_amx_available(),
           "cpu_kind": cpu_kernels.cpu_kind(), "float32_attention_kernel": kernel,
           "load_average_start": os.getloadavg()[0], "decode": {}, "prefill": {}}
    runners = dict(zip(MODES, (default, invariant, float32, xla_attention, xla_products, float32_attention)))
    for n in batches:
        rows = [DecodeRow(5, args.context, tables[i]) for i in range(n)]
        step = {}
        for name, runner in runners.items():
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
              f"invariant, {step['float32'] * 1000:.1f} ms float32, {step['xla_attention'] * 1000:.1f} ms xla "
              f"attention, {step['xla_products'] * 1000:.1f} ms xla products, "
              f"{step['float32_attention'] * 1000:.1f} ms float32 attention; dispatch "
              f"{out['decode'][str(n)]['dispatch_s'] * 1000:.2f} ms, greedy "
              f"{out['decode'][str(n)]['greedy_s'] * 1000:.2f} ms (jnp.argmax "
              f"{out['decode'][str(n)]['argmax_s'] * 1000:.2f} ms)", flush=True)
    prompt = rng.integers(0, cfg.vocab_size, args.prefill)
    table = list(range(1 + max(batches) * pages_per_seq, pool.num_pages))

    def segments(size: int, runner: Runner):
        def run():
            for start in range(0, args.prefill, size):
                end = min(args.prefill, start + size)
                logits = runner.prefill([Segment(prompt[start:end], start, table)],
                                        want_logits=end == args.prefill).run()
            np.asarray(logits)
        return run

    for name, size, runner in (("solo", args.solo_tokens, default), ("invariant", args.step_tokens, default),
                               ("float32", args.solo_tokens, float32)):
        out["prefill"][name] = {"segment_tokens": size, "seconds": median_seconds(segments(size, runner), args.repeats)}
        print(f"prefill {args.prefill} tokens in {size}-token segments ({name}): "
              f"{out['prefill'][name]['seconds']:.2f} s", flush=True)
    out["load_average_end"] = os.getloadavg()[0]
    return out


def write(result: dict) -> None:
    rows = [[n, f"{d['default'] * 1000:.1f}", f"{d['tokens_per_s_default']:.1f}", f"{d['invariant'] * 1000:.1f}",
             f"{d['tokens_per_s_invariant']:.1f}", f"{d['invariant'] / d['default']:.2f}x",
             f"{d['float32'] * 1000:.1f}", f"{d['float32'] / d['default']:.2f}x",
             f"{d['xla_attention'] * 1000:.1f}", f"{d['xla_attention'] / d['default']:.2f}x",
             f"{d['xla_products'] * 1000:.1f}", f"{d['xla_products'] / d['default']:.2f}x",
             f"{d['float32_attention'] * 1000:.1f}", f"{d['float32_attention'] / d['default']:.2f}x"]
            for n, d in sorted(result["decode"].items(), key=lambda kv: int(kv[0]))]
    p = result["prefill"]
    one = result["decode"].get("1")
    scaling = [f"- decode tokens/s at batch {n} / batch 1: "
               f"{d['tokens_per_s_default'] / one['tokens_per_s_default']:.2f}x (float32 serving: "
               f"{d['tokens_per_s_float32'] / one['tokens_per_s_float32']:.2f}x)"
               for n, d in sorted(result["decode"].items(), key=lambda kv: int(kv[0])) if one and n != "1"]
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.",
            f"Model `{result['preset']}`, every sequence at {result['context']} tokens of context; median of the "
            "repeats, all runners side by side in one process. Default and invariant: the engine's bfloat16 "
            "serving (model/serving.py: projections stored (out, in) in bfloat16, float32 accumulation; decode "
            "attention on bf16 latents); float32: the same weights served in float32 (`--dtype float32`). "
            f"Invariant mode pads each decode batch to {result['max_batch']} rows. Decode attention: "
            + ("the cpu backend's kernel reading the pages in place (model/attention/cpu.py; its best path here, "
               "AMX tile products where the CPU has AMX); float32 attention: the same model with the kernel's "
               "float32 path; xla attention: the same model over the xla backend (model/attention/xla.py: each "
               "sequence's pages read through its table a key block at a time, as on a GPU/TPU)."
               if result.get("decode_kernel") else "the xla backend's (each sequence's pages read through its "
               "table a key block at a time; the CPU kernel does not serve here) in every column but float32 "
               "attention, " + ("the kernel's float32 path." if result.get("float32_attention_kernel")
                                else "the same (the kernel does not build here)."))
            + (f" Products of 1-{result.get('few_rows_max', 4)} rows (decode batches of as many sequences): our "
               "few-row kernel (model/cpu_kernels.py), the projections' and attention's W_UK / W_UV; xla "
               "products: the same model with XLA's products there (the projections' in bfloat16, one row "
               "computed as two; W_UK / W_UV in float32)."
               if result.get("few_row_kernel") else " Products: XLA's in every column (the few-row kernel was "
               "unavailable, or does not serve on a CPU without AVX-512 or AMX)."), "",
            report.markdown_table(["batch", "default step ms", "default tok/s", "invariant step ms",
                                   "invariant tok/s", "invariant / default", "float32 step ms",
                                   "float32 / bfloat16", "xla attention step ms", "xla attention / default",
                                   "xla products step ms", "xla products / default",
                                   "float32 attention step ms", "float32 attention / default"], rows), "",
            f"Prefill of {result['prefill_tokens']} tokens: {p['solo']['seconds']:.2f} s in "
            f"{p['solo']['segment_tokens']}-token segments (default, nothing else running), "
            f"{p['invariant']['seconds']:.2f} s in {p['invariant']['segment_tokens']}-token segments (invariant "
            f"mode's fixed cuts): {p['invariant']['seconds'] / p['solo']['seconds']:.2f}x; served in float32, "
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
    return report.main(p, lambda args: {**measure(args), "prefill_tokens": args.prefill}, write, name="decode_bench",
                       command=COMMAND, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
