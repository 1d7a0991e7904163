"""Bearer tokens with roles: creation, hashed storage, verification, and route guards.

A token is ``mlwe_<id>_<secret>``: the id is public (it names the token in
listings and audit records), the secret is 32 random bytes. Only the SHA-256
of the whole token is stored (``api_tokens.token_hash``); a random 256-bit
secret needs no slow password hash, and a lookup by hash leaks nothing
useful through timing. Verified tokens are cached briefly in memory so a
request does not cost a database read; revoking clears the cache at once in
this process and within ``cache_ttl_s`` in any other.

Roles are ordered: viewer < submitter < operator < admin. Every API route
declares the least role it needs with :func:`requires` (or is listed as
public in ``mlwe.api.app.PUBLIC_PATHS``); the app factory refuses to build
an app with a route that declares neither, and a test enumerates the routes.
"""

from __future__ import annotations

import enum
import hashlib
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Engine, insert, select, update

from mlwe.store.schema import api_tokens

TOKEN_PREFIX = "mlwe_"
_TOKEN_RE = re.compile(r"^mlwe_([a-z0-9]{12})_([A-Za-z0-9_-]{43})$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")


class Role(enum.IntEnum):
    """What a token may do; each role includes every lower one."""

    VIEWER = 1  # read everything, watch the dashboard
    SUBMITTER = 2  # submit, validate, cancel its own workloads
    OPERATOR = 3  # nodes, agent approvals, scenarios, any workload, dead-letter replay
    ADMIN = 4  # tokens, quotas

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            known = ", ".join(r.label for r in cls)
            raise ValueError(f"unknown role {text!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's id, name and role."""

    token_id: str
    name: str
    role: Role

    @property
    def actor(self) -> str:
        """How the caller appears in audit records."""
        return f"api:{self.name}"

    def at_least(self, role: Role) -> bool:
        return self.role >= role


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: str
    name: str
    role: Role
    created: float
    revoked: bool


_MISS = object()


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenStore:
    """API tokens in the ``api_tokens`` table (hashes only)."""

    def __init__(self, engine: Engine, *, cache_ttl_s: float = 5.0) -> None:
        self.engine = engine
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def create(self, name: str, role: Role) -> tuple[str, TokenInfo]:
        """A new token; the plain text is returned once and never stored."""
        if not _NAME_RE.match(name):
            raise ValueError(
                "token name must start with a letter or digit and contain only letters,"
                " digits, '.', '_', '@' or '-' (at most 128 characters)"
            )
        role = Role(role)
        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
        token_id = "".join(secrets.choice(alphabet) for _ in range(12))
        token = f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(
                insert(api_tokens).values(
                    id=token_id,
                    name=name,
                    role=role.label,
                    token_hash=hash_token(token),
                    created=now,
                    revoked=False,
                )
            )
        return token, TokenInfo(token_id, name, role, now, False)

    def list(self) -> list[TokenInfo]:
        t = api_tokens
        with self.engine.connect() as conn:
            rows: Any = conn.execute(
                select(t.c.id, t.c.name, t.c.role, t.c.created, t.c.revoked).order_by(t.c.created)
            ).all()
        return [
            TokenInfo(str(i), str(n), Role.parse(str(r)), float(c), bool(rv))
            for i, n, r, c, rv in rows
        ]

    def revoke(self, token_id: str) -> bool:
        with self.engine.begin() as conn:
            res = conn.execute(
                update(api_tokens).where(api_tokens.c.id == token_id).values(revoked=True)
            )
        with self._lock:
            self._cache.clear()
        return bool(res.rowcount)

    def count_active(self) -> int:
        return sum(1 for t in self.list() if not t.revoked)

    def cached(self, token: str) -> Principal | object | None:
        """The cached answer for ``token`` (a principal or None), or ``_MISS``."""
        if not _TOKEN_RE.match(token):
            return None
        with self._lock:
            hit = self._cache.get(hash_token(token))
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        return _MISS

    def verify(self, token: str) -> Principal | None:
        """The principal of a valid, unrevoked token; None for anything else."""
        if not _TOKEN_RE.match(token):
            return None  # malformed: no database read for garbage
        digest = hash_token(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        t = api_tokens
        with self.engine.connect() as conn:
            row = conn.execute(
                select(t.c.id, t.c.name, t.c.role, t.c.revoked).where(t.c.token_hash == digest)
            ).first()
        principal = None
        if row is not None and not row[3]:
            principal = Principal(row[0], row[1], Role.parse(row[2]))
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (now + self.cache_ttl_s, principal)
        return principal


# ================================================================ route guards
class RoleGuard:
    """A FastAPI dependency that admits a bearer token of at least ``role``.

    The route's declared role is this object's ``role`` attribute: the app
    factory and the auth-matrix test read it from each route's dependencies.
    """

    def __init__(self, role: Role) -> None:
        self.role = role

    async def __call__(self, request: Request) -> Principal:
        # async so a request does not hop to a worker thread just to be authenticated; a
        # token missing from the cache is looked up in the database on a worker thread
        store: TokenStore = request.app.state.tokens
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise HTTPException(
                status_code=401,
                detail="missing bearer token (send 'Authorization: Bearer <token>')",
                headers={"WWW-Authenticate": "Bearer"},
            )
        token = value.strip()
        hit = store.cached(token)
        principal = (
            await run_in_threadpool(store.verify, token) if hit is _MISS else cast(Principal | None, hit)
        )
        if principal is None:
            raise HTTPException(
                status_code=401,
                detail="invalid or revoked token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
        if principal.role < self.role:
            raise HTTPException(
                status_code=403,
                detail=f"this needs the {self.role.label} role; the token has {principal.role.label}",
            )
        request.state.principal = principal
        return principal


def requires(role: Role) -> Any:
    """``principal: Principal = requires(Role.OPERATOR)`` in a route's signature."""
    return Depends(RoleGuard(role))


def declared_role(dependant: Any) -> Role | None:
    """The role a route's dependency tree declares (None: none)."""
    found: list[Role] = []

    def walk(d: Any) -> None:
        call = getattr(d, "call", None)
        if isinstance(call, RoleGuard):
            found.append(call.role)
        for sub in getattr(d, "dependencies", ()):
            walk(sub)

    walk(dependant)
    return max(found) if found else None
