"""The engine as a service: FastAPI app factory, routes, bearer-token auth, Server-Sent Events.

``create_app(engine)`` builds the app for one running engine; ``mlwe serve``
(see ``mlwe.api.serve``) builds the engine, the app and the server together.

The names below load on first use, so that ``import mlwe.api.cli`` (the client
commands of ``mlwe``) does not pull in FastAPI, SQLAlchemy and the engine.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy sees; at run time each name loads on first use
    from mlwe.api.app import PUBLIC_PATHS, create_app, route_roles
    from mlwe.api.auth import Principal, Role, TokenStore
    from mlwe.api.context import API_PREFIX, ApiSettings

__all__ = [
    "API_PREFIX",
    "PUBLIC_PATHS",
    "ApiSettings",
    "Principal",
    "Role",
    "TokenStore",
    "create_app",
    "route_roles",
]

_HOME = {
    "PUBLIC_PATHS": "mlwe.api.app",
    "create_app": "mlwe.api.app",
    "route_roles": "mlwe.api.app",
    "Principal": "mlwe.api.auth",
    "Role": "mlwe.api.auth",
    "TokenStore": "mlwe.api.auth",
    "API_PREFIX": "mlwe.api.context",
    "ApiSettings": "mlwe.api.context",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mlwe.api' has no attribute {name!r}")
    return getattr(import_module(home), name)
