"""Weights on disk: deterministic random init per preset, orbax save/restore, digest and fingerprint. A model dir
holds `config.json`, `meta.json` (weights digest, fingerprint, parameter shapes) and `params/` (orbax)."""
from __future__ import annotations

import hashlib
import json
import os
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from model.config import ModelConfig
from model.sharding import param_shardings
from model.transformer import DeepseekModel


class LoadedModel(NamedTuple):
    model: DeepseekModel
    config: ModelConfig
    fingerprint: str
    weights_digest: str


def flat_params(tree: dict, prefix: str = "") -> dict:
    """A nested parameter dict as {dotted name: leaf}."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(flat_params(value, name) if isinstance(value, dict) else {name: value})
    return out


def nest_params(tree: dict, leaves: dict, prefix: str = "") -> dict:
    """`tree`'s nesting with every leaf replaced by leaves[its dotted name]."""
    return {key: nest_params(value, leaves, f"{prefix}{key}.") if isinstance(value, dict) else leaves[f"{prefix}{key}"]
            for key, value in tree.items()}


def tensor_line(name: str, shape: tuple[int, ...], dtype, sha256_hex: str) -> bytes:
    """One tensor's entry in the weights digest: its name, shape, dtype and the sha256 of its C-order bytes."""
    return f"{name}:{tuple(shape)}:{np.dtype(dtype)}:{sha256_hex}\n".encode()


def combine_digest(lines: dict[str, bytes]) -> str:
    return hashlib.sha256(b"".join(lines[name] for name in sorted(lines))).hexdigest()


def weights_digest(model: DeepseekModel) -> str:
    """sha256 over every parameter's `tensor_line` in name order (a converter may hash them in any order)."""
    lines = {}
    for name, value in flat_params(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items():
        array = np.ascontiguousarray(np.asarray(value))
        lines[name] = tensor_line(name, array.shape, array.dtype, hashlib.sha256(array.view(np.uint8)).hexdigest())
    return combine_digest(lines)


def init_model(cfg: ModelConfig, progress: bool = False) -> DeepseekModel:
    """Deterministic random weights: the same preset and seed give the same bytes everywhere."""
    bar = tqdm(total=cfg.num_layers, desc=f"init {cfg.name}", unit="layer", disable=not progress)
    model = DeepseekModel(cfg, nnx.Rngs(params=cfg.init_seed), on_layer=lambda _: bar.update())
    bar.close()
    return model


def save_model(model: DeepseekModel, cfg: ModelConfig, out: str | os.PathLike) -> LoadedModel:
    out = Path(out).absolute()
    if (out / "params").exists():
        raise FileExistsError(f"{out} already holds a model; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    digest = weights_digest(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / "params", params)
    shapes = {name: list(np.shape(v)) for name, v in flat_params(params).items()}
    return LoadedModel(model, cfg, write_identity(out, cfg, digest, shapes), digest)


def write_identity(out: Path, cfg: ModelConfig, digest: str, shapes: dict[str, list[int]]) -> str:
    """config.json and meta.json of a model directory; returns the fingerprint."""
    fingerprint = cfg.fingerprint(digest)
    (out / "config.json").write_text(json.dumps(cfg.to_json(), indent=2))
    (out / "meta.json").write_text(json.dumps({"weights_digest": digest, "fingerprint": fingerprint,
                                               "shapes": shapes}, indent=2))
    return fingerprint


def load_model(path: str | os.PathLike, mesh: Mesh | None = None, **overrides) -> LoadedModel:
    """Restores a saved model, checking every tensor's shape; with a mesh, each device reads only its own slices."""
    path = Path(path).absolute()
    for needed in ("config.json", "meta.json", "params"):
        if not (path / needed).exists():
            raise FileNotFoundError(f"{path} is not a DeepInfer model directory: {needed} is missing")
    saved_cfg = ModelConfig.from_json(json.loads((path / "config.json").read_text()))
    cfg = saved_cfg.replace(**overrides) if overrides else saved_cfg
    meta = json.loads((path / "meta.json").read_text())
    abstract = nnx.eval_shape(lambda: DeepseekModel(cfg, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    target = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    expected = {name: tuple(v.shape) for name, v in flat_params(target).items()}
    with ocp.StandardCheckpointer() as checkpointer:
        stored_tree = checkpointer.metadata(path / "params").item_metadata.tree
        stored = {name: tuple(m.shape) for name, m in flat_params(stored_tree).items()}
        for name, shape in expected.items():
            if name not in stored:
                raise ValueError(f"checkpoint {path}: tensor {name} is missing")
            if stored[name] != shape:
                raise ValueError(f"checkpoint {path}: tensor {name} has shape {stored[name]}, expected {shape}")
        if mesh is not None:
            target = jax.tree.map(lambda value, sharding: jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                                               sharding=sharding),
                                  target, param_shardings(target, mesh))
        restored = checkpointer.restore(path / "params", target)
    # A converted model restores as numpy arrays, which jit would copy to the device on every call.
    nnx.replace_by_pure_dict(state, restored if mesh is not None else jax.tree.map(jnp.asarray, restored))
    model = nnx.merge(graphdef, state)
    digest = meta["weights_digest"]
    if cfg.param_dtype != saved_cfg.param_dtype:
        digest = weights_digest(model)
    return LoadedModel(model, cfg, cfg.fingerprint(digest), digest)


def read_identity(path: str | os.PathLike, cache_dtype: str | None = None) -> tuple[ModelConfig, str]:
    """(config, fingerprint) of a saved model without loading its weights."""
    path = Path(path)
    cfg = ModelConfig.from_json(json.loads((path / "config.json").read_text()))
    if cache_dtype:
        cfg = cfg.replace(cache_dtype=cache_dtype)
    digest = json.loads((path / "meta.json").read_text())["weights_digest"]
    return cfg, cfg.fingerprint(digest)


def init_on_device(cfg: ModelConfig, seed: int = 0) -> DeepseekModel:
    """Random N(0, 0.02) weights drawn on the device (not `init_model`'s bytes), unit norms; for benchmarks."""
    abstract = nnx.eval_shape(lambda: DeepseekModel(cfg, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    tree = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    key = jax.random.key(seed)

    @partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    values = {}
    for i, (name, value) in enumerate(sorted(flat_params(tree).items())):
        if name.endswith("norm.weight"):
            values[name] = jnp.ones(value.shape, value.dtype)
        elif name.endswith("e_score_correction_bias"):
            values[name] = jnp.zeros(value.shape, value.dtype)
        else:
            values[name] = normal(jax.random.fold_in(key, i), tuple(value.shape), value.dtype)
    nnx.replace_by_pure_dict(state, nest_params(tree, values))
    return nnx.merge(graphdef, state)
