"""Sharded over an 8-device CPU mesh (tensor x expert), the model gives the logits and greedy tokens of
one device. The checks run in a subprocess started with XLA_FLAGS=--xla_force_host_platform_device_count=8
(this file, run as a script), so the other tests keep their single CPU device."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = {
    # name: (preset, overrides, mesh (tensor, expert))
    "tiny": ("tiny", {"param_dtype": "float32", "cache_dtype": "float32"}, (2, 4)),
    # DeepSeek-V2-Lite's structure (64 experts top-6 with softmax greedy routing, 2 shared experts,
    # 16 heads, no q LoRA, first layer dense), 2 layers, widths reduced to fit `make test`.
    "v2-lite-2-layer-reduced": ("deepseek-v2-lite", {
        "num_layers": 2, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "param_dtype": "float32", "cache_dtype": "float32"}, (4, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_model_matches_one_device(tmp_path, case):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, __file__, case, str(tmp_path)], capture_output=True, text=True,
                            timeout=600, env=env, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    # Loaded straight into shards: each device holds 1/expert of the routed experts and 1/tensor of
    # their intermediate dim, 1/tensor of the heads; the latent projection is whole everywhere.
    tensor, expert = CASES[case][2]
    E, D, I = report["routed_shape"]
    assert report["routed_shard"] == [E // expert, D, I // tensor]
    heads = report["w_uk_shape"][1]
    assert report["w_uk_shard"] == [report["w_uk_shape"][0], heads // tensor, report["w_uk_shape"][2]]
    assert report["kv_a_shard"] == report["kv_a_shape"]
    assert report["all_reduces"] > 0 and report["gathers"] == 0
    assert report["max_abs_error"] <= 1e-4 * report["logit_scale"], report
    assert report["sharded_tokens"] == report["single_tokens"]
    assert len(set(report["single_tokens"])) > 1  # not a degenerate repeat of one token


def test_bytes_per_device_follows_the_rules():
    """The README's memory table comes from this: whole model on one device, each split as RULES say."""
    import jax
    import numpy as np
    from flax import nnx

    from model.config import preset
    from model.sharding import bytes_per_device
    from model.weights import init_model
    cfg = preset("tiny")
    model = init_model(cfg)
    whole = sum(np.asarray(v).nbytes for v in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    assert bytes_per_device(cfg, 1, 1) == whole
    routed = sum(np.asarray(layer.mlp.gate_proj[...]).nbytes * 3
                 for layer in model.layers if hasattr(layer.mlp, "router"))
    # tensor=2 halves all but norms, latent projections, router and q_a; expert=4 quarters the routed experts.
    assert bytes_per_device(cfg, 1, 4) == whole - routed + routed // 4
    assert whole / 2 < bytes_per_device(cfg, 2, 1) < whole * 0.6


def _check(case: str, tmp: Path) -> dict:
    import jax
    import numpy as np

    from model.config import preset
    from model.reference import greedy_tokens, logits_jit, prompt_logits
    from model.sharding import make_mesh
    from model.weights import init_model, load_model, save_model

    name, overrides, (tensor, expert) = CASES[case]
    cfg = preset(name, **overrides)
    save_model(init_model(cfg), cfg, tmp / "model")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 24)

    single = load_model(tmp / "model").model
    mesh = make_mesh(tensor, expert)
    sharded = load_model(tmp / "model", mesh=mesh).model
    moe = sharded.layers[cfg.num_layers - 1].mlp
    attn = sharded.layers[0].attn

    def shard_shape(param) -> list[int]:
        return list(param[...].addressable_shards[0].data.shape)

    # Every collective is an all-reduce (after o_proj, down_proj, the experts' psum, the vocab-split
    # embedding): no device ever gathers another device's weights.
    from flax import nnx
    with jax.set_mesh(mesh):
        hlo = logits_jit.lower(*nnx.split(sharded), jax.numpy.asarray(tokens, "int32")).compile().as_text()
    want = prompt_logits(single, tokens)
    got = prompt_logits(sharded, tokens, mesh)
    return {"devices": len(jax.devices()), "all_reduces": hlo.count("all-reduce-start(") + hlo.count(" all-reduce("),
            "gathers": hlo.count("all-gather") + hlo.count("all-to-all"),
            "routed_shape": list(moe.gate_proj[...].shape), "routed_shard": shard_shape(moe.gate_proj),
            "w_uk_shape": list(attn.w_uk[...].shape), "w_uk_shard": shard_shape(attn.w_uk),
            "kv_a_shape": list(attn.kv_a_proj.kernel[...].shape), "kv_a_shard": shard_shape(attn.kv_a_proj.kernel),
            "max_abs_error": float(np.abs(got - want).max()), "logit_scale": float(np.abs(want).max()),
            "single_tokens": greedy_tokens(single, tokens[:8], 12),
            "sharded_tokens": greedy_tokens(sharded, tokens[:8], 12, mesh)}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(json.dumps(_check(sys.argv[1], Path(sys.argv[2]))))
