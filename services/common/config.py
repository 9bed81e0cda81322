"""One dataclass per service, filled from CLI flags and DEEPINFER_<SERVICE>_* environment variables.

Precedence: flag > environment > the dataclass default (each default is written once, in the
dataclass). A field without a default is required. Field types: str, int, float, bool,
list[str] (a repeatable flag; in the environment, comma-separated).
Field metadata: "help" (text), "flag" (the flag name when it differs from the field name,
e.g. field `volumes` / flag `--volume`) and "default_text" (how the flag tables name a default that differs
by machine, such as a path).

Secrets (metadata "secret": True, e.g. tokens, keys, passwords) have no flag: argv is readable by
every local user (`ps`). They come from DEEPINFER_<SERVICE>_<FIELD>, or from the file named by
DEEPINFER_<SERVICE>_<FIELD>_FILE (the Docker secrets convention; one trailing newline is dropped).
Declare them with `secret_field()`, which also keeps them out of the dataclass repr.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
import urllib.parse
from typing import Any, Mapping, Sequence, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing or malformed; the message names the flag and variable."""


def env_name(prefix: str, field: str) -> str:
    return f"DEEPINFER_{prefix.upper()}_{field.upper()}"


def check_redis_url(url: str) -> None:
    """A Redis URL never carries a password (it would show in argv, logs and `ps`): the password is
    the secret field `redis_password`."""
    if url and urllib.parse.urlsplit(url).password is not None:
        raise ValueError("redis_url must not contain a password; give it as the secret redis_password "
                         "(environment or *_FILE), and the user in the URL: redis://USER@HOST:PORT/DB")


def secret_field(help_text: str, default: str = "") -> Any:
    """A str field that never comes from argv and never shows in repr (see the module docstring)."""
    return dataclasses.field(default=default, repr=False, metadata={"help": help_text, "secret": True})


def is_secret(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("secret"))


def read_secret(var: str, env: Mapping[str, str]) -> str | None:
    """The value of secret variable `var` from env[var] or the file env[var + "_FILE"]; None if neither."""
    file_var = var + "_FILE"
    if var in env and file_var in env:
        raise ConfigError(f"give {var} or {file_var}, not both")
    if file_var in env:
        try:
            text = open(env[file_var], encoding="utf-8").read()
        except OSError as e:
            raise ConfigError(f"{file_var}: cannot read {env[file_var]!r}: {e.strerror}") from None
        return text[:-1] if text.endswith("\n") else text
    return env.get(var)


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


def config_parser(cls: type, prefix: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of dataclass `cls`: one flag per non-secret field, secrets in the epilog."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    secrets = [f"  {env_name(prefix, f.name)}[_FILE]: {f.metadata.get('help', '')}" for f in fields if is_secret(f)]
    epilog = "secrets (environment or file only, never flags):\n" + "\n".join(secrets) if secrets else None
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__, allow_abbrev=False, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields:
        kind = hints[f.name]
        if is_secret(f):
            continue
        help_text = f"{f.metadata.get('help', '')} ({_default_text(f)}; env {env_name(prefix, f.name)})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: "80% of" would crash --help
        if kind is bool:
            parser.add_argument(_flag(f), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(_flag(f), dest=f.name, action="append", default=None, help=help_text)
        else:
            parser.add_argument(_flag(f), dest=f.name, default=None, help=help_text)
    return parser


def flag_rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(flags, variable, default, meaning) per field, flags as the parser accepts them: the rows of the
    configuration tables in README.md and docs/operations.md (services.flag_docs renders them)."""
    by_dest = {a.dest: a for a in config_parser(cls, prefix)._actions}
    rows = []
    for f in dataclasses.fields(cls):
        var = env_name(prefix, f.name)
        if is_secret(f):
            flags, var = "(secret: no flag)", f"{var}[_FILE]"
        else:
            flags = ", ".join(by_dest[f.name].option_strings)
        default = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING \
            else f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = "(none)" if default in ("", []) else str(default).lower() if isinstance(default, bool) else str(default)
        default = f.metadata.get("default_text", default)  # a default that differs by machine (a path) is described
        rows.append((flags, var, default, f.metadata.get("help", "")))
    return rows


def load_config(cls: type[T], prefix: str, argv: Sequence[str] | None = None,
                env: Mapping[str, str] | None = None, prog: str | None = None) -> T:
    """An instance of dataclass `cls` from `argv` (default sys.argv[1:]) and `env` (default os.environ)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    args = config_parser(cls, prefix, prog).parse_args(argv)
    values: dict[str, Any] = {}
    for f in fields:
        kind, flag, var = hints[f.name], _flag(f), env_name(prefix, f.name)
        if is_secret(f):
            secret = read_secret(var, env)
            if secret is not None:
                values[f.name] = secret
            continue
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
