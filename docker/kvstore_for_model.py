"""Container entrypoint of the kvstore: python docker/kvstore_for_model.py MODEL_DIR [kvstore flags ...]

The kvstore must be started with the model fingerprint (config, cache dtype and weights digest),
which only the saved model knows; `deepinfer up` reads it in-process, a container cannot. This
reads MODEL_DIR's config.json and meta.json (no weights), refuses geometry flags that disagree
with the model, and execs `python -m services.kvstore` with `--fingerprint` added, and
`--num-layers` / `--latent-dim` / `--rope-dim` from the model where they are not given (one compose
file serves every preset).
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from model.weights import read_identity
from services.common.config import env_name, load_config
from services.kvstore.config import KvstoreConfig


def kvstore_argv(model_dir: str, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """`argv` plus `--fingerprint` of the model in `model_dir`; ValueError if the geometry disagrees."""
    if any(arg == "--fingerprint" or arg.startswith("--fingerprint=") for arg in argv):
        raise ValueError("--fingerprint is read from the model directory; do not pass it")
    geometry = ("--num-layers", "--latent-dim", "--rope-dim")
    given = {flag for flag in geometry if any(arg == flag or arg.startswith(flag + "=") for arg in argv)
             or env_name("kvstore", flag[2:].replace("-", "_")) in env}
    placeholders = [word for flag in geometry if flag not in given for word in (flag, "1")]
    declared = load_config(KvstoreConfig, "kvstore", [*argv, *placeholders, "--fingerprint", "unset"], env)
    model, fingerprint = read_identity(model_dir, declared.dtype)
    added = []
    for flag, declared_value, actual in (("--num-layers", declared.num_layers, model.num_layers),
                                         ("--latent-dim", declared.latent_dim, model.latent_dim),
                                         ("--rope-dim", declared.rope_dim, model.qk_rope_head_dim)):
        if flag not in given:
            added += [flag, str(actual)]
        elif declared_value != actual:
            raise ValueError(f"{flag} is {declared_value} but the model in {model_dir} has {actual}")
    return [*argv, *added, "--fingerprint", fingerprint]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    try:
        argv = kvstore_argv(sys.argv[1], sys.argv[2:], os.environ)
    except (ValueError, OSError, KeyError) as error:
        sys.exit(f"kvstore: {error}")
    # exec: the kvstore becomes PID 1 and gets the SIGTERM of `docker compose stop` itself.
    os.execv(sys.executable, [sys.executable, "-m", "services.kvstore", *argv])


if __name__ == "__main__":
    main()
