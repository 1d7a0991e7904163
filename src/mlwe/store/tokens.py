"""API token rows (table ``api_tokens``): hashes and policies only, never a token's text.

The API's :class:`mlwe.api.auth.TokenStore` owns what a token means (roles, policies,
hashing, the lookup cache); this module owns how its rows are stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, insert, select, update

from mlwe.store.schema import api_tokens

__all__ = ["TokenRow", "TokenRows"]


@dataclass(frozen=True, slots=True)
class TokenRow:
    id: str
    name: str
    role: str
    created: float
    revoked: bool
    #: queues the token may submit to (None: any)
    queues: tuple[str, ...] | None
    max_priority: int | None
    allow_protected: bool


_COLUMNS = (
    api_tokens.c.id, api_tokens.c.name, api_tokens.c.role, api_tokens.c.created,
    api_tokens.c.revoked, api_tokens.c.queues, api_tokens.c.max_priority,
    api_tokens.c.allow_protected,
)


def _row(r: Any) -> TokenRow:
    i, name, role, created, revoked, queues, max_priority, allow_protected = r
    return TokenRow(
        str(i), str(name), str(role), float(created), bool(revoked),
        None if queues is None else tuple(str(q) for q in json.loads(queues)),
        None if max_priority is None else int(max_priority),
        True if allow_protected is None else bool(allow_protected),
    )


class TokenRows:
    """The ``api_tokens`` table of one database."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def insert(self, row: TokenRow, token_hash: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                insert(api_tokens).values(
                    id=row.id,
                    name=row.name,
                    role=row.role,
                    token_hash=token_hash,
                    created=row.created,
                    revoked=row.revoked,
                    queues=None if row.queues is None else json.dumps(sorted(row.queues)),
                    max_priority=row.max_priority,
                    allow_protected=row.allow_protected,
                )
            )

    def all(self) -> list[TokenRow]:
        """Every token, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(*_COLUMNS).order_by(api_tokens.c.created)).all()
        return [_row(r) for r in rows]

    def by_hash(self, token_hash: str) -> TokenRow | None:
        with self.engine.connect() as conn:
            r = conn.execute(select(*_COLUMNS).where(api_tokens.c.token_hash == token_hash)).first()
        return None if r is None else _row(r)

    def revoke(self, token_id: str) -> bool:
        """Mark a token revoked; False when there is no such token."""
        with self.engine.begin() as conn:
            res = conn.execute(
                update(api_tokens).where(api_tokens.c.id == token_id).values(revoked=True)
            )
        return bool(res.rowcount)
