"""Hugging Face DeepSeek-V2/V3 safetensors -> a DeepInfer model directory.

Reads tensors by memory-mapping the safetensors files (FP8 block-quantised weights with
`weight_scale_inv` are dequantised), maps HF parameter names onto ours, checks every shape,
skips multi-token-prediction layers, and saves with orbax through `model.weights.save_model`.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from model.config import ModelConfig, from_hf_config
from model.transformer import DeepseekModel
from model.weights import LoadedModel, save_model

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FP8_BLOCK = 128  # DeepSeek-V3's weight_scale_inv covers 128 x 128 tiles


class SafetensorsDir:
    """Every tensor of a directory of *.safetensors files, memory-mapped, by name."""

    def __init__(self, path: Path):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self._where: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for file in files:
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                self._where[name] = (file, entry["dtype"], entry["shape"], 8 + header_len + begin, end - begin)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(name)
        file, dtype, shape, offset, nbytes = self._where[name]
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name}: unsupported safetensors dtype {dtype}")
        array = np.memmap(file, dtype=_DTYPES[dtype], mode="r", offset=offset, shape=tuple(shape))
        scale_name = name + "_scale_inv"
        if dtype.startswith("F8") and scale_name in self._where:
            return _dequantize_fp8(array, self.get(scale_name))
        return array


def _dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    rows, cols = w.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return w.astype(np.float32) * scale


def _hf_name_map(cfg: ModelConfig, hf: SafetensorsDir) -> dict[str, callable]:
    """Our flat parameter name -> a thunk producing it from HF tensors (transposed to (in, out))."""
    N, H, V = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    t = lambda name: lambda: np.asarray(hf.get(name)).T  # noqa: E731
    same = lambda name: lambda: np.asarray(hf.get(name))  # noqa: E731
    lm_head = "lm_head.weight" if "lm_head.weight" in hf or not cfg.tie_word_embeddings else "model.embed_tokens.weight"
    out = {"embed": same("model.embed_tokens.weight"), "head.norm.weight": same("model.norm.weight"),
           "head.lm_head.kernel": t(lm_head)}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        out[dst + "input_norm.weight"] = same(src + "input_layernorm.weight")
        out[dst + "post_attn_norm.weight"] = same(src + "post_attention_layernorm.weight")
        if cfg.q_lora_rank:
            out[dst + "attn.q_a_proj.kernel"] = t(a + "q_a_proj.weight")
            out[dst + "attn.q_a_norm.weight"] = same(a + "q_a_layernorm.weight")
            out[dst + "attn.q_b_proj.kernel"] = t(a + "q_b_proj.weight")
        else:
            out[dst + "attn.q_proj.kernel"] = t(a + "q_proj.weight")
        out[dst + "attn.kv_a_proj.kernel"] = t(a + "kv_a_proj_with_mqa.weight")
        out[dst + "attn.kv_a_norm.weight"] = same(a + "kv_a_layernorm.weight")

        def kv_b(part: str, a: str = a) -> np.ndarray:
            w = np.asarray(hf.get(a + "kv_b_proj.weight"))  # (N*(H+V), C)
            w_NXC = w.reshape(N, H + V, w.shape[-1])
            chosen = w_NXC[:, :H] if part == "k" else w_NXC[:, H:]
            return chosen.transpose(2, 0, 1)  # (C, N, H|V)

        out[dst + "attn.w_uk"] = lambda kv_b=kv_b: kv_b("k")
        out[dst + "attn.w_uv"] = lambda kv_b=kv_b: kv_b("v")
        out[dst + "attn.o_proj.kernel"] = t(a + "o_proj.weight")
        m = src + "mlp."
        if not cfg.is_moe_layer(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[dst + f"mlp.{proj}.kernel"] = t(m + f"{proj}.weight")
            continue
        out[dst + "mlp.router"] = same(m + "gate.weight")
        bias = m + "gate.e_score_correction_bias"
        out[dst + "mlp.e_score_correction_bias"] = (
            same(bias) if bias in hf else lambda E=cfg.n_routed_experts: np.zeros((E,), np.float32))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[dst + f"mlp.{proj}"] = lambda proj=proj, m=m: _experts(hf, m, proj, cfg)
            if cfg.n_shared_experts:
                out[dst + f"mlp.shared.{proj}.kernel"] = t(m + f"shared_experts.{proj}.weight")
    return out


def _experts(hf: SafetensorsDir, m: str, proj: str, cfg: ModelConfig) -> np.ndarray:
    """Stacked expert weights: gate/up (E, D, I), down (E, I, D); from per-expert or fused HF tensors."""
    I = cfg.moe_intermediate_size
    if m + "experts.gate_up_proj" in hf:  # transformers v5 fused layout
        if proj == "down_proj":
            return np.asarray(hf.get(m + "experts.down_proj")).transpose(0, 2, 1)  # (E, D, I) -> (E, I, D)
        fused = np.asarray(hf.get(m + "experts.gate_up_proj"))  # (E, 2I, D)
        half = fused[:, :I] if proj == "gate_proj" else fused[:, I:]
        return half.transpose(0, 2, 1)
    return np.stack([np.asarray(hf.get(m + f"experts.{e}.{proj}.weight")).T for e in range(cfg.n_routed_experts)])


def _flat_names(tree: dict, prefix: str = "") -> list[str]:
    names = []
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        names.extend(_flat_names(value, name) if isinstance(value, dict) else [name])
    return names


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, name: str | None = None,
            progress: bool = True, **overrides) -> LoadedModel:
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{hf_dir}: config.json is missing")
    hf_config = json.loads(config_path.read_text())
    if "param_dtype" not in overrides:
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
        overrides["param_dtype"] = dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    cfg = from_hf_config(hf_config, name=name or hf_dir.name, **overrides)
    tensors = SafetensorsDir(hf_dir)
    thunks = _hf_name_map(cfg, tensors)

    abstract = nnx.eval_shape(lambda: DeepseekModel(cfg, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    target = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    shapes = {}

    def fill(tree: dict, prefix: str = "") -> dict:
        filled = {}
        for key, value in tree.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict):
                filled[key] = fill(value, path)
                continue
            try:
                array = thunks[path]()
            except KeyError as missing:
                raise ValueError(f"{hf_dir}: tensor {missing.args[0]} (for {path}) is missing") from None
            if tuple(array.shape) != tuple(value.shape):
                raise ValueError(f"{hf_dir}: tensor for {path} has shape {tuple(array.shape)}, "
                                 f"expected {tuple(value.shape)}")
            filled[key] = jnp.asarray(np.asarray(array, dtype=value.dtype))  # a device array, C order
            shapes[path] = array.shape
            bar.update()
        return filled

    bar = tqdm(total=len(_flat_names(target)), desc="convert", unit="tensor", disable=not progress)
    params = fill(target)
    bar.close()
    nnx.replace_by_pure_dict(state, params)
    return save_model(nnx.merge(graphdef, state), cfg, out)
