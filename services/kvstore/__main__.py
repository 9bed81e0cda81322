"""python -m services.kvstore --fingerprint FP --num-layers N --volume DIR [--volume DIR ...] ..."""
from __future__ import annotations

import logging
import sys

from aiohttp import web

from services.common import ConfigError, load_config

from .app import create_app
from .config import KvstoreConfig


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(KvstoreConfig, "kvstore", argv, prog="python -m services.kvstore")
    except ConfigError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    web.run_app(create_app(config), host=config.host, port=config.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
