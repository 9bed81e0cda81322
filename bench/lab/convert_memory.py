"""Peak host memory of converting a checkpoint: a synthetic one laid out as DeepSeek publishes V3
(per-expert tensors, FP8 block-scaled attention projections, several safetensors files).

    python -m bench.lab.convert_memory [--layers 4] [--experts 64] [--dir DIR]

Writes the checkpoint, converts it in a child process that samples its own RSS every 5 ms, and
reports the peak RSS above the RSS just before `convert` against the checkpoint's size and its
largest tensor. Writes bench/out/convert_memory.json and BENCHMARKS.md's "Converter memory" section.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from bench.report import ROOT, machine, markdown_table, update_section, write_json

FP8_TILE = 128
HF_CONFIG = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=16384, hidden_size=1024,
    intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=4096, dtype="bfloat16",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def hf_tensors(c: dict) -> dict[str, tuple]:
    """HF name -> (shape, "BF16" | "FP8") of every tensor of DeepSeek-V3's published layout."""
    D, N, C, R = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    H, V, Q, I = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"], c["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": ((c["vocab_size"], D), "BF16"), "model.norm.weight": ((D,), "BF16"),
           "lm_head.weight": ((c["vocab_size"], D), "BF16")}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": ((D,), "BF16"), p + "post_attention_layernorm.weight": ((D,), "BF16"),
                p + "self_attn.q_a_proj.weight": ((Q, D), "FP8"), p + "self_attn.q_a_layernorm.weight": ((Q,), "BF16"),
                p + "self_attn.q_b_proj.weight": ((N * (H + R), Q), "FP8"),
                p + "self_attn.kv_a_proj_with_mqa.weight": ((C + R, D), "FP8"),
                p + "self_attn.kv_a_layernorm.weight": ((C,), "BF16"),
                p + "self_attn.kv_b_proj.weight": ((N * (H + V), C), "FP8"),
                p + "self_attn.o_proj.weight": ((D, N * V), "FP8")}
        if i < c["first_k_dense_replace"]:
            out |= {p + f"mlp.{w}.weight": (s, "BF16") for w, s in (
                ("gate_proj", (c["intermediate_size"], D)), ("up_proj", (c["intermediate_size"], D)),
                ("down_proj", (D, c["intermediate_size"])))}
            continue
        out |= {p + "mlp.gate.weight": ((c["n_routed_experts"], D), "BF16"),
                p + "mlp.gate.e_score_correction_bias": ((c["n_routed_experts"],), "BF16")}
        for e in [f"experts.{e}" for e in range(c["n_routed_experts"])] + ["shared_experts"]:
            out |= {p + f"mlp.{e}.{w}.weight": (s, "BF16") for w, s in (
                ("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I)))}
    return out


def write_checkpoint(root: Path, config: dict = HF_CONFIG, files: int = 3) -> dict:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    names = list(hf_tensors(config).items())
    per_file = -(-len(names) // files)
    for f in range(files):
        header, blobs, offset = {}, [], 0
        for name, (shape, kind) in names[f * per_file:(f + 1) * per_file]:
            values = rng.standard_normal(shape, np.float32) * 0.02
            if kind == "FP8":
                tiles = tuple(-(-n // FP8_TILE) for n in shape)
                parts = {name: (values * 100).astype(ml_dtypes.float8_e4m3fn),
                         name + "_scale_inv": rng.uniform(0.005, 0.02, tiles).astype(np.float32)}
            else:
                parts = {name: values.astype(ml_dtypes.bfloat16)}
            for part, array in parts.items():
                raw = np.ascontiguousarray(array).tobytes()
                dtype = {"float8_e4m3fn": "F8_E4M3", "bfloat16": "BF16", "float32": "F32"}[array.dtype.name]
                header[part] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
                blobs.append(raw)
                offset += len(raw)
        head = json.dumps(header).encode()
        with open(root / f"model-{f:05d}-of-{files:05d}.safetensors", "wb") as out:
            out.write(struct.pack("<Q", len(head)) + head)
            for blob in blobs:
                out.write(blob)
    return hf_tensors(config)


def measure(hf_dir: Path, out_dir: Path) -> dict:
    """Converts in a child process; its peak RSS growth, seconds and the weights digest."""
    result = subprocess.run([sys.executable, "-m", "bench.lab.convert_memory", "--child", str(hf_dir), str(out_dir)],
                            capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"conversion failed: {result.stderr[-4000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["progress_shown"] = "convert" in result.stderr
    return report


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def _child(hf_dir: str, out_dir: str) -> None:
    import jax

    from model.convert import convert

    jax.devices()
    baseline, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    begin = time.perf_counter()
    converted = convert(hf_dir, out_dir)
    seconds = time.perf_counter() - begin
    done.set()
    sampler.join()
    print(json.dumps({"baseline": baseline, "peak_growth": max(peak[0], _rss_bytes()) - baseline,
                      "seconds": seconds, "digest": converted.weights_digest}))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=HF_CONFIG["num_hidden_layers"])
    parser.add_argument("--experts", type=int, default=HF_CONFIG["n_routed_experts"])
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    config = HF_CONFIG | {"num_hidden_layers": args.layers, "n_routed_experts": args.experts}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tensors = write_checkpoint(Path(tmp) / "hf", config)
        size = sum(os.path.getsize(f) for f in (Path(tmp) / "hf").glob("*.safetensors"))
        report = measure(Path(tmp) / "hf", Path(tmp) / "ours")
    largest = max(int(np.prod(shape)) * 2 for shape, _ in tensors.values())
    results = {"machine": machine(), "checkpoint_bytes": size, "largest_tensor_bf16_bytes": largest,
               "tensors": len(tensors), "layers": args.layers, "experts": args.experts, **report}
    write_json("convert_memory", results)
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    table = markdown_table(["checkpoint", "tensors", "largest tensor (bf16)", "peak RSS growth", "seconds"],
                           [[mib(size), len(tensors), mib(largest), mib(report["peak_growth"]),
                             f"{report['seconds']:.1f}"]])
    print(table)
    command = f"python -m bench.lab.convert_memory --layers {args.layers} --experts {args.experts}"
    update_section("Converter memory (convert_memory)", f"""Command: `{command}`

Machine: {results['machine']}. A synthetic checkpoint in DeepSeek-V3's published layout ({args.layers} layers,
{args.experts} routed experts as per-expert tensors, FP8 block-scaled attention projections, bf16 elsewhere, 3
files) converted by `deepinfer model convert`'s code in a child process that samples its RSS every 5 ms;
peak growth is above the RSS just before the conversion.

{table}""")


if __name__ == "__main__":
    main()
