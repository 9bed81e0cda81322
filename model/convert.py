"""Hugging Face DeepSeek-V2/V3 safetensors -> a DeepInfer model directory, streamed tensor by tensor.

Each parameter is read (`pread`s into fresh buffers, not memory maps), converted (transposed to (in, out), split,
cast), hashed and written alone, routed experts one at a time: peak host memory is the largest non-expert tensor
or one expert's matrix. Every shape is checked from the headers first; multi-token-prediction layers are skipped.
FP8 block-scaled weights (V3's e4m3, a `weight_scale_inv` per 128x128 tile) are dequantised to the param dtype as
they stream: no XLA backend here has block-scaled FP8 matmuls (the cost: twice the memory).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx
from tqdm import tqdm

from model.config import ModelConfig, from_hf_config
from model.transformer import DeepseekModel
from model.weights import combine_digest, flat_params, nest_params, tensor_line, write_identity
from model.tokenizer_files import copy_tokenizer_files

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FP8_BLOCK = 128  # DeepSeek-V3's weight_scale_inv covers 128 x 128 tiles
CHUNK_BYTES = 64 << 20  # zarr chunk of a non-expert tensor (rows); an expert is one chunk


class SafetensorsDir:
    """Every tensor of a directory of *.safetensors files, by name, read on demand."""

    def __init__(self, path: Path):
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        self._where: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        for file in files:
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for name, entry in header.items():
                if name != "__metadata__":
                    self._where[name] = (file, entry["dtype"], tuple(entry["shape"]),
                                         8 + header_len + entry["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def _locate(self, name: str) -> tuple[Path, str, tuple[int, ...], int]:
        if name not in self._where:
            raise KeyError(name)
        file, dtype, shape, offset = self._where[name]
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name}: unsupported safetensors dtype {dtype}")
        return file, dtype, shape, offset

    def shape_only(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """A stand-in of the right shape and dtype that holds no memory (for checking shapes)."""
        _, dtype, shape, _ = self._locate(name)
        if lo is not None:
            shape = (hi - lo, *shape[1:])
        fp8 = dtype.startswith("F8") and name + "_scale_inv" in self._where
        return np.broadcast_to(np.zeros((), np.float32 if fp8 else _DTYPES[dtype]), shape)

    def get(self, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """The tensor, or its rows [lo, hi), as a fresh array; FP8 with a `_scale_inv` comes dequantised (float32)."""
        file, dtype, shape, offset = self._locate(name)
        element = np.dtype(_DTYPES[dtype])
        row = int(np.prod(shape[1:], dtype=np.int64)) * element.itemsize
        lo, hi = (0, shape[0] if shape else 1) if lo is None else (lo, hi)
        out_shape = (hi - lo, *shape[1:]) if shape else ()
        array = np.empty(out_shape, element)
        with open(file, "rb") as f:
            done, view = 0, memoryview(array.reshape(-1).view(np.uint8))
            while done < view.nbytes:
                done += os.preadv(f.fileno(), [view[done:]], offset + lo * row + done)
        scale_name = name + "_scale_inv"
        if dtype.startswith("F8") and scale_name in self._where:
            if array.ndim != 2 or lo % FP8_BLOCK:
                raise ValueError(f"tensor {name}: FP8 reads must be 2-D and start on a {FP8_BLOCK}-row tile")
            return _dequantize_fp8(array, self.get(scale_name)[lo // FP8_BLOCK:])
        return array


def _dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float32 (rows, cols), one 128-row tile at a time (no full-size scale array)."""
    rows, cols = w.shape
    out = np.empty((rows, cols), np.float32)
    for tile, begin in enumerate(range(0, rows, FP8_BLOCK)):
        scale_C = np.repeat(scale_inv[tile].astype(np.float32), FP8_BLOCK)[:cols]  # (cols,)
        np.multiply(w[begin:begin + FP8_BLOCK].astype(np.float32), scale_C, out=out[begin:begin + FP8_BLOCK])
    return out


Reader = Callable[..., np.ndarray]  # (hf name, lo=None, hi=None) -> array
Pieces = Callable[[], Iterator[np.ndarray]]  # consecutive blocks along our first axis


def _whole(make: Callable[[], np.ndarray]) -> Pieces:
    return lambda: iter([make()])


def _sources(cfg: ModelConfig, hf: SafetensorsDir, read: Reader) -> dict[str, Pieces]:
    """Our flat parameter name -> its pieces, made from HF tensors (transposed to (in, out))."""
    N, H, V = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    t = lambda name: _whole(lambda: read(name).T)  # noqa: E731
    same = lambda name: _whole(lambda: read(name))  # noqa: E731
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
            w = read(a + "kv_b_proj.weight")  # (N*(H+V), C)
            w_NXC = w.reshape(N, H + V, w.shape[-1])
            chosen = w_NXC[:, :H] if part == "k" else w_NXC[:, H:]
            return chosen.transpose(2, 0, 1)  # (C, N, H|V)

        out[dst + "attn.w_uk"] = _whole(lambda kv_b=kv_b: kv_b("k"))
        out[dst + "attn.w_uv"] = _whole(lambda kv_b=kv_b: kv_b("v"))
        out[dst + "attn.o_proj.kernel"] = t(a + "o_proj.weight")
        m = src + "mlp."
        if not cfg.is_moe_layer(i):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[dst + f"mlp.{proj}.kernel"] = t(m + f"{proj}.weight")
            continue
        out[dst + "mlp.router"] = same(m + "gate.weight")
        bias = m + "gate.e_score_correction_bias"
        out[dst + "mlp.e_score_correction_bias"] = (
            same(bias) if bias in hf else _whole(lambda E=cfg.n_routed_experts: np.zeros((E,), np.float32)))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[dst + f"mlp.{proj}"] = lambda proj=proj, m=m: _experts(hf, read, m, proj, cfg)
            if cfg.n_shared_experts:
                out[dst + f"mlp.shared.{proj}.kernel"] = t(m + f"shared_experts.{proj}.weight")
    return out


def _experts(hf: SafetensorsDir, read: Reader, m: str, proj: str, cfg: ModelConfig) -> Iterator[np.ndarray]:
    """One expert at a time, (1, D, I) for gate/up and (1, I, D) for down; from per-expert or fused tensors."""
    I = cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        if m + "experts.gate_up_proj" in hf:  # transformers v5 fused layout
            if proj == "down_proj":
                yield read(m + "experts.down_proj", e, e + 1).transpose(0, 2, 1)  # (1, D, I) -> (1, I, D)
            else:
                fused = read(m + "experts.gate_up_proj", e, e + 1)  # (1, 2I, D)
                yield (fused[:, :I] if proj == "gate_proj" else fused[:, I:]).transpose(0, 2, 1)
        else:
            yield read(m + f"experts.{e}.{proj}.weight").T[None]


class Streamed:
    """A checkpoint leaf written piece by piece by `StreamedHandler` (orbax sees an np.ndarray)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype, pieces: Pieces, chunk_rows: int):
        self.name, self.shape, self.dtype, self.pieces = name, tuple(shape), np.dtype(dtype), pieces
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape, dtype=np.int64))
        self.nbytes, self.chunk_rows = self.size * self.dtype.itemsize, chunk_rows


class StreamedHandler(ocp.type_handlers.NumpyHandler):
    """Writes `Streamed` leaves one at a time (orbax starts them all at once), hashing the bytes as they pass."""

    def __init__(self, bar: tqdm, lines: dict[str, bytes]):
        super().__init__(deepcopy_host_arrays=False)
        self.bar, self.lines = bar, lines
        self._one_at_a_time: asyncio.Lock | None = None

    async def _open_and_write(self, value: Streamed, tspec: dict, ts_context: ts.Context) -> None:
        self._one_at_a_time = self._one_at_a_time or asyncio.Lock()
        async with self._one_at_a_time:
            tspec["metadata"]["chunks"] = (value.chunk_rows, *value.shape[1:])
            store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
            digest, row = hashlib.sha256(), 0
            for piece in value.pieces():
                piece = np.ascontiguousarray(piece, dtype=value.dtype)
                digest.update(piece.reshape(-1).view(np.uint8))
                await store[row:row + piece.shape[0]].write(piece, can_reference_source_data_indefinitely=True)
                row += piece.shape[0]
                self.bar.update(piece.nbytes)
                del piece
            self.lines[value.name] = tensor_line(value.name, value.shape, value.dtype, digest.hexdigest())


class Converted(NamedTuple):
    path: Path
    config: ModelConfig
    fingerprint: str
    weights_digest: str


def _check_shapes(hf_dir: Path, hf: SafetensorsDir, cfg: ModelConfig, expected: dict) -> None:
    """Every tensor we need exists and has the right shape, from the headers alone."""
    checks = _sources(cfg, hf, hf.shape_only)
    for path, want in expected.items():
        try:
            pieces = list(checks[path]())
        except KeyError as missing:
            raise ValueError(f"{hf_dir}: tensor {missing.args[0]} (for {path}) is missing") from None
        got = (sum(p.shape[0] for p in pieces), *pieces[0].shape[1:]) if pieces[0].ndim else ()
        if any(p.shape[1:] != pieces[0].shape[1:] for p in pieces) or tuple(got) != tuple(want.shape):
            raise ValueError(f"{hf_dir}: tensor for {path} has shape {tuple(got)}, expected {tuple(want.shape)}")


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, name: str | None = None,
            progress: bool = True, **overrides) -> Converted:
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    config_path = hf_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{hf_dir}: config.json is missing")
    hf_config = json.loads(config_path.read_text())
    if "param_dtype" not in overrides:
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
        overrides["param_dtype"] = dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"
    cfg = from_hf_config(hf_config, name=name or hf_dir.name, **overrides)
    hf = SafetensorsDir(hf_dir)

    target = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: DeepseekModel(cfg, nnx.Rngs(params=0))), nnx.Param))
    expected = flat_params(target)
    _check_shapes(hf_dir, hf, cfg, expected)
    if (out / "params").exists():
        raise FileExistsError(f"{out} already holds a model; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)

    sources = _sources(cfg, hf, hf.get)
    leaves = {}
    for path, want in expected.items():
        row_bytes = max(1, int(np.prod(want.shape[1:], dtype=np.int64)) * np.dtype(want.dtype).itemsize)
        routed = path.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))  # one expert per chunk
        rows = min(1 if routed else max(1, CHUNK_BYTES // row_bytes), want.shape[0])
        leaves[path] = Streamed(path, want.shape, want.dtype, sources[path], rows)
    lines: dict[str, bytes] = {}
    with tqdm(total=sum(leaf.nbytes for leaf in leaves.values()), desc="convert", unit="B", unit_scale=True,
              disable=not progress) as bar:
        registry = ocp.type_handlers.create_type_handler_registry((Streamed, StreamedHandler(bar, lines)))
        # one zarr array per tensor: OCDBT's writer holds memory in proportion to everything written
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_ocdbt=False)
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(out / "params", nest_params(target, leaves))
    digest = combine_digest(lines)
    copy_tokenizer_files(hf_dir, out)
    shapes = {path: list(want.shape) for path, want in expected.items()}
    return Converted(out, cfg, write_identity(out, cfg, digest, shapes), digest)
