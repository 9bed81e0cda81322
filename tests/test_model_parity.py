"""Our JAX model equals transformers' DeepseekV3ForCausalLM and DeepseekV2ForCausalLM on the same (converted)
random weights: V3 routes sigmoid scores (noaux_tc), V2 softmax scores (greedy or group-limited greedy)."""
import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from model import reference
from model.attention import make_backend
from model.convert import convert
from model.latent_pool import LatentPool
from model.runner import DecodeRow, Runner, Segment
from model.weights import load_model

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
            max_position_embeddings=2048, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)
V3, V2 = (DeepseekV3Config, DeepseekV3ForCausalLM), (DeepseekV2Config, DeepseekV2ForCausalLM)
CASES = {
    "q_lora+yarn+moe": (V3, dict(q_lora_rank=24, rope_parameters=YARN)),
    "no_q_lora+yarn+moe": (V3, dict(q_lora_rank=None, rope_parameters=YARN)),
    "q_lora+plain_rope+moe_no_groups": (V3, dict(q_lora_rank=24, n_group=1, topk_group=1, num_experts_per_tok=3,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # V2: softmax scores, no score correction bias, routing weights scaled but never renormalised.
    "v2:greedy+q_lora+yarn": (V2, dict(q_lora_rank=24, topk_method="greedy", n_group=1, topk_group=1,
                                       rope_parameters=YARN)),
    "v2:group_limited_greedy+no_q_lora+yarn": (V2, dict(q_lora_rank=None, topk_method="group_limited_greedy",
                                                        n_group=4, topk_group=2, num_experts_per_tok=3,
                                                        rope_parameters=YARN)),
}


def _reference(tmp_path, case: str):
    torch.manual_seed(sum(map(ord, case)))
    (config_class, model_class), overrides = CASES[case]
    hf_cfg = config_class(**(BASE | overrides), attn_implementation="eager")
    ref = model_class(hf_cfg).float().eval()
    with torch.no_grad():  # random norms and router bias, sharp attention: a mis-mapped tensor cannot hide
        for name, param in ref.named_parameters():
            if "self_attn" in name and "proj" in name:
                param.mul_(8.0)
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
        for module in ref.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(0.1 * torch.randn_like(module.e_score_correction_bias))
    ref.save_pretrained(tmp_path / "hf")
    return ref


@pytest.mark.parametrize("backend", ["cpu", "xla"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, case, backend):
    ref = _reference(tmp_path, case)
    convert(tmp_path / "hf", tmp_path / "ours", progress=False)
    loaded = load_model(tmp_path / "ours", cache_dtype="float32")
    cfg, table = loaded.config, list(range(1, 6))

    def runner(key_block: int | None = None) -> Runner:
        options = {} if key_block is None else {"key_block": key_block}
        return Runner(loaded.model, cfg, LatentPool(cfg, 8, 16), make_backend(backend, cfg, "cpu", "float32",
                                                                               page_tokens=16, **options),
                      chunk_tokens=16)

    tokens = np.random.default_rng(1).integers(0, BASE["vocab_size"], 48)
    with torch.no_grad():
        ref_logits = ref(torch.tensor(tokens)[None]).logits[0].numpy()  # (T, V)
    scale = np.abs(ref_logits).max()
    # The reference forward (one pass, no cache) at every position ...
    assert np.abs(reference.prompt_logits(loaded.model, tokens) - ref_logits).max() <= 1e-4 * scale

    # ... every position through our pages: token by token (the decode path) ...
    run = runner()
    for pos, token in enumerate(tokens):
        step = np.asarray(run.decode([DecodeRow(int(token), pos, table)]))[0]
        assert np.abs(step - ref_logits[pos]).max() <= 1e-4 * scale, f"position {pos}"
    # ... and the whole prompt in chunks (the prefill path).
    run = runner()
    logits = np.asarray(run.prefill([Segment(tokens, 0, table)]).run())[0]
    assert np.abs(logits - ref_logits[-1]).max() <= 1e-4 * scale
    # Blockwise attention (16-row key blocks, so 2-3 blocks a chunk) over a prefix computed before.
    blockwise = runner(key_block=16)
    blockwise.prefill([Segment(tokens[:20], 0, table)], want_logits=False).run()
    suffix = np.asarray(blockwise.prefill([Segment(tokens[20:], 20, table)]).run())[0]
    assert np.abs(suffix - ref_logits[-1]).max() <= 1e-4 * scale

    with torch.no_grad():
        ref_out = ref.generate(torch.tensor(tokens)[None], max_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(tokens):].tolist()
    ours = [int(np.argmax(logits))]
    while len(ours) < 32:
        step = run.decode([DecodeRow(ours[-1], len(tokens) + len(ours) - 1, table)])
        ours.append(int(np.argmax(np.asarray(step)[0])))
    assert ours == ref_out
