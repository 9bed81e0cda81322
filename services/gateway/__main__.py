"""`python -m services.gateway [--flags]`: run the gateway until SIGINT/SIGTERM."""
from __future__ import annotations

import logging
import sys

from aiohttp import web

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = GatewayConfig.load(argv)
    # handler_cancellation: a client that goes away cancels its handler, which closes the
    # engine stream, which cancels the generation. shutdown_timeout drains in-flight requests.
    web.run_app(create_app(config), host=config.host, port=config.port,
                handler_cancellation=True, shutdown_timeout=config.drain_timeout_s,
                access_log=None, print=None)


if __name__ == "__main__":
    main(sys.argv[1:])
