"""few_rows_bench: the few-row product kernel (model/kernels/few_row_product.cc) against XLA's bfloat16
product, on every projection shape of a preset's served model, at 1, 2, 4, 16 and 32 rows (decode steps of
that many sequences; the kernel takes up to 32 rows with AMX, AVX-512 or AVX2, else 4), side by side in one
process. Each kind of CPU (AMX, AVX-512 without AMX, AVX2 alone) gets its own report section (its paths differ).

    python -m bench.lab.few_rows_bench [--preset mini] [--repeats 21]

XLA's column is what `ServingLinear` ran before the kernel: one row computed as two (XLA:CPU's one-row
bfloat16 product is slower still). Each row of the table is the median over --repeats calls of one jitted
product, kernel and XLA alternating. The weights of the small shapes stay in the CPU's caches between
calls here, as they do not in a decode step, so their GB/s overstate; the LM head (265 MB on `mini`) does
not fit, and a whole decode step is in decode_bench.
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import report
from model import cpu_kernels
from model.config import preset
from model.serving import ServingLinear, serving_model
from model.weights import init_model

PATHS = {"amx": "one row: AVX-512 BF16 dot products; more: AMX tiles",
         "avx512": "one row: AVX-512 BF16 dot products; more: float32 FMAs (this CPU has no AMX)",
         "avx2": "float32 FMAs on weights widened in AVX2 registers (this CPU has no AVX-512)",
         "portable": "GCC's portable vectors"}
COMMAND = "python -m bench.lab.few_rows_bench"
ROWS = (1, 2, 4, 16, 32)


def shapes(model) -> dict[tuple[int, int], list[str]]:
    """Each distinct (out, in) bfloat16 weight shape of the served model, with the projections that have it."""
    out: dict[tuple[int, int], list[str]] = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, ServingLinear):
            name = str(path[-1])
            names = out.setdefault(tuple(module.weight[...].shape), [])
            if name not in names:
                names.append(name)
    return dict(sorted(out.items(), key=lambda kv: -kv[0][0] * kv[0][1]))


def measure(args) -> dict:
    ok, why = cpu_kernels.available("cpu")
    if not ok:
        raise SystemExit(f"few_rows_bench: the CPU kernels are unavailable ({why})")
    cfg = preset(args.preset)
    model = serving_model(init_model(cfg), "bfloat16")
    kernel = jax.jit(cpu_kernels.few_row_product)
    xla = jax.jit(lambda x, w: jnp.einsum("bi,oi->bo", (jnp.concatenate([x, x]) if x.shape[0] == 1 else x)
                                          .astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)[:x.shape[0]])
    out = {"preset": args.preset, "machine": report.machine(), "load_average_start": os.getloadavg()[0],
           "amx": cpu_kernels.decode_amx_available(), "cpu_kind": cpu_kernels.cpu_kind(), "repeats": args.repeats,
           "rows": [n for n in ROWS if n <= cpu_kernels.few_rows_max()], "products": []}
    rng = np.random.default_rng(0)
    for (O, I), names in shapes(model).items():
        w = jnp.asarray(rng.standard_normal((O, I)), jnp.bfloat16)
        for rows in [n for n in ROWS if n <= cpu_kernels.few_rows_max()]:
            x = jnp.asarray(rng.standard_normal((rows, I)), jnp.float32)
            np.testing.assert_allclose(np.asarray(kernel(x, w)), np.asarray(xla(x, w)), rtol=1e-4,
                                       atol=1e-4 * float(np.sqrt(I)))
            times = {"kernel": [], "xla": []}
            for _ in range(args.repeats):  # alternating, so both see the same machine
                for name, f in (("kernel", kernel), ("xla", xla)):
                    start = time.perf_counter()
                    jax.block_until_ready(f(x, w))
                    times[name].append(time.perf_counter() - start)
            row = {"out": O, "in": I, "names": names, "rows": rows, "bytes": O * I * 2,
                   **{name: float(np.median(t)) for name, t in times.items()}}
            out["products"].append(row)
            print(f"{O}x{I} ({', '.join(names)}), {rows} rows: kernel {row['kernel'] * 1e3:.3f} ms, "
                  f"XLA {row['xla'] * 1e3:.3f} ms ({row['xla'] / row['kernel']:.2f}x)", flush=True)
    out["load_average_end"] = os.getloadavg()[0]
    return out


def write(result: dict) -> None:
    rows = [[f"{p['out']} x {p['in']}", ", ".join(p["names"]), p["rows"], f"{p['kernel'] * 1e3:.3f}",
             f"{p['bytes'] / p['kernel'] / 1e9:.1f}", f"{p['xla'] * 1e3:.3f}", f"{p['bytes'] / p['xla'] / 1e9:.1f}",
             f"{p['xla'] / p['kernel']:.2f}x"] for p in result["products"]]
    body = [f"Command: `{result['command']}`; load average {result['load_average_start']:.1f} at the start, "
            f"{result['load_average_end']:.1f} at the end. Machine: {result['machine']}.",
            f"Every bfloat16 projection shape of `{result['preset']}` served (out, in), at "
            f"{', '.join(str(n) for n in result['rows'])} rows: our few-row kernel ({PATHS[report.cpu_kind(result)]}) "
            "against XLA's product as `ServingLinear` ran it before (one row as two). "
            "Median of "
            f"{result['repeats']} calls each, alternating. GB/s is the weight bytes over the time; the small "
            "shapes' weights stay in the CPU's caches between calls here (not in a decode step), so only the "
            "LM head's figure is a memory stream. decode_bench has whole decode steps with and without the "
            "kernel.", "",
            report.markdown_table(["shape (out x in)", "projections", "rows", "kernel ms", "kernel GB/s", "XLA ms",
                                   "XLA GB/s", "XLA / kernel"], rows)]
    body.append(f"\n![few_rows_bench](bench/results/{plot(result)})")
    where = report.CPU_SECTIONS[report.cpu_kind(result)]
    report.update_section(f"Few-row products (few_rows_bench{where})", "\n".join(body))


def plot(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    products = result["products"]
    labels = [f"{p['out']}x{p['in']}\n{p['rows']} row{'s' if p['rows'] > 1 else ''}" for p in products]
    x = np.arange(len(products))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(products)), 4))
    ax.bar(x - 0.2, [p["bytes"] / p["kernel"] / 1e9 for p in products], 0.4, label="few-row kernel")
    ax.bar(x + 0.2, [p["bytes"] / p["xla"] / 1e9 for p in products], 0.4, label="XLA bfloat16 product")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("weight GB/s")
    ax.set_title(f"few_rows_bench, {result['preset']}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return report.save_figure(fig, f"few_rows_bench{report.CPU_FIGURES[report.cpu_kind(result)]}.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="few_rows_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--repeats", type=int, default=21)
    return report.main(p, measure, write, name="few_rows_bench", command=COMMAND, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
