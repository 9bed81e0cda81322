"""The streaming converter: a synthetic checkpoint laid out as DeepSeek publishes theirs (per-expert
tensors, FP8 block-scaled projections, several files) converts with peak memory bounded by its
largest tensor, not by its total size, and gives the same tensors and digest as the loaded model."""
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

FP8_TILE = 128
HF_CONFIG = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=16384, hidden_size=1024,
    intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=4096, dtype="bfloat16",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _hf_tensors(c: dict) -> dict[str, tuple]:
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


def _write_checkpoint(root: Path, files: int = 3) -> dict:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    rng = np.random.default_rng(0)
    names = list(_hf_tensors(HF_CONFIG).items())
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
    return _hf_tensors(HF_CONFIG)


def test_converter_streams_with_memory_bounded_by_the_largest_tensor(tmp_path):
    tensors = _write_checkpoint(tmp_path / "hf")
    total = sum(os.path.getsize(f) for f in (tmp_path / "hf").glob("*.safetensors"))
    largest = max(int(np.prod(shape)) * 2 for shape, _ in tensors.values())  # bf16 bytes
    result = subprocess.run([sys.executable, __file__, str(tmp_path / "hf"), str(tmp_path / "ours")],
                            capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "convert" in result.stderr  # the progress bar
    assert total > 350 << 20 and largest == 32 << 20
    # The largest tensor (lm_head, transposed) is held twice (as read, and transposed), plus
    # tensorstore's buffers: 160 MiB against the checkpoint's 376 MiB.
    bound = 2 * largest + (96 << 20)
    assert report["peak_growth"] <= bound, (report, bound)

    from model.convert import SafetensorsDir
    from model.weights import load_model, weights_digest
    loaded = load_model(tmp_path / "ours")
    assert loaded.weights_digest == report["digest"] == weights_digest(loaded.model)
    hf = SafetensorsDir(tmp_path / "hf")
    moe = loaded.model.layers[2].mlp
    np.testing.assert_array_equal(np.asarray(moe.up_proj[...][37]), hf.get("model.layers.2.mlp.experts.37.up_proj.weight").T)
    q_b = hf.get("model.layers.3.self_attn.q_b_proj.weight").T.astype(ml_dtypes.bfloat16)  # FP8, dequantised
    np.testing.assert_array_equal(np.asarray(loaded.model.layers[3].attn.q_b_proj.kernel[...]), q_b)


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
    converted = convert(sys.argv[1], sys.argv[2])
    seconds = time.perf_counter() - begin
    done.set()
    sampler.join()
    print(json.dumps({"baseline": baseline, "peak_growth": max(peak[0], _rss_bytes()) - baseline,
                      "seconds": seconds, "digest": converted.weights_digest}))
