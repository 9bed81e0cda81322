"""python -m services.gateway --engine URL [--engine URL ...] ...: run until SIGTERM (API keys come from the
environment: DEEPINFER_GATEWAY_API_KEYS or DEEPINFER_GATEWAY_API_KEYS_FILE)."""
from __future__ import annotations

import sys

from aiohttp import web

from services.common import ConfigError
from services.common.logs import configure_logging
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig


def main(argv: list[str] | None = None) -> int:
    configure_logging("gateway")
    try:
        config = GatewayConfig.load(argv)
    except ConfigError as error:
        print(f"gateway: {error}", file=sys.stderr)
        return 2
    configure_logging("gateway", config.log_format)
    # handler_cancellation: a client that goes away cancels its handler, which closes the
    # engine stream, which cancels the generation. shutdown_timeout drains in-flight requests.
    web.run_app(create_app(config), host=config.host, port=config.port,
                handler_cancellation=True, shutdown_timeout=config.drain_timeout_s,
                access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
