"""python -m services.engine [--port 8200] [--preset mini | --model-dir DIR] [--volume DIR ...] [--redis-url URL]"""
import sys

from aiohttp import web

from services.common.config import ConfigError
from services.common.logs import configure_logging
from services.engine.app import build_app
from services.engine.config import load


def main(argv: list[str] | None = None) -> int:
    # configure_logging forces its handler: importing orbax already ran absl's logging.basicConfig(),
    # which would leave the root logger at WARNING (no "engine ready", no warm-up rate in the log).
    configure_logging("engine")
    try:
        cfg = load(argv)
    except ConfigError as error:
        print(f"engine: configuration error: {error}", file=sys.stderr)
        return 2
    configure_logging("engine", cfg.log_format)
    web.run_app(build_app(cfg), host=cfg.host, port=cfg.port, print=None, shutdown_timeout=30.0,
                handler_cancellation=True, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
