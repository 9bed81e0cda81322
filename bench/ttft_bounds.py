"""What a TTFT hit is held against, all measured or counted in the run that reports it:

physical bound  max(prefix bytes / read bandwidth, suffix FLOPs / matmul peak): what no implementation on this
                machine can beat. FLOPs are counted from the model config for the suffix's prefill over a cached
                prefix (projections, attention, MLP or MoE of each layer, the LM head for the one token sampled)
                in both MLA forms, and the cheaper counts:
                  expanded  c_kv up-projected (kv_b) into per-head keys and values for every token, then
                            ordinary attention over qk_head_dim / v_head_dim;
                  absorbed  kv_b folded into the query and the output (W_UK into q_nope, W_UV after attention),
                            attention on the 576-dim latent, the prefix never expanded.
                A multiply-add is 2 FLOPs; causal: suffix token i attends to prefix + i + 1 tokens. The read
                bandwidth is the raw device's (O_DIRECT) for a prefix on disk, a memcpy's for one in RAM.
in-process      max(prefix bytes / raw device, the suffix computed by our own Runner in this process with the
                prefix's latents already in its pool): what serving adds on top of the model code.
transformers    the do-it-yourself alternative: DeepseekV3ForCausalLM on the CPU (float32, sdpa), a miss
                prefilled from scratch, a hit as torch.load of the prefix's DynamicCache + prefill of the suffix,
                on the very weights the stack serves (our converter turns the same tensors into its model dir).
"""
from __future__ import annotations

import gc
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from bench.kv_bench import dd_read_gbps, parallel_direct_read_gbps
from bench.stack import FIRST_ID, LAST_ID
from model.config import ModelConfig
from model.config import preset as preset_config

if TYPE_CHECKING:
    import torch

PAGE = 64  # tokens per page: the engine's block
HEADROOM_BYTES = 2 << 30  # left free for the rest of the machine when deciding whether a transformers run fits


# -- the physical bound --

class SuffixFlops(NamedTuple):
    """FLOPs of one suffix prefill over a cached prefix, per MLA form."""
    absorbed: float
    expanded: float

    @property
    def cheaper(self) -> float:
        return min(self.absorbed, self.expanded)

    @property
    def form(self) -> str:
        return "absorbed" if self.absorbed <= self.expanded else "expanded"


def suffix_flops(cfg: ModelConfig, prefix: int, suffix: int) -> SuffixFlops:
    """FLOPs to prefill `suffix` tokens after `prefix` cached tokens and sample one token."""
    d, h, s = cfg.hidden_size, cfg.num_heads, suffix
    nope, rope, v, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    attended = s * prefix + s * (s + 1) // 2  # (query, key) pairs, causal within the suffix
    q_proj = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * (nope + rope)) if cfg.q_lora_rank else d * h * (nope + rope)
    shared = s * (q_proj + d * cfg.latent_dim + h * v * d)  # q, kv_a (c_kv + k_pe), o_proj: per suffix token
    expanded = (shared + (prefix + s) * lora * h * (nope + v)  # kv_b over every token's c_kv
                + attended * h * (nope + rope + v))  # q.k and p.v per head
    absorbed = (shared + s * h * nope * lora + s * h * lora * v  # W_UK into q, W_UV after attention
                + attended * h * (cfg.latent_dim + lora))  # q.[c_kv|k_pe] and p.c_kv per head
    mlp = 0
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            mlp += s * (d * cfg.n_routed_experts  # router
                        + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * d * cfg.moe_intermediate_size)
        else:
            mlp += s * 3 * d * cfg.intermediate_size  # SwiGLU: gate, up, down
    head = d * cfg.vocab_size  # logits of the last token only
    return SuffixFlops(2.0 * (cfg.num_layers * absorbed + mlp + head),
                       2.0 * (cfg.num_layers * expanded + mlp + head))


class MatmulPeak(NamedTuple):
    """GFLOP/s of a large jitted jnp matmul (float32 accumulation), best of the repeats (a peak), per input dtype."""
    size: int  # (size, size) @ (size, size)
    float32_gflops: float
    bfloat16_gflops: float

    @property
    def gflops(self) -> float:
        """The faster dtype: the bound may not assume the model runs slower than the machine can."""
        return max(self.float32_gflops, self.bfloat16_gflops)


def matmul_peak(size: int = 2048, repeats: int = 5) -> MatmulPeak:
    import jax
    import jax.numpy as jnp

    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        a = jax.random.normal(jax.random.key(0), (size, size), dtype)
        b = jax.random.normal(jax.random.key(1), (size, size), dtype)
        # float32 accumulation, as the engine's products run: a bfloat16 product that rounds its output
        # to bfloat16 takes a slower path on XLA:CPU (281 vs ~1,200 GFLOP/s measured here).
        matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
        matmul(a, b).block_until_ready()  # compile
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            matmul(a, b).block_until_ready()
            best = min(best, time.perf_counter() - begin)
        out.append(2.0 * size**3 / best / 1e9)
    return MatmulPeak(size, *out)


def memcpy_gbps(size_mib: int = 256, repeats: int = 5) -> float:
    """Bytes read per second by a large numpy copy (best of the repeats), GB/s."""
    src = np.ones(size_mib << 20, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - begin)
    return src.nbytes / best / 1e9


# -- the in-process bound --

class SuffixCompute(NamedTuple):
    """Seconds (lists: one per repeat) for the suffix of a `tokens`-long prompt over a cached prefix."""
    tokens: int
    prefix_tokens: int
    compute_s: list[float]  # prefix latents already placed in the pool: pure suffix compute
    placed_s: list[float]  # the same, each layer's prefix placed from host arrays just before its units (a RAM hit)
    compute_cpu_s: list[float]  # CPU time (all threads) of compute_s: vs wall time, what contention took


class RawDevice(NamedTuple):
    dd_gbps: float  # dd iflag=direct, 4 MiB requests (one in flight)
    parallel_gbps: float  # 8 O_DIRECT readers x 4 MiB
    gbps: float  # the better of the two: the reference a load is held to


def raw_device(directory: Path, size_mib: int) -> RawDevice:
    """Sequential O_DIRECT read bandwidth of `directory`'s device (kv_bench's measurement), GB/s."""
    path = directory / "ttft_dd.bin"
    try:
        dd = dd_read_gbps(path, size_mib, "4M")
        parallel = parallel_direct_read_gbps(path)
    finally:
        path.unlink(missing_ok=True)
    return RawDevice(dd, parallel, max(dd, parallel))


def suffix_compute(model_dir: Path, lengths: list[int], suffix: int, repeats: int, chunk_tokens: int = 512,
                   cache_dtype: str = "bfloat16", progress=None, dtype: str = "bfloat16") -> list[SuffixCompute]:
    """Times Runner.prefill of the suffix (one segment at position P = tokens - suffix) as the engine runs it,
    over the model as the engine serves it (`dtype`, model/serving.py, the engine's attention backend for this
    platform), after a warm-up call that compiles the shapes. The prefix's latents go into whole pages, the last
    one padded with zeros (the suffix then writes the rest of it). Latent values are random: compute time does
    not depend on them (the presets this bench runs are dense)."""
    import jax

    from model.attention import make_backend
    from model.latent_pool import LatentPool
    from model.runner import Runner, Segment, enable_compilation_cache
    from model.serving import serving_model
    from model.weights import load_model

    enable_compilation_cache()
    loaded = load_model(model_dir, cache_dtype=cache_dtype)
    cfg = loaded.config
    platform = jax.default_backend()
    pool = LatentPool(cfg, 1 + -(-max(lengths) // PAGE), PAGE)
    backend = make_backend("auto", cfg, platform, dtype, page_tokens=PAGE)
    runner = Runner(serving_model(loaded.model, dtype, platform=platform), cfg, pool, backend,
                    chunk_tokens=chunk_tokens)
    rng = np.random.default_rng(0)
    out = []
    for tokens in lengths:
        prefix = tokens - suffix
        pages = list(range(1, 1 + -(-tokens // PAGE)))
        held = pages[:-(-prefix // PAGE)]  # the pages the prefix's latents touch (ttft_bench: at least one)
        latents = []  # per layer (len(held) * PAGE, A) at cache dtype, zeros past the prefix
        for _ in range(cfg.num_layers):
            rows_PA = np.zeros((len(held) * PAGE, cfg.latent_dim), pool.dtype)
            rows_PA[:prefix] = rng.standard_normal((prefix, cfg.latent_dim), np.float32) * 0.1
            latents.append(rows_PA)

        compute, placed, compute_cpu = [], [], []
        for rep in range(repeats + 1):  # the first is the warm-up
            segment = Segment(rng.integers(1_000, 100_000, suffix), prefix, pages)
            for layer in range(cfg.num_layers):
                pool.place(layer, held, latents[layer])
            jax.block_until_ready(pool.layers)
            begin, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(runner.prefill([segment]).run())
            c, c_cpu = time.perf_counter() - begin, time.process_time() - cpu
            begin = time.perf_counter()
            run = runner.prefill([segment])
            for layer in range(cfg.num_layers):  # layer l placed, then its units: as a disk hit's layers arrive
                pool.place(layer, held, latents[layer])
                while run.done < run.units and run.layer == layer:
                    run.step()
            jax.block_until_ready(run.result)
            p = time.perf_counter() - begin
            if rep:
                compute.append(c)
                placed.append(p)
                compute_cpu.append(c_cpu)
            if progress is not None:
                progress.update()
        out.append(SuffixCompute(tokens, prefix, compute, placed, compute_cpu))
        del latents
        gc.collect()
    del runner, pool, loaded
    gc.collect()
    return out


# -- the transformers baseline --

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
    import torch
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


def transformers_repeat(model: torch.nn.Module, tokens: int, suffix: int, cache_path: Path,
            drop_caches: Callable[[], bool], rng: np.random.Generator) -> DiyTimes:
    """One repeat: miss over a fresh prompt of `tokens`, then hits over its first tokens - suffix."""
    import torch

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
