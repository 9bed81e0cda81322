"""prefill_kernel_bench: the prefill attention kernel (model/kernels/mla_prefill_attention.cc) against XLA's
attention, in-process, side by side: one layer's attention alone, and whole prefill segments of a paged
runner (the engine's model) with the kernel and without it.

    python -m bench.prefill_kernel_bench [--preset mini] [--repeats 3] [--quick]

Without the kernel the runner picks absorbed or expanded attention by its FLOP rule (`prefer_absorbed`), as it
did before the kernel; with it, attention is always absorbed. Each row is the median over --repeats runs,
kernel and XLA alternating. A segment of n tokens at context S is tokens [S - n, S) of a prompt whose first
S - n tokens are already in the pool (a hit's suffix, or a chunk of a long prompt).
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import report
from model import cpu_kernels
from model.config import preset
from model.mla import prefer_absorbed
from model.paged_runner import LatentPool, PagedRunner
from model.runner import enable_compilation_cache
from model.serving import serving_model
from model.weights import init_model

COMMAND = "python -m bench.prefill_kernel_bench"
LAYER_CASES = ((16, 2048), (64, 2048), (64, 8192), (64, 16384), (256, 8192), (1024, 8192))
SEGMENT_CASES = ((64, 8192), (256, 8192), (1024, 8192), (2048, 2048), (2048, 16384))
QUICK = ((32, 256), (64, 512))  # --quick: the same steps at small sizes (tests)


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    for f in fns.values():
        f()  # compile and warm
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def layer_attention(cfg, kernel_model, xla_model, T: int, S: int, repeats: int) -> dict:
    rng = np.random.default_rng(T + S)
    N, H, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope = jnp.asarray(rng.standard_normal((N, T, H)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((N, T, R)), jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((S, cfg.latent_dim)), jnp.bfloat16), jnp.uint16)
    positions = jnp.asarray(S - T + np.arange(T), jnp.int32)
    absorbed = prefer_absorbed(cfg, T, S)

    def attention(model, form_absorbed):
        attn = model.layers[0].attn

        def run(q_nope, q_pe, positions, bits):
            expanded = None if form_absorbed else attn.expand(bits, S, attn.w_uk.dtype)
            return attn.attend(q_nope, q_pe, positions, bits, S, expanded)
        f = jax.jit(run)
        return lambda: jax.block_until_ready(f(q_nope, q_pe, positions, bits))

    seconds = alternate({"kernel": attention(kernel_model, True), "xla": attention(xla_model, absorbed)}, repeats)
    return {"tokens": T, "context": S, "xla_form": "absorbed" if absorbed else "expanded", **seconds}


def segments(cfg, kernel_model, xla_model, cases, repeats: int) -> list[dict]:
    longest = max(S for _, S in cases)
    pool = LatentPool(cfg, longest // 64 + 8, 64)
    runners = {"kernel": PagedRunner(kernel_model, cfg, pool), "absorbed": PagedRunner(kernel_model, cfg, pool),
               "xla": PagedRunner(xla_model, cfg, pool)}
    runners["absorbed"].dense.attention = "absorbed"  # the kernel's absorbed form whatever the FLOP rule says
    pages = list(range(1, longest // 64 + 2))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, longest)
    filled = 0
    out = []
    for n, S in sorted(cases, key=lambda c: c[1]):
        while filled < S - n:  # the context before the segment, once, by the kernel's runner
            end = min(S - n, filled + 2048)
            jax.block_until_ready(runners["kernel"].prefill(tokens[filled:end], filled, pages, False))
            filled = end
        fns = {name: (lambda r=r: jax.block_until_ready(r.prefill(tokens[S - n:S], S - n, pages, True)))
               for name, r in runners.items()}
        seconds = alternate(fns, repeats)
        form = "absorbed" if runners["kernel"].prefill_absorbed(n, S) else "expanded"
        out.append({"tokens": n, "context": S, "kernel_form": form,
                    "xla_form": "absorbed" if prefer_absorbed(cfg, n, S) else "expanded", **seconds})
        print(f"segment {n} tokens at {S}: kernel ({form}) {seconds['kernel'] * 1e3:.0f} ms, kernel absorbed "
              f"{seconds['absorbed'] * 1e3:.0f} ms, XLA {seconds['xla'] * 1e3:.0f} ms "
              f"({seconds['xla'] / seconds['kernel']:.2f}x)", flush=True)
        filled = max(filled, S)  # the segment's own tokens are in the pool now too
    return out


def measure(args) -> dict:
    if not cpu_kernels.prefill_attention_available():
        raise SystemExit("prefill_kernel_bench: the prefill attention kernel is unavailable here (it needs AMX)")
    enable_compilation_cache()
    cfg = preset(args.preset)
    checkpoint = init_model(cfg)
    kernel_model = serving_model(checkpoint, "bfloat16")
    xla_model = serving_model(checkpoint, "bfloat16", prefill_kernel=False)
    if not kernel_model.layers[0].attn.prefill_kernel:
        raise SystemExit(f"prefill_kernel_bench: the kernel does not take {args.preset}'s latent widths")
    out = {"preset": args.preset, "machine": report.machine(), "load_average_start": os.getloadavg()[0],
           "repeats": args.repeats, "layer": [], "segments": []}
    for T, S in QUICK if args.quick else LAYER_CASES:
        row = layer_attention(cfg, kernel_model, xla_model, T, S, args.repeats)
        out["layer"].append(row)
        print(f"one layer's attention, {T} tokens at {S}: kernel {row['kernel'] * 1e3:.2f} ms, XLA ({row['xla_form']}) "
              f"{row['xla'] * 1e3:.2f} ms ({row['xla'] / row['kernel']:.2f}x)", flush=True)
    out["segments"] = segments(cfg, kernel_model, xla_model, QUICK if args.quick else SEGMENT_CASES, args.repeats)
    out["load_average_end"] = os.getloadavg()[0]
    return out


def write(result: dict) -> None:
    layer = [[r["tokens"], r["context"], f"{r['kernel'] * 1e3:.2f}", f"{r['xla'] * 1e3:.2f}", r["xla_form"],
              f"{r['xla'] / r['kernel']:.2f}x"] for r in result["layer"]]
    segs = [[r["tokens"], r["context"], r["kernel_form"], f"{r['kernel'] * 1e3:.0f}", f"{r['absorbed'] * 1e3:.0f}",
             f"{r['absorbed'] / r['kernel']:.2f}x", f"{r['xla'] * 1e3:.0f}", r["xla_form"],
             f"{r['xla'] / r['kernel']:.2f}x"] for r in result["segments"]]
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.",
            f"Model `{result['preset']}` served in bfloat16, in-process; median of {result['repeats']} runs each, "
            "kernel and XLA alternating. Kernel: attention by our AMX flash-attention kernel: one layer's, always the "
            "absorbed form (the dense runner's); a paged runner's segment, the form its FLOP rule picks (the "
            "expanded one computes each head's keys and values from the pages on the tiles), beside the kernel's "
            "absorbed form alone. XLA: the same model without it, in the form the runner picks by its FLOP rule.", "",
            "One layer's attention (queries to output projection; the expanded form includes expanding K and V):", "",
            report.markdown_table(["tokens", "context", "kernel ms", "XLA ms", "XLA form", "XLA / kernel"], layer),
            "", "A paged runner's prefill segment (the whole model, 8 layers, logits of the last token):", "",
            report.markdown_table(["tokens", "context", "kernel form", "kernel ms", "absorbed kernel ms",
                                   "absorbed / kernel", "XLA ms", "XLA form", "XLA / kernel"], segs)]
    body.append(f"\n![prefill_kernel_bench](bench/results/{plot(result)})")
    report.update_section("Prefill attention kernel (prefill_kernel_bench)", "\n".join(body))


def plot(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    segs = result["segments"]
    x = np.arange(len(segs))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x - 0.2, [r["kernel"] * 1e3 for r in segs], 0.4, label="prefill attention kernel")
    ax.bar(x + 0.2, [r["xla"] * 1e3 for r in segs], 0.4, label="XLA (absorbed or expanded)")
    ax.set_xticks(x, [f"{r['tokens']} tok\nat {r['context']}" for r in segs], fontsize=8)
    ax.set_ylabel("prefill segment ms")
    ax.set_yscale("log")
    ax.set_title(f"prefill_kernel_bench, {result['preset']}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return report.save_figure(fig, "prefill_kernel_bench.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_kernel_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small cases only (tests)")
    p.add_argument("--no-report", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    result["command"] = report.command_line(COMMAND, argv)
    report.write_json("prefill_kernel_bench", result)
    if not args.no_report:
        write(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
