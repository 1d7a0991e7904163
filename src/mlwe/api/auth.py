"""Bearer tokens with roles: creation, hashed storage, verification, and route guards.

A token is ``mlwe_<id>_<secret>``: the id is public (it names the token in
listings and audit records), the secret is 32 random bytes. Only the SHA-256
of the whole token is stored (``api_tokens.token_hash``); a random 256-bit
secret needs no slow password hash, and a lookup by hash leaks nothing
useful through timing. Verified tokens are cached briefly in memory so a
request does not cost a database read; revoking clears the cache at once in
this process and within ``cache_ttl_s`` in any other.

Ownership rests on the token's **subject**, its id: minted per token, never
reused (revoked rows stay in the table, the id is its primary key), so a
second token with the same name, or one re-issued under a revoked name, is a
different subject and cannot touch the first holder's work. Names are for
people to read.

Each token also carries an admission **policy** (like a Kueue LocalQueue and
a K8s PriorityClass admission rule): the queues it may submit to, the
highest priority it may ask for, and whether it may mark a workload
``protected``. :func:`policy_denials` checks a submission against it.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Engine

from mlwe.core.spec import DEFAULT_PRIORITY_CLASSES, WorkloadSpec
from mlwe.store.tokens import TokenRow, TokenRows

TOKEN_PREFIX = "mlwe_"
_TOKEN_RE = re.compile(r"mlwe_([a-z0-9]{12})_([A-Za-z0-9_-]{43})")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_QUEUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: A client's X-Correlation-ID: the id rule, short enough to carry the subject's prefix.
CORRELATION_MAX = 128 - 13
_CORRELATION_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:-]{{0,{CORRELATION_MAX - 1}}}")


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
class TokenPolicy:
    """What a token may submit. ``None`` means no limit on that axis."""

    queues: frozenset[str] | None = None  # the queues it may submit to
    max_priority: int | None = None  # the highest priority (a class's value) it may ask for
    allow_protected: bool = True  # whether it may set ``protected: true``

    @classmethod
    def build(
        cls,
        *,
        queues: Iterable[str] | None = None,
        max_priority: int | str | None = None,
        allow_protected: bool = True,
        classes: Mapping[str, int] = DEFAULT_PRIORITY_CLASSES,
    ) -> TokenPolicy:
        """A policy from user input; ValueError names what is wrong."""
        qs: frozenset[str] | None = None
        if queues is not None:
            qs = frozenset(q.strip() for q in queues if q.strip())
            bad = sorted(q for q in qs if not _QUEUE_RE.fullmatch(q))
            if bad:
                raise ValueError(f"invalid queue name(s) {', '.join(map(repr, bad))}")
            if not qs:
                raise ValueError("queues: give at least one queue (omit it to allow any)")
        return cls(qs, parse_priority(max_priority, classes), bool(allow_protected))

    def to_dict(self) -> dict[str, Any]:
        return {
            "queues": None if self.queues is None else sorted(self.queues),
            "max_priority": self.max_priority,
            "max_priority_class": priority_label(self.max_priority),
            "allow_protected": self.allow_protected,
        }


UNRESTRICTED = TokenPolicy()


def parse_priority(value: int | str | None, classes: Mapping[str, int] = DEFAULT_PRIORITY_CLASSES) -> int | None:
    """A priority limit given as an integer or a class name (``high``)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ValueError("max priority must be an integer or a priority class name")
    if isinstance(value, int):
        n = value
    elif value.strip() in classes:
        return classes[value.strip()]
    else:
        try:
            n = int(value.strip())
        except ValueError:
            known = ", ".join(classes)
            raise ValueError(f"unknown priority class {value.strip()!r}; known: {known}") from None
    if not 0 <= n <= 1_000_000:
        raise ValueError("max priority must be between 0 and 1000000")
    return n


def priority_label(p: int | None, classes: Mapping[str, int] = DEFAULT_PRIORITY_CLASSES) -> str | None:
    """``100 (high)`` for a class's value, ``70`` otherwise; None for None."""
    if p is None:
        return None
    names = [k for k, v in classes.items() if v == p]
    return f"{p} ({names[0]})" if names else str(p)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's id (its subject), name, role and admission policy."""

    token_id: str
    name: str
    role: Role
    policy: TokenPolicy = UNRESTRICTED

    @property
    def subject(self) -> str:
        """The unique owner of what this token submits: its id, minted once, never reused."""
        return self.token_id

    @property
    def actor(self) -> str:
        """How the caller appears in audit records (the name to read, the subject to tell apart)."""
        return f"api:{self.name}#{self.token_id}"

    def at_least(self, role: Role) -> bool:
        return self.role >= role


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: str
    name: str
    role: Role
    created: float
    revoked: bool
    policy: TokenPolicy = UNRESTRICTED


def policy_denials(principal: Principal, specs: Sequence[WorkloadSpec]) -> list[tuple[str, str]]:
    """What the token's policy does not allow in ``specs``: (field path, reason) per problem.

    Empty when everything is allowed. Paths are ``[i].field`` as in validation
    errors, so a client sees exactly which workload and field to change.
    """
    pol = principal.policy
    out: list[tuple[str, str]] = []
    for i, s in enumerate(specs):
        if pol.queues is not None and s.queue not in pol.queues:
            out.append((
                f"[{i}].queue",
                f"token {principal.name!r} may not submit to queue {s.queue!r};"
                f" allowed: {', '.join(sorted(pol.queues))}",
            ))
        if pol.max_priority is not None and s.priority > pol.max_priority:
            out.append((
                f"[{i}].priority",
                f"priority {priority_label(s.priority)} is above token {principal.name!r}'s"
                f" highest allowed priority {priority_label(pol.max_priority)}",
            ))
        if s.protected and not pol.allow_protected:
            out.append((f"[{i}].protected", f"token {principal.name!r} may not submit protected workloads"))
    return out


def check_correlation_id(value: str) -> str | None:
    """Why a client-given X-Correlation-ID is refused (None: it is fine)."""
    if not _CORRELATION_RE.fullmatch(value):
        return (
            f"must be 1 to {CORRELATION_MAX} characters: letters, digits, '.', '_', ':' or '-',"
            " starting with a letter or digit"
        )
    return None


def scoped_correlation_id(principal: Principal, value: str) -> str:
    """A client's correlation id filed under its subject, so no tenant can file under another's.

    The subject is a fixed-width token id, so ``<subject>.<id>`` cannot be
    produced by any other subject, nor collide with a server-made ``req-`` id.
    """
    return f"{principal.subject}.{value}"


_MISS = object()


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenStore:
    """API tokens (hashes only, in :class:`mlwe.store.tokens.TokenRows`), with a short
    lookup cache so an authenticated request rarely reads the database."""

    def __init__(self, engine: Engine, *, cache_ttl_s: float = 5.0) -> None:
        self.engine = engine
        self.rows = TokenRows(engine)
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def create(self, name: str, role: Role, policy: TokenPolicy = UNRESTRICTED) -> tuple[str, TokenInfo]:
        """A new token; the plain text is returned once and never stored."""
        if not _NAME_RE.fullmatch(name):
            raise ValueError(
                "token name must start with a letter or digit and contain only letters,"
                " digits, '.', '_', '@' or '-' (at most 128 characters)"
            )
        role = Role(role)
        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
        token_id = "".join(secrets.choice(alphabet) for _ in range(12))
        token = f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}"
        now = time.time()
        self.rows.insert(
            TokenRow(
                token_id, name, role.label, now, False,
                None if policy.queues is None else tuple(sorted(policy.queues)),
                policy.max_priority, policy.allow_protected,
            ),
            hash_token(token),
        )
        return token, TokenInfo(token_id, name, role, now, False, policy)

    def list(self) -> list[TokenInfo]:
        return [
            TokenInfo(r.id, r.name, Role.parse(r.role), r.created, r.revoked, _policy(r))
            for r in self.rows.all()
        ]

    def revoke(self, token_id: str) -> bool:
        found = self.rows.revoke(token_id)
        with self._lock:
            self._cache.clear()
        return found

    def count_active(self) -> int:
        return sum(1 for t in self.list() if not t.revoked)

    def cached(self, token: str) -> Principal | object | None:
        """The cached answer for ``token`` (a principal or None), or ``_MISS``."""
        if not _TOKEN_RE.fullmatch(token):
            return None
        with self._lock:
            hit = self._cache.get(hash_token(token))
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        return _MISS

    def verify(self, token: str) -> Principal | None:
        """The principal of a valid, unrevoked token; None for anything else."""
        if not _TOKEN_RE.fullmatch(token):
            return None  # malformed: no database read for garbage
        digest = hash_token(token)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        row = self.rows.by_hash(digest)
        principal = None
        if row is not None and not row.revoked:
            principal = Principal(row.id, row.name, Role.parse(row.role), _policy(row))
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (now + self.cache_ttl_s, principal)
        return principal


def _policy(row: TokenRow) -> TokenPolicy:
    return TokenPolicy(
        None if row.queues is None else frozenset(row.queues),
        row.max_priority,
        row.allow_protected,
    )


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
