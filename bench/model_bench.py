"""Prefill and decode speed of our MLA model vs transformers' DeepseekV3ForCausalLM, same weights, same dtype.

    python -m bench.model_bench [--prompts 1024 4096] [--decode 32] [--repeats 3]

Both run on this CPU in float32: transformers builds the `mini` shapes with random weights, saves them with
`save_pretrained`, and our converter loads the very same tensors. Each number is the median of --repeats
runs after a warm-up run (which also compiles our jitted layers).
"""
from __future__ import annotations

import argparse
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


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return times


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
    rows, results = [], {"machine": machine(), "preset": args.preset, "dtype": "float32", "prefill": [], "decode": {}}

    for n in args.prompts:
        tokens = rng.integers(0, loaded.config.vocab_size, n)
        print(f"prefill {n} tokens ...", flush=True)
        ours = statistics.median(timed(lambda: runner.prefill(tokens), args.repeats))
        ids = torch.tensor(tokens)[None]
        with torch.no_grad():
            theirs = statistics.median(timed(lambda: ref(ids, use_cache=False, logits_to_keep=1), args.repeats))
        results["prefill"].append({"tokens": n, "ours_tok_s": n / ours, "transformers_tok_s": n / theirs})
        rows.append([f"prefill {n}", f"{n / ours:,.0f}", f"{n / theirs:,.0f}", f"{theirs / ours:.2f}x"])

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

    ours_decode()
    ours_s = statistics.median(ours_decode() for _ in range(args.repeats))
    theirs_decode()
    theirs_s = statistics.median(theirs_decode() for _ in range(args.repeats))
    results["decode"] = {"steps": steps, "ours_tok_s": steps / ours_s, "transformers_tok_s": steps / theirs_s}
    rows.append([f"decode (after 1K)", f"{steps / ours_s:,.1f}", f"{steps / theirs_s:,.1f}", f"{theirs_s / ours_s:.2f}x"])

    write_json("model_bench", results)
    plot(results)
    table = markdown_table(["phase", "DeepInfer tok/s", "transformers tok/s", "speed-up"], rows)
    print(table)
    update_section("Model (model_bench)", f"""Command: `python -m bench.model_bench --prompts {' '.join(map(str, args.prompts))} --decode {steps} --repeats {args.repeats}`

Machine: {results['machine']}. Preset `{args.preset}`, float32 weights and compute for both, bf16 latent cache for
DeepInfer; the same random weights (transformers' init, converted). Medians of {args.repeats} runs after a warm-up.
Goal: prefill >= 1.5x, decode >= 2x transformers.

{table}

![model bench](bench/results/model_bench.png)""")


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
