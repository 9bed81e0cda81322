"""Where the engine's weights come from: a model directory, or a preset created once on first run."""
from __future__ import annotations

import fcntl
import logging
from pathlib import Path

from model.config import preset
from model.weights import LoadedModel, init_model, load_model, save_model

log = logging.getLogger(__name__)


def ensure_preset(name: str, models_dir: str | Path) -> Path:
    """The directory of preset `name`, initialised on first use under a file lock (replicas start together)."""
    target = Path(models_dir) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "meta.json").exists():
            cfg = preset(name)
            log.info("initialising %s weights in %s (first run)", name, target)
            save_model(init_model(cfg, progress=True), cfg, target)
    return target


def open_model(model_dir: str, preset_name: str, models_dir: str, cache_dtype: str) -> LoadedModel:
    path = Path(model_dir) if model_dir else ensure_preset(preset_name, models_dir)
    return load_model(path, cache_dtype=cache_dtype)
