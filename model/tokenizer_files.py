"""A checkpoint's tokenizer files, copied by the converter next to config.json for the gateway and the engine's
grammar masks (model/grammar.py), which fall back to the packaged DeepSeek-V3 tokenizer without them."""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def copy_tokenizer_files(hf_dir: Path, model_dir: Path) -> list[str]:
    """Copy the checkpoint's tokenizer files (those it has) into model_dir; their names."""
    present = [name for name in TOKENIZER_FILES if (Path(hf_dir) / name).is_file()]
    for name in present:
        shutil.copyfile(Path(hf_dir) / name, Path(model_dir) / name)
    return present


def model_tokenizer_json(model_dir: str | Path) -> Path | None:
    """The model's own tokenizer.json, or None (a preset, or a checkpoint that had none)."""
    path = Path(model_dir) / "tokenizer.json"
    return path if model_dir and path.is_file() else None
