"""python -m services.kvstore --fingerprint FP --num-layers N --volume DIR [--volume DIR ...] ..."""
from __future__ import annotations

import sys

from aiohttp import web

from services.common import ConfigError, load_config
from services.common.logs import configure_logging

from .app import create_app
from .config import KvstoreConfig


def main(argv: list[str] | None = None) -> int:
    configure_logging("kvstore")
    try:
        config = load_config(KvstoreConfig, "kvstore", argv, prog="python -m services.kvstore")
    except ConfigError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    configure_logging("kvstore", config.log_format)
    web.run_app(create_app(config), host=config.host, port=config.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
