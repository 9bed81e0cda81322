"""ttft_bench, the do-it-yourself alternative: transformers' DeepseekV3ForCausalLM on CPU (float32, sdpa),
a miss prefilled from scratch, a hit as torch.load of the prefix's DynamicCache + prefill of the suffix.

The model is built from a preset (`hf_config`) with random weights; our converter turns the very same tensors
into the model directory the stack serves, so both sides run identical weights.
"""
from __future__ import annotations

import gc
import os
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from bench.ttft_client import FIRST_ID, LAST_ID
from model.config import preset as preset_config

HEADROOM_BYTES = 2 << 30  # left free for the rest of the machine when deciding whether a length fits


def hf_config(name: str):
    """transformers' DeepseekV3Config of our preset `name`: every layer dense, yarn rope."""
    from transformers import DeepseekV3Config

    cfg = preset_config(name)
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


class DiyTimes(NamedTuple):
    """Seconds for one repeat at one prompt length."""
    miss_s: float  # forward over the whole prompt, use_cache=True (the cache a server would keep)
    save_s: float  # torch.save of the prefix's DynamicCache (prompt minus the suffix)
    cold_hit_s: float  # page cache dropped: torch.load + forward of the suffix over the loaded cache
    warm_hit_s: float  # the same with the file in the page cache
    load_cold_s: float  # the torch.load part of cold_hit_s
    cache_file_bytes: int


def build_same_weights(preset: str, workdir: Path) -> tuple[torch.nn.Module, Path]:
    """transformers' model with random weights (seed 0) and our converted copy of it; (model, model_dir)."""
    from transformers import DeepseekV3ForCausalLM

    from model.convert import convert

    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(hf_config(preset)).float().eval()
    hf.save_pretrained(workdir / "hf")
    convert(workdir / "hf", workdir / "ours", name=preset, progress=False)
    return hf, workdir / "ours"


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def estimated_peak_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Peak memory of a from-scratch prefill: weights, the float32 K/V cache and, dominating at long
    prompts, the (heads, T, T) float32 attention scores that CPU sdpa materialises (scores, softmax,
    mask: ~3 of them). Measured on this machine: +1.4 GiB at 4K against 1.6 GiB estimated."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_per_token = cfg.num_hidden_layers * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    activations = tokens * max(cfg.intermediate_size, cfg.hidden_size * 4) * 4 * 3
    return weights_bytes(model) + tokens * kv_per_token + 3 * heads * tokens * tokens * 4 + activations


def available_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def fits(model: torch.nn.Module, tokens: int) -> tuple[bool, int]:
    """(whether a `tokens` prefill fits in today's free memory, its estimated peak bytes)."""
    # The weights are already resident, so only the increment has to fit.
    need = estimated_peak_bytes(model, tokens)
    return need - weights_bytes(model) + HEADROOM_BYTES < available_bytes(), need


def measure(model: torch.nn.Module, tokens: int, suffix: int, cache_path: Path,
            drop_caches: Callable[[], bool], rng: np.random.Generator) -> DiyTimes:
    """One repeat: miss over a fresh prompt of `tokens`, then hits over its first tokens - suffix."""
    ids = torch.from_numpy(rng.integers(FIRST_ID, LAST_ID, (1, tokens)))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        begin = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        miss_s = time.perf_counter() - begin
        cache = out.past_key_values
        cache.crop(-suffix)  # this transformers crops by a negative count of tokens to drop
        assert cache.get_seq_length() == tokens - suffix
        begin = time.perf_counter()
        with open(cache_path, "wb") as file:
            torch.save(cache, file)
            file.flush()
            os.fsync(file.fileno())  # durable, as our saves are; only this file (os.sync would flush everyone's)
        save_s = time.perf_counter() - begin
        del out, cache
        gc.collect()

        def hit() -> tuple[float, float]:
            fresh = torch.from_numpy(rng.integers(FIRST_ID, LAST_ID, (1, suffix)))
            begin = time.perf_counter()
            loaded = torch.load(cache_path, weights_only=False)
            load_s = time.perf_counter() - begin
            out = model(fresh, past_key_values=loaded, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            return time.perf_counter() - begin, load_s

        drop_caches()
        cold_s, load_cold_s = hit()
        warm_s, _ = hit()
    size = cache_path.stat().st_size
    cache_path.unlink()
    return DiyTimes(miss_s, save_s, cold_s, warm_s, load_cold_s, size)
