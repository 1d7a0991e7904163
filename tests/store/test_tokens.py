"""API token rows round-trip exactly, on SQLite and PostgreSQL (hashes only, never text)."""

from __future__ import annotations

from sqlalchemy import Engine

from mlwe.store.tokens import TokenRow, TokenRows


def test_token_rows_round_trip_and_revoke(engine: Engine) -> None:
    rows = TokenRows(engine)
    a = TokenRow("a1", "ci-bot", "submitter", 10.0, False, ("batch", "llm"), 50, False)
    b = TokenRow("b2", "ops", "admin", 20.0, False, None, None, True)
    rows.insert(b, "h" * 64)
    rows.insert(a, "g" * 64)
    assert rows.all() == [a, b]  # oldest first
    assert rows.by_hash("g" * 64) == a and rows.by_hash("x" * 64) is None
    assert rows.revoke("a1") and not rows.revoke("nope")
    got = rows.by_hash("g" * 64)
    assert got is not None and got.revoked and got.queues == ("batch", "llm")
