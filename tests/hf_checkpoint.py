"""The smallest transformers DeepSeek-V3 checkpoint (one dense layer, vocabulary 256, seed 0): what
converter tests feed model/convert.py."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def save_small_v3_checkpoint(directory: Path) -> None:
    torch.manual_seed(0)
    hf_cfg = DeepseekV3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_routed_experts=0,
                              first_k_dense_replace=1, max_position_embeddings=512)
    DeepseekV3ForCausalLM(hf_cfg).save_pretrained(directory)
