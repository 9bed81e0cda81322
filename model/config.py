"""Model configuration: one slotted dataclass, named presets, and the Hugging Face config reader."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

# The RoPE layout of transformers' DeepseekV3 with rope_interleave=True: q_pe/k_pe come out of the
# projections as interleaved pairs (x0, x1), (x2, x3), ... and leave RoPE as [evens | odds] halves.
ROPE_LAYOUT = "interleaved-pairs->half-split"

_DTYPES = ("float32", "bfloat16", "float16")
SERVING_DTYPES = ("bfloat16", "float32")  # what an engine serves a model at (model/serving.py)


def check_serving_dtype(dtype: str, name: str = "dtype") -> str:
    """`dtype` if an engine can serve at it; else a ValueError naming `name` (a flag or a field)."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"{name} must be {' or '.join(SERVING_DTYPES)}, got {dtype!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    # MoE; layers [0, first_k_dense) are dense SwiGLU, the rest MoE (none when n_routed_experts == 0).
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # "sigmoid" (V3, with e_score_correction_bias) or "softmax" (V2)
    topk_method: str = "noaux_tc"  # "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: dict[str, Any] | None = None  # YaRN: factor, original_max_position_embeddings, mscale, ...
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Precision: weights/compute dtype and the dtype latents are cached (and attended) in.
    param_dtype: str = "float32"
    cache_dtype: str = "bfloat16"
    init_seed: int = 0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError("model config: qk_rope_head_dim must be even")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError("model config: q_lora_rank must be > 0 or None")
        for name in ("param_dtype", "cache_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"model config: {name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError("model config: num_experts_per_tok must be in [1, n_routed_experts]")
            if self.n_routed_experts % self.n_group:
                raise ValueError("model config: n_routed_experts must be divisible by n_group")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError("model config: topk_group must be in [1, n_group]")
            if self.scoring_func not in ("sigmoid", "softmax"):
                raise ValueError(f"model config: unknown scoring_func {self.scoring_func!r}")
            if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
                raise ValueError(f"model config: unknown topk_method {self.topk_method!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Dims cached per token per layer: c_kv (kv_lora_rank) then k_pe (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, blob: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(blob) - known
        if unknown:
            raise ValueError(f"model config: unknown fields {sorted(unknown)}")
        return cls(**blob)

    def fingerprint(self, weights_digest: str) -> str:
        """Keys the latent cache: config, RoPE layout, cache dtype and weights all have to match."""
        blob = self.to_json()
        blob.pop("name")  # a renamed copy of the same model shares its cache
        blob.pop("init_seed")  # covered by the weights digest
        text = json.dumps({"config": blob, "rope_layout": ROPE_LAYOUT, "cache_dtype": self.cache_dtype,
                           "weights": weights_digest}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def _yarn(factor: float, original: int, mscale: float = 1.0, mscale_all_dim: float = 1.0) -> dict[str, Any]:
    return {"type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim, "beta_fast": 32, "beta_slow": 1}


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=129_280, hidden_size=64, num_layers=2, num_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        max_position_embeddings=16_384, rope_scaling=_yarn(4.0, 4096)),
    "mini": ModelConfig(
        name="mini", vocab_size=129_280, hidden_size=1024, num_layers=8, num_heads=8,
        q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=2816, max_position_embeddings=163_840, rope_scaling=_yarn(40.0, 4096)),
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", vocab_size=102_400, hidden_size=2048, num_layers=27, num_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=10_944, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        moe_intermediate_size=1408, first_k_dense=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        scoring_func="softmax", topk_method="greedy", max_position_embeddings=163_840,
        rope_scaling=_yarn(40.0, 4096, 0.707, 0.707), bos_token_id=100_000, eos_token_id=100_001,
        param_dtype="bfloat16"),
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", vocab_size=129_280, hidden_size=7168, num_layers=61, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18_432, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=2048, first_k_dense=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        max_position_embeddings=163_840, rope_scaling=_yarn(40.0, 4096), param_dtype="bfloat16"),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def from_hf_config(hf: dict[str, Any], name: str = "converted", **overrides: Any) -> ModelConfig:
    """Reads a Hugging Face DeepSeek-V2/V3 `config.json` dict."""
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not supported (DeepSeek models have none)")
    if hf.get("rope_interleave", True) is False:
        raise ValueError("config.json: rope_interleave=false is not supported; DeepSeek checkpoints interleave")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    theta = hf.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    if rope is not None:
        kind = rope.get("type") or rope.get("rope_type") or "default"
        if kind == "default":
            rope = None
        elif kind != "yarn":
            raise ValueError(f"config.json: rope scaling {kind!r} is not supported (only yarn)")
        else:
            rope = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")} | {"type": "yarn"}
    n_routed = hf.get("n_routed_experts") or 0
    eos = hf.get("eos_token_id", 1)
    cfg = dict(
        name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], intermediate_size=hf["intermediate_size"],
        n_routed_experts=n_routed, num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        n_shared_experts=hf.get("n_shared_experts") or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
        first_k_dense=(hf.get("first_k_dense_replace") or 0) if n_routed else hf["num_hidden_layers"],
        n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
        norm_topk_prob=bool(hf.get("norm_topk_prob", hf.get("model_type") != "deepseek_v2")),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        # transformers' DeepseekV3 always routes as noaux_tc on sigmoid scores, whatever config.json says;
        # V2 configs may carry scoring_func/topk_method as null (transformers' defaults: softmax, greedy).
        scoring_func="sigmoid" if hf.get("model_type") == "deepseek_v3" else hf.get("scoring_func") or "softmax",
        topk_method="noaux_tc" if hf.get("model_type") == "deepseek_v3" else hf.get("topk_method") or "greedy",
        rope_theta=float(theta), max_position_embeddings=hf["max_position_embeddings"], rope_scaling=rope,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id", 0) or 0, eos_token_id=eos[0] if isinstance(eos, list) else eos or 0,
    )
    return ModelConfig(**(cfg | overrides))
