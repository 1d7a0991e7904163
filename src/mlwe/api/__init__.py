"""The engine as a service: FastAPI app factory, routes, bearer-token auth, Server-Sent Events.

``create_app(engine)`` builds the app for one running engine; ``mlwe serve``
(see ``mlwe.api.serve``) builds the engine, the app and the server together.
"""

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
