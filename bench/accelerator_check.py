"""One prepared check for a lent accelerator (or the CPU): routed MoE, parity with transformers, the
mesh, and prefill speed of a DeepSeek-V2-Lite-shaped model, in one run that writes JSON.

    python -m bench.accelerator_check [--layers 2] [--prefill 4096 16384] [--out DIR] [--report]
    python -m bench.accelerator_check --small          # CPU-sized shapes (what tests/ runs)

Needs only what the GPU image has (jax, flax, orbax, tensorstore, numpy, torch, transformers) and
this repository; reaches no registry. Weights are drawn with jax.random on the device. Sections run
in order; each records its numbers, or its error, and the run goes on; the exit status is 1 if any
section failed. --budget-s stops starting sections once that many seconds have passed.
  devices   backend, device kinds and count
  moe       one V2-Lite-shaped MoE layer's routed experts: routed (this backend's choice), tiles,
            ragged_dot and every expert (max error, ms/token)
  parity    DeepseekV2ForCausalLM (transformers, float32) vs ours on the same converted weights:
            max logit error / logit scale and 32 greedy tokens
  sharded   with more than one device: a (tensor, expert) mesh over all of them vs one device
  prefill   tokens/s of a --layers-layer V2-Lite-shaped model (Runner.prefill over a LatentPool, the
            engine's attention backend for this platform), per length
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.moe_bench import median_seconds
from bench.report import OUT, machine, markdown_table, update_section
from model.config import preset

PATHS = ("routed", "tiles", "ragged_dot", "all_experts")  # the MoE section's columns
# The V2-Lite structure with every width cut down, for --small.
SMALL = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
         "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


def check_devices(args) -> dict:
    return {"backend": jax.default_backend(), "count": len(jax.devices()),
            "kinds": sorted({d.device_kind for d in jax.devices()}), "host": machine()}


def check_moe(args) -> dict:
    from model.experts import all_experts, routed_experts

    cfg = preset("deepseek-v2-lite", **(SMALL if args.small else {}))
    E, K, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    keys = jax.random.split(jax.random.key(0), 4)
    gate, up = (jax.random.normal(k, (E, D, I), jnp.float32).astype(args.dtype) * 0.02 for k in keys[:2])
    down = jax.random.normal(keys[2], (E, I, D), jnp.float32).astype(args.dtype) * 0.02
    # "routed" is what the model runs on this backend; tiles and ragged_dot are timed apart so that a
    # ragged_dot lowering that expands to dense matmuls shows up next to the tiles.
    paths = {"routed": jax.jit(routed_experts), "tiles": jax.jit(partial(routed_experts, method="tiles")),
             "ragged_dot": jax.jit(partial(routed_experts, method="ragged_dot")), "all_experts": jax.jit(all_experts)}
    rows = []
    for T in (1, 16, 512):
        x_TD = jax.random.normal(jax.random.fold_in(keys[3], T), (T, D), jnp.float32).astype(args.dtype)
        ids_TK = jnp.argsort(jax.random.uniform(jax.random.fold_in(keys[3], 1000 + T), (T, E)), axis=1)[:, :K]
        weights_TK = jnp.full((T, K), 1.0 / K, jnp.float32)
        inputs = (x_TD, weights_TK, ids_TK, gate, up, down)
        want = paths["all_experts"](*inputs).astype(jnp.float32)
        row = {"tokens": T, "max_error_over_scale": max(
            float(jnp.abs(paths[name](*inputs).astype(jnp.float32) - want).max() / jnp.abs(want).max())
            for name in ("routed", "tiles", "ragged_dot"))}
        for name, fn in paths.items():
            row[f"{name}_ms_per_token"] = 1e3 * median_seconds(lambda fn=fn: fn(*inputs), args.repeats) / T
        rows.append(row)
    worst = max(r["max_error_over_scale"] for r in rows)
    tolerance = 1e-5 if args.dtype == "float32" else 2e-2
    return {"ok": worst <= tolerance, "dtype": args.dtype, "rows": rows}


def check_parity(args) -> dict:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from model.convert import convert
    from model.reference import greedy_tokens, prompt_logits
    from model.weights import load_model

    torch.manual_seed(0)
    hf_cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=2048, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.0, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                         "rope_theta": 10000.0})
    ref = DeepseekV2ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "self_attn" in name and "proj" in name:
                param.mul_(8.0)
    tokens = np.random.default_rng(1).integers(0, hf_cfg.vocab_size, 48)
    with tempfile.TemporaryDirectory() as tmp, jax.default_matmul_precision("highest"):
        ref.save_pretrained(f"{tmp}/hf")
        convert(f"{tmp}/hf", f"{tmp}/ours", progress=False, param_dtype="float32")
        loaded = load_model(f"{tmp}/ours", cache_dtype="float32")
        ours = prompt_logits(loaded.model, tokens)
        our_tokens = greedy_tokens(loaded.model, tokens, 32)
    with torch.no_grad():
        want = ref(torch.tensor(tokens)[None]).logits[0].numpy()
        ref_tokens = ref.generate(torch.tensor(tokens)[None], max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(tokens):].tolist()
    error = float(np.abs(ours - want).max() / np.abs(want).max())
    return {"ok": error <= 1e-4 and our_tokens == ref_tokens, "max_error_over_scale": error,
            "greedy_tokens_equal": our_tokens == ref_tokens}


def check_sharded(args) -> dict:
    from model.reference import greedy_tokens, prompt_logits
    from model.sharding import make_mesh, shard_model
    from model.weights import init_on_device

    count = len(jax.devices())
    if count < 2:
        return {"ok": True, "skipped": "one device"}
    tensor = 2 if count % 2 == 0 else 1  # heads over 2, experts over the rest
    mesh = make_mesh(tensor, count // tensor)
    cfg = preset("deepseek-v2-lite", num_layers=2, param_dtype="float32", cache_dtype="float32",
                 **(SMALL if args.small else {}))
    model = init_on_device(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 64)
    with jax.default_matmul_precision("highest"):
        want = prompt_logits(model, tokens)
        want_tokens = greedy_tokens(model, tokens[:16], 8)
        sharded = shard_model(model, mesh)
        got = prompt_logits(sharded, tokens, mesh)
        got_tokens = greedy_tokens(sharded, tokens[:16], 8, mesh)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    return {"ok": error <= 1e-4 and got_tokens == want_tokens, "mesh": {"tensor": tensor, "expert": count // tensor},
            "max_error_over_scale": error, "greedy_tokens_equal": got_tokens == want_tokens}


def check_prefill(args) -> dict:
    from model.attention import make_backend
    from model.latent_pool import LatentPool
    from model.runner import Runner, Segment
    from model.weights import init_on_device

    cfg = preset("deepseek-v2-lite", num_layers=args.layers, param_dtype=args.dtype,
                 **(SMALL if args.small else {}))
    model = init_on_device(cfg)
    page = 64
    pages = list(range(1, 1 + -(-max(args.prefill) // page)))  # one sequence's pages, reused by every length
    backend = make_backend("auto", cfg, jax.default_backend(), args.dtype, page_tokens=page)
    runner = Runner(model, cfg, LatentPool(cfg, 1 + len(pages), page), backend)
    rows = []
    for n in args.prefill:
        segment = Segment(np.random.default_rng(n).integers(0, cfg.vocab_size, n), 0, pages)
        seconds = median_seconds(lambda segment=segment: runner.prefill([segment]).run(), args.repeats)
        rows.append({"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds})
    return {"ok": True, "layers": args.layers, "dtype": args.dtype, "backend": backend.name, "rows": rows}


SECTIONS = {"devices": check_devices, "moe": check_moe, "parity": check_parity, "sharded": check_sharded,
            "prefill": check_prefill}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="V2-Lite structure at reduced widths (CPU tests)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, float32 on the CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--out", default=str(OUT), help="directory for accelerator_check.json")
    parser.add_argument("--report", action="store_true", help="write the BENCHMARKS.md section")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")

    begin, results = time.perf_counter(), {}
    for name in args.sections:
        if time.perf_counter() - begin > args.budget_s:
            results[name] = {"ok": False, "error": f"not started: past --budget-s {args.budget_s}"}
            continue
        start = time.perf_counter()
        try:
            results[name] = SECTIONS[name](args)
        except Exception:  # a failed section is recorded, and the next one still runs
            results[name] = {"ok": False, "error": traceback.format_exc(limit=4)}
        results[name]["seconds"] = time.perf_counter() - start
        print(name, json.dumps(results[name]), flush=True)
    results["command"] = " ".join(sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accelerator_check.json").write_text(json.dumps(results, indent=2))
    if args.report:
        write_section(results)
    return 0 if all(r.get("ok", True) for k, r in results.items() if isinstance(r, dict)) else 1


def write_section(results: dict) -> None:
    devices = results.get("devices", {})
    lines = [f"Command: `python -m bench.accelerator_check {results['command']}`", "",
             f"Backend `{devices.get('backend')}`, {devices.get('count')} x {', '.join(devices.get('kinds', []))}; "
             f"host: {devices.get('host')}.", ""]
    moe = results.get("moe", {})
    if moe.get("rows"):
        lines += [f"Routed MoE ({moe['dtype']}, V2-Lite-shaped layer):", "", markdown_table(
            ["tokens", "routed ms/token", "tiles", "ragged_dot", "all experts", "max error / scale"],
            [[r["tokens"], *(f"{r[f'{name}_ms_per_token']:.3f}" for name in PATHS),
              f"{r['max_error_over_scale']:.1e}"] for r in moe["rows"]]), ""]
    for name in ("parity", "sharded"):
        r = results.get(name, {})
        if "max_error_over_scale" in r:
            lines.append(f"{name}: max logit error / scale {r['max_error_over_scale']:.1e}, "
                         f"greedy tokens equal: {r['greedy_tokens_equal']}.")
    prefill = results.get("prefill", {})
    if prefill.get("rows"):
        lines += ["", f"Prefill, {prefill['layers']}-layer V2-Lite-shaped model, {prefill['dtype']} "
                  f"(Runner.prefill, {prefill.get('backend', 'xla')} attention backend, median):", "", markdown_table(
                      ["prompt tokens", "seconds", "tokens/s"],
                      [[r["tokens"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}"] for r in prefill["rows"]])]
    failed = [k for k, r in results.items() if isinstance(r, dict) and r.get("ok") is False]
    if failed:
        lines += ["", "Failed sections: " + ", ".join(failed) + " (errors in the JSON)."]
    update_section("Accelerator check (accelerator_check)", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
