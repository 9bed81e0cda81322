"""One dataclass per service, filled from CLI flags and DEEPINFER_<SERVICE>_* environment variables.

Precedence: flag > environment > the dataclass default (each default is written once, in the
dataclass). A field without a default is required. Field types: str, int, float, bool,
list[str] (a repeatable flag; in the environment, comma-separated).
Field metadata: "help" (text) and "flag" (the flag name when it differs from the field name,
e.g. field `volumes` / flag `--volume`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Mapping, Sequence, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing or malformed; the message names the flag and variable."""


def env_name(prefix: str, field: str) -> str:
    return f"DEEPINFER_{prefix.upper()}_{field.upper()}"


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def _parse(kind: Any, raw: str, where: str) -> Any:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind in (int, float, str):
            return kind(raw)
        if typing.get_origin(kind) is list:
            return [item for item in raw.split(",") if item]
    except ValueError:
        raise ConfigError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {raw!r}") from None
    raise ConfigError(f"{where}: unsupported config type {kind}")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"default {f.default!r}"
    if f.default_factory is not dataclasses.MISSING:
        return f"default {f.default_factory()!r}"
    return "required"


def load_config(cls: type[T], prefix: str, argv: Sequence[str] | None = None,
                env: Mapping[str, str] | None = None, prog: str | None = None) -> T:
    """An instance of dataclass `cls` from `argv` (default sys.argv[1:]) and `env` (default os.environ)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__, allow_abbrev=False)
    fields = dataclasses.fields(cls)
    for f in fields:
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} ({_default_text(f)}; env {env_name(prefix, f.name)})"
        if kind is bool:
            parser.add_argument(_flag(f), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(_flag(f), dest=f.name, action="append", default=None, help=help_text)
        else:
            parser.add_argument(_flag(f), dest=f.name, default=None, help=help_text)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in fields:
        kind, flag, var = hints[f.name], _flag(f), env_name(prefix, f.name)
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = given if kind is bool or typing.get_origin(kind) is list else _parse(kind, given, flag)
        elif var in env:
            values[f.name] = _parse(kind, env[var], var)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{flag} (or {var}) is required")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
