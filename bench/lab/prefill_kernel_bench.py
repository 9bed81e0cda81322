"""prefill_kernel_bench: the prefill attention kernel (model/kernels/mla_prefill_attention.cc) against XLA's
attention, in-process, side by side: one layer's attention alone, and whole prefill segments of the runner (the
engine's model) over the cpu backend with the kernel and over the xla backend.

    python -m bench.lab.prefill_kernel_bench [--preset mini] [--repeats 3] [--quick]

Over the xla backend the runner picks absorbed or expanded attention by its FLOP rule (`prefer_absorbed`); the cpu
backend with the kernel picks between the kernel's two forms by the same rule, and runs beside its absorbed form
alone. Each row is the median over --repeats runs, kernel and XLA alternating. A segment of n tokens at context S
is tokens [S - n, S) of a prompt whose first S - n tokens are already in the pool (a hit's suffix, or a chunk of a
long prompt). Runs only where the kernel is available (AMX).
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
from model.attention import make_backend
from model.config import preset
from model.latent_pool import LatentPool
from model.runner import Runner, Segment, enable_compilation_cache, view_bucket
from model.serving import serving_model
from model.weights import init_model

COMMAND = "python -m bench.lab.prefill_kernel_bench"
LAYER_CASES = ((16, 2048), (64, 2048), (64, 8192), (64, 16384), (256, 8192), (1024, 8192))
SEGMENT_CASES = ((64, 8192), (256, 8192), (1024, 8192), (2048, 2048), (2048, 16384))
QUICK = ((32, 256), (64, 512))  # --quick: the same steps at small sizes (tests)
PAGE = 64  # tokens per page: the kernel reads pages of whole 64-row steps


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


def form_name(backend, n: int, S: int, choice: str = "auto") -> str:
    """"absorbed" or "expanded": the form `backend` gives a segment of n tokens ending at S."""
    return "absorbed" if backend.prefill_form(n, view_bucket(S, PAGE), choice).name in ("absorbed", "pages") \
        else "expanded"


def layer_attention(cfg, model, kernel, xla, T: int, S: int, repeats: int) -> dict:
    """One layer's attention of T queries at positions [S - T, S) over S rows of random latents in S / PAGE pages:
    the backend's context for the layer, then the chunk's attention (queries to per-head values)."""
    rng = np.random.default_rng(T + S)
    N, H, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope_NTH = jnp.asarray(rng.standard_normal((N, T, H)), jnp.bfloat16)
    q_pe_NTR = jnp.asarray(rng.standard_normal((N, T, R)), jnp.bfloat16)
    latents_SA = jnp.asarray(rng.standard_normal((S, cfg.latent_dim)), jnp.bfloat16)
    pool_PBA = jax.lax.bitcast_convert_type(latents_SA, jnp.uint16).reshape(S // PAGE, PAGE, cfg.latent_dim)
    tables_MQ = jnp.arange(S // PAGE, dtype=jnp.int32)[None]  # (1, pages): one tile's table
    positions_MT = jnp.asarray(S - T + np.arange(T), jnp.int32)[None]
    end = jnp.asarray(S, jnp.int32)
    attn = model.layers[0].attn
    xla_form = xla.prefill_form(T, view_bucket(S, PAGE)).name

    def attention(backend, form: str):
        def run(q_nope_NTH, q_pe_NTR, positions_MT, pool_PBA, tables_MQ, end):
            context = backend.prefill_context(attn, pool_PBA, tables_MQ, end, form,
                                              backend.context_buffer(form, S, None))
            return backend.prefill_attend(attn, q_nope_NTH, q_pe_NTR, positions_MT, pool_PBA, tables_MQ, context,
                                          form)
        f = jax.jit(run)
        return lambda: jax.block_until_ready(f(q_nope_NTH, q_pe_NTR, positions_MT, pool_PBA, tables_MQ, end))

    # the kernel's absorbed form ("pages": reading the pages in place)
    kernel_form = kernel.prefill_form(T, view_bucket(S, PAGE), "absorbed").name
    seconds = alternate({"kernel": attention(kernel, kernel_form), "xla": attention(xla, xla_form)}, repeats)
    return {"tokens": T, "context": S, "xla_form": xla_form, **seconds}


def segments(cfg, model, kernel, xla, cases, repeats: int) -> list[dict]:
    longest = max(S for _, S in cases)
    pool = LatentPool(cfg, longest // PAGE + 8, PAGE)
    runners = {"kernel": Runner(model, cfg, pool, kernel),
               "absorbed": Runner(model, cfg, pool, kernel, form="absorbed"),  # the kernel's absorbed form alone
               "xla": Runner(model, cfg, pool, xla)}
    pages = list(range(1, longest // PAGE + 2))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, longest)
    filled = 0
    out = []
    for n, S in sorted(cases, key=lambda c: c[1]):
        while filled < S - n:  # the context before the segment, once, by the kernel's runner
            end = min(S - n, filled + 2048)
            jax.block_until_ready(runners["kernel"].prefill([Segment(tokens[filled:end], filled, pages)],
                                                            want_logits=False).run())
            filled = end
        fns = {name: (lambda r=r: jax.block_until_ready(r.prefill([Segment(tokens[S - n:S], S - n, pages)]).run()))
               for name, r in runners.items()}
        seconds = alternate(fns, repeats)
        form = form_name(kernel, n, S)
        out.append({"tokens": n, "context": S, "kernel_form": form, "xla_form": form_name(xla, n, S), **seconds})
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
    if not cpu_kernels.prefill_attention_supports(cfg.latent_dim, cfg.kv_lora_rank):
        raise SystemExit(f"prefill_kernel_bench: the kernel does not take {args.preset}'s latent widths")
    model = serving_model(init_model(cfg), "bfloat16")
    kernel = make_backend("cpu", cfg, "cpu", "bfloat16", page_tokens=PAGE, prefill_kernel=True)
    xla = make_backend("xla", cfg, "cpu", "bfloat16", page_tokens=PAGE)
    out = {"preset": args.preset, "machine": report.machine(), "load_average_start": os.getloadavg()[0],
           "repeats": args.repeats, "layers": cfg.num_layers, "layer": [], "segments": []}
    for T, S in QUICK if args.quick else LAYER_CASES:
        row = layer_attention(cfg, model, kernel, xla, T, S, args.repeats)
        out["layer"].append(row)
        print(f"one layer's attention, {T} tokens at {S}: kernel {row['kernel'] * 1e3:.2f} ms, XLA ({row['xla_form']}) "
              f"{row['xla'] * 1e3:.2f} ms ({row['xla'] / row['kernel']:.2f}x)", flush=True)
    out["segments"] = segments(cfg, model, kernel, xla, QUICK if args.quick else SEGMENT_CASES, args.repeats)
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
            "kernel and XLA alternating. Kernel: attention by the cpu backend with our AMX flash-attention kernel "
            "reading the pages in place: one layer's, the absorbed form; a runner's segment, the form its FLOP rule "
            "picks (the expanded one computes each head's keys and values from the pages on the tiles), beside the "
            "kernel's absorbed form alone. XLA: the same model over the xla backend (each layer's pages gathered "
            "into a view), in the form its FLOP rule picks.", "",
            "One layer's attention (queries to per-head values; the expanded form includes expanding K and V):", "",
            report.markdown_table(["tokens", "context", "kernel ms", "XLA ms", "XLA form", "XLA / kernel"], layer),
            "", f"A runner's prefill segment (the whole model, {result.get('layers', 8)} layers, logits of the last "
            "token):", "",
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
    return report.main(p, measure, write, name="prefill_kernel_bench", command=COMMAND, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
