"""Fixtures shared with the store tests (the real PostgreSQL in a fresh schema)."""

from tests.store.conftest import pg_schema  # noqa: F401 (re-exported fixture)
