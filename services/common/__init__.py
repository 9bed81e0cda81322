"""Plumbing every service shares: config loading, JSON errors, health/readiness, metrics, admin auth.

    load_config(cls, prefix, argv=None, env=None, prog=None) -> cls   # flags > DEEPINFER_<PREFIX>_* > defaults
    RequestError(status, message, field=None); json_error(...); error_middleware
    add_health_routes(app, readiness: async () -> dict[str, bool])   # /healthz, /readyz
    add_metrics_route(app, registry, before=None)                     # /metrics
    admin_auth_middleware(token)                                      # /admin/* needs Bearer token
    service_auth_middleware(service_token, admin_token)               # the rest needs the service token
"""
from .admin import admin_auth_middleware
from .config import ConfigError, load_config, secret_field
from .errors import RequestError, error_middleware, json_error
from .health import add_health_routes
from .metrics import add_metrics_route
from .service_auth import bearer_headers, service_auth_middleware

__all__ = ["ConfigError", "RequestError", "add_health_routes", "add_metrics_route", "admin_auth_middleware",
           "bearer_headers", "error_middleware", "json_error", "load_config", "secret_field",
           "service_auth_middleware"]
