"""Routed experts vs every expert on every token, on a DeepSeek-V2-Lite-shaped MoE layer.

    python -m bench.lab.moe_bench [--tokens 1 16 512] [--top-k-sweep 1 2 6] [--sweep-tokens 2048] [--repeats 3]

V2-Lite's routed experts at their real widths (64 experts, top-6, hidden 2048, expert intermediate
1408) with random weights and random routes (each token picks 6 distinct experts, uniformly). Three
ways to compute the same thing, each jitted, warmed up, then timed --repeats times (median):
- routed: `model.experts.routed_experts` as the model runs it on this backend (tiles on the CPU);
- ragged_dot: the same dispatch with `jax.lax.ragged_dot` as the grouped matmul (XLA's lowering);
- all experts: every expert on every token, weighted zero where unrouted (the code this replaced).
The top-k sweep runs the routed path at --sweep-tokens tokens with 1, 2, 6 experts per token: enough
token copies per expert that the matmuls, not reading each expert's weights once, take the time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import RESULTS, machine, markdown_table, update_section, write_json
from model.config import preset
from model.experts import all_experts, routed_experts


def median_seconds(fn, repeats: int, wait: bool = True) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up; with wait=False until fn returns (what
    it dispatched runs on, and is waited for before the next call)."""
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        out = fn()
        if wait:
            jax.block_until_ready(out)
        times.append(time.perf_counter() - begin)
        jax.block_until_ready(out)
    return statistics.median(times)


def routes(rng: np.random.Generator, T: int, K: int, E: int) -> tuple[jax.Array, jax.Array]:
    ids_TK = np.argsort(rng.random((T, E)), axis=1)[:, :K]  # K distinct experts per token
    return jnp.asarray(rng.random((T, K)) / K, jnp.float32), jnp.asarray(ids_TK, jnp.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--top-k-sweep", type=int, nargs="*", default=[1, 2, 6])
    parser.add_argument("--sweep-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="the weights' and activations' dtype")
    parser.add_argument("--skip-ragged-above", type=int, default=16,
                        help="tokens above which the ragged_dot path is not timed (it costs as much as all experts)")
    args = parser.parse_args()

    cfg = preset("deepseek-v2-lite")
    E, K, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    key = jax.random.key(0)  # weights drawn on the device, not in numpy
    k1, k2, k3 = jax.random.split(key, 3)
    gate_EDI = (jax.random.normal(k1, (E, D, I), jnp.float32) * 0.02).astype(args.dtype)
    up_EDI = (jax.random.normal(k2, (E, D, I), jnp.float32) * 0.02).astype(args.dtype)
    down_EID = (jax.random.normal(k3, (E, I, D), jnp.float32) * 0.02).astype(args.dtype)
    routed = jax.jit(routed_experts)
    ragged = jax.jit(partial(routed_experts, method="ragged_dot"))
    dense = jax.jit(all_experts)
    rng = np.random.default_rng(0)
    results = {"machine": machine(), "backend": jax.default_backend(), "dtype": args.dtype,
               "shape": {"experts": E, "top_k": K, "hidden": D, "intermediate": I}, "rows": [], "top_k_sweep": [],
               "load_average": [os.getloadavg()[0]]}

    for T in args.tokens:
        x_TD = jax.random.normal(jax.random.fold_in(key, T), (T, D), jnp.float32).astype(args.dtype)
        weights_TK, ids_TK = routes(rng, T, K, E)
        experts = (gate_EDI, up_EDI, down_EID)
        got, want = routed(x_TD, weights_TK, ids_TK, *experts), dense(x_TD, weights_TK, ids_TK, *experts)
        error = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        print(f"{T} tokens: max |routed - all experts| = {error:.2e} (scale {scale:.2e})", flush=True)
        row = {"tokens": T, "max_abs_error": error, "output_scale": scale}
        row["routed_s"] = median_seconds(lambda: routed(x_TD, weights_TK, ids_TK, *experts), args.repeats)
        if T <= args.skip_ragged_above:
            row["ragged_dot_s"] = median_seconds(lambda: ragged(x_TD, weights_TK, ids_TK, *experts), args.repeats)
        row["all_experts_s"] = median_seconds(lambda: dense(x_TD, weights_TK, ids_TK, *experts), args.repeats)
        print(row, flush=True)
        results["rows"].append(row)

    T = args.sweep_tokens
    x_TD = jax.random.normal(jax.random.fold_in(key, T), (T, D), jnp.float32).astype(args.dtype)
    for k in args.top_k_sweep:
        weights_TK, ids_TK = routes(rng, T, k, E)
        seconds = median_seconds(lambda: routed(x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID), args.repeats)
        results["top_k_sweep"].append({"tokens": T, "top_k": k, "routed_s": seconds})
        print(results["top_k_sweep"][-1], flush=True)

    results["load_average"].append(os.getloadavg()[0])
    results["command"] = {"tokens": args.tokens, "top_k_sweep": args.top_k_sweep, "sweep_tokens": T,
                          "repeats": args.repeats,
                          "dtype": args.dtype, "skip_ragged_above": args.skip_ragged_above}
    write_json("moe_bench", results)
    plot(results)
    write_section(results)


def ms_per_token(seconds: float | None, tokens: int) -> str:
    return "-" if seconds is None else f"{1e3 * seconds / tokens:,.2f}"


def write_section(results: dict) -> None:
    command = results["command"]
    rows = [[r["tokens"], ms_per_token(r["routed_s"], r["tokens"]), ms_per_token(r.get("ragged_dot_s"), r["tokens"]),
             ms_per_token(r["all_experts_s"], r["tokens"]), f"{r['all_experts_s'] / r['routed_s']:.1f}x",
             f"{r['max_abs_error'] / r['output_scale']:.1e}"] for r in results["rows"]]
    table = markdown_table(["tokens", "routed ms/token", "ragged_dot ms/token", "all experts ms/token",
                            "all experts / routed", "max error / scale"], rows)
    sweep = results["top_k_sweep"]
    base = next((s for s in sweep if s["top_k"] == max(x["top_k"] for x in sweep)), None)
    sweep_table = markdown_table(
        ["tokens", "top-k", "routed ms/token", f"time / time at top-{base['top_k'] if base else '-'}"],
        [[s["tokens"], s["top_k"], ms_per_token(s["routed_s"], s["tokens"]),
          f"{s['routed_s'] / base['routed_s']:.2f}" if base else "-"] for s in sweep])
    shape = results["shape"]
    flags = (f"--tokens {' '.join(map(str, command['tokens']))}"
             f" --top-k-sweep {' '.join(map(str, command['top_k_sweep']))}"
             f" --sweep-tokens {command['sweep_tokens']} --repeats {command['repeats']} --dtype {command['dtype']}")
    update_section("Routed MoE (moe_bench)", f"""Command: `python -m bench.lab.moe_bench {flags}`

Machine: {results['machine']}; JAX backend `{results['backend']}`. One DeepSeek-V2-Lite-shaped MoE layer's routed
experts ({shape['experts']} experts, top-{shape['top_k']}, hidden {shape['hidden']}, expert intermediate
{shape['intermediate']}), random {results['dtype']} weights, random routes (distinct experts per token). Median of
{command['repeats']} timed runs after a warm-up. "routed" is `model.experts.routed_experts` as the model runs it on
this backend; "ragged_dot" is the same dispatch with `jax.lax.ragged_dot` as the grouped matmul; "all experts" is
every expert on every token (the code it replaced). "-": not timed (ragged_dot above
{command['skip_ragged_above']} tokens). 1-minute load average {results['load_average'][0]:.1f} at the start,
{results['load_average'][1]:.1f} at the end (this machine is shared).

{table}

Routed time at {command['sweep_tokens']} tokens with fewer experts per token (same {shape['experts']} experts):

{sweep_table}

![moe bench](bench/results/moe_bench.png)""")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("routed_s", "routed"), ("ragged_dot_s", "ragged_dot (XLA lowering)"),
                        ("all_experts_s", "all experts")):
        points = [(r["tokens"], 1e3 * r[name] / r["tokens"]) for r in rows if name in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("ms per token (log)")
    ax.set_title(f"V2-Lite-shaped MoE layer, {results['dtype']}, {results['backend']}")
    ax.legend()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(RESULTS / "moe_bench.png", dpi=120)


if __name__ == "__main__":
    main()
