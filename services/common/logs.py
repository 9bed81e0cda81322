"""Log lines of every service: text (the default) or one JSON object per line; both name the request.

    configure_logging("gateway", "json")
Text:  2026-12-01 10:00:00,123 gateway INFO services.gateway.app [5f2c...]: POST /v1/chat/completions -> 200
JSON:  {"time": "...", "service": "gateway", "level": "INFO", "logger": "...", "request_id": "5f2c...",
        "message": "...", "exception": "Traceback ..." (only with one)}
"""
from __future__ import annotations

import json
import logging

from services.common.request_context import current_request_id

LOG_FORMATS = ("text", "json")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "service": self.service, "level": record.levelname,
                "logger": record.name, "request_id": getattr(record, "request_id", "-"),
                "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def check_log_format(log_format: str) -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")


def configure_logging(service: str, log_format: str = "text", level: int = logging.INFO) -> None:
    """Replaces the root logger's handlers (orbax's import already installed absl's) with one on stderr."""
    check_log_format(log_format)
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s {service} %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
