"""Plumbing every service shares: config loading, JSON errors, health/readiness, metrics, admin auth.

    load_config(cls, prefix, argv=None, env=None, prog=None) -> cls   # flags > DEEPINFER_<PREFIX>_* > defaults
    RequestError(status, message, field=None); json_error(...); error_middleware
    add_health_routes(app, readiness: async () -> dict[str, bool])   # /healthz, /readyz
    add_metrics_route(app, registry, before=None)                     # /metrics
    admin_auth_middleware(token)                                      # /admin/* needs Bearer token
    service_auth_middleware(service_token, admin_token)               # the rest needs the service token
"""
import importlib

_MODULES = {"admin_auth_middleware": "admin", "ConfigError": "config", "load_config": "config",
            "secret_field": "config", "RequestError": "errors", "error_middleware": "errors",
            "json_error": "errors", "add_health_routes": "health", "add_metrics_route": "metrics",
            "bearer_headers": "service_auth", "service_auth_middleware": "service_auth"}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    """Each name from its module on first use: a service's model side imports config without the HTTP stack."""
    if name not in _MODULES:
        raise AttributeError(f"module 'services.common' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
