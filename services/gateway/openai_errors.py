"""Errors in the OpenAI wire format: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json

from aiohttp import web


class OpenAIError(Exception):
    """An error the client sees; `param` names the request field at fault (e.g. "messages[2].role")."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, error_type: str = "invalid_request_error",
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.error_type = error_type
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return web.Response(status=self.status, text=json.dumps(self.body()),
                            content_type="application/json", headers=headers)


def invalid(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, param=param, code=code)


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(message, code="invalid_api_key", status=401,
                       error_type="invalid_request_error")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found", status=404)


def unavailable(message: str, retry_after_s: int | None = 1) -> OpenAIError:
    return OpenAIError(message, code="engine_unavailable", status=503,
                       error_type="service_unavailable_error", retry_after_s=retry_after_s)
