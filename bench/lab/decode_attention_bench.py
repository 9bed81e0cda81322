"""decode_attention_bench: the decode attention kernel's paths (model/kernels/paged_mla_decode.cc) side by side,
one layer of a preset's widths (mini's by default), in-process: float32 (each page widened, FMAs) and AMX
(tile products), over sequences whose pages are spread through the pool, as in the engine. On a CPU with AVX2
alone, float32 (its AVX2 intrinsics) beside "portable" (the same source built with GCC's portable vectors).

    python -m bench.lab.decode_attention_bench [--repeats 30] [--quick]

Each row is the median over --repeats calls, the paths alternating; a call is one layer's attention for every
sequence of the batch (what a decode step runs once per layer). GB/s is the pages' bytes over that time.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import report
from bench.lab.prefill_kernel_bench import alternate
from model import cpu_kernels
from model.config import preset

COMMAND = "python -m bench.lab.decode_attention_bench"
CASES = ((1, 512), (16, 512), (64, 512), (1, 4096), (4, 4096), (16, 4096))  # (sequences, context)
QUICK = ((1, 128), (4, 256))
PAGE = 64


PORTABLE_TARGET = "deepinfer_paged_mla_decode_portable"


def available_paths(cfg) -> list[str]:
    """The kernel's paths for these widths on this machine: on a CPU with AVX2 alone, "portable" (GCC's vectors,
    the float32 path before its AVX2 one) beside float32; AMX where Linux granted it."""
    portable = ["portable"] * (cpu_kernels.cpu_kind() == "avx2")
    if cfg.latent_dim % 32 or cfg.kv_lora_rank % 32:
        return portable + ["float32"]
    return portable + ["float32"] + ["amx"] * cpu_kernels.decode_amx_available()


def register_portable() -> None:
    """The same kernel source built with -DDEEPINFER_DECODE_PORTABLE (its float32 path in GCC's portable vectors),
    registered beside ours for one process."""
    library = Path(tempfile.mkdtemp(prefix="decode-portable-")) / "portable.so"
    subprocess.run(["g++", *cpu_kernels.FLAGS, "-DDEEPINFER_DECODE_PORTABLE", f"-I{jax.ffi.include_dir()}",
                    str(cpu_kernels.SOURCES[0]), "-o", str(library)], check=True, capture_output=True, text=True)
    kernel = ctypes.cdll.LoadLibrary(str(library)).PagedMlaDecode
    jax.ffi.register_ffi_target(PORTABLE_TARGET, jax.ffi.pycapsule(kernel), platform="cpu")


def measure_case(cfg, B: int, context: int, paths: list[str], repeats: int) -> dict:
    rng = np.random.default_rng(B * context)
    Q = context // PAGE
    P = 1 + B * Q
    pool = jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((P, PAGE, cfg.latent_dim)), jnp.bfloat16),
                                        jnp.uint16)
    tables = jnp.asarray(1 + rng.permutation(B * Q).reshape(B, Q), jnp.int32)  # pages spread through the pool
    q = jnp.asarray(jnp.asarray(rng.standard_normal((B, cfg.num_heads, cfg.latent_dim)), jnp.bfloat16), jnp.float32)
    fresh = jnp.asarray(jnp.asarray(rng.standard_normal((B, cfg.latent_dim)), jnp.bfloat16), jnp.float32)
    lengths = jnp.full((B,), context - 1, jnp.int32)
    scale = float(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5

    def call(path):
        fn = jax.jit(lambda *a: cpu_kernels.paged_mla_decode(*a, scale, cfg.kv_lora_rank, path))
        if path == "portable":
            shape = jax.ShapeDtypeStruct((B, cfg.num_heads, cfg.kv_lora_rank), jnp.float32)
            fn = jax.jit(lambda *a: jax.ffi.ffi_call(PORTABLE_TARGET, shape)(
                *a, scale=np.float32(scale), path=np.int32(cpu_kernels.DECODE_PATHS["float32"])))
        return lambda: jax.block_until_ready(fn(q, pool, tables, lengths, fresh))

    seconds = alternate({path: call(path) for path in paths}, repeats)
    page_bytes = B * context * cfg.latent_dim * 2
    row = {"sequences": B, "context": context, "seconds": seconds,
           "gb_per_s": {path: page_bytes / t / 1e9 for path, t in seconds.items()}}
    print(f"{B} x {context}: " + ", ".join(f"{path} {t * 1e3:.3f} ms" for path, t in seconds.items()), flush=True)
    return row


def measure(args) -> dict:
    cfg = preset(args.preset)
    paths = available_paths(cfg)
    if "portable" in paths:
        register_portable()
    return {"preset": args.preset, "cpu_kind": cpu_kernels.cpu_kind(), "heads": cfg.num_heads,
            "latent_dim": cfg.latent_dim, "value_dim": cfg.kv_lora_rank,
            "paths": paths, "machine": report.machine(), "repeats": args.repeats,
            "load_average_start": os.getloadavg()[0],
            "cases": [measure_case(cfg, B, S, paths, args.repeats) for B, S in (QUICK if args.quick else CASES)],
            "load_average_end": os.getloadavg()[0]}


def write(result: dict) -> None:
    paths = result["paths"]
    best = paths[-1]
    rows = [[c["sequences"], c["context"], *(f"{c['seconds'][p] * 1e3:.3f}" for p in paths),
             *(f"{c['seconds'][paths[0]] / c['seconds'][p]:.2f}x" for p in paths[1:]), f"{c['gb_per_s'][best]:.1f}"]
            for c in result["cases"]]
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.",
            f"One layer of `{result['preset']}`'s decode attention ({result['heads']} heads over "
            f"{result['latent_dim']}-wide latents, values {result['value_dim']} wide) for every sequence of the batch, "
            "each on its own pages of 64 tokens, spread through the pool; "
            f"median of {result['repeats']} calls, the paths alternating. float32: each page widened, FMAs (the "
            "kernel before the AMX path, and its path on CPUs without AMX; on a CPU with AVX2 alone, 4 heads at a "
            "time in AVX2 intrinsics); portable: the same float32 path in GCC's portable vectors of 16 floats "
            "(the kernel before its AVX2 path); amx: tile products (the engine's path where the CPU has AMX). "
            f"Speed-up: over {paths[0]}.", "",
            report.markdown_table(["sequences", "context", *(f"{p} ms" for p in paths),
                                   *(f"{p} speed-up" for p in paths[1:]), f"{best} GB/s of pages"], rows)]
    body.append(f"\n![decode_attention_bench](bench/results/{plot(result)})")
    where = report.CPU_SECTIONS[report.cpu_kind(result)]
    report.update_section(f"Decode attention paths (decode_attention_bench{where})", "\n".join(body))


def plot(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = result["cases"]
    labels = [f"{c['sequences']}x{c['context']}" for c in cases]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(result["paths"])
    for i, path in enumerate(result["paths"]):
        ax.bar(np.arange(len(cases)) + i * width, [c["seconds"][path] * 1e3 for c in cases], width, label=path)
    ax.set_xticks(np.arange(len(cases)) + width * (len(result["paths"]) - 1) / 2, labels)
    ax.set_xlabel("sequences x context (tokens)")
    ax.set_ylabel("ms per layer")
    ax.set_title(f"decode attention paths, {result['preset']}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return report.save_figure(fig, f"decode_attention_bench{report.CPU_FIGURES[report.cpu_kind(result)]}.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="decode_attention_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="small cases (tests)")
    ok, why = cpu_kernels.available("cpu")
    if not ok:
        raise SystemExit(f"the CPU kernels are unavailable here: {why}")
    return report.main(p, measure, write, name="decode_attention_bench", command=COMMAND, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
