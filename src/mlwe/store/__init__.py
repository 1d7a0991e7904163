"""Durable state behind one repository interface: SQLite by default, PostgreSQL for
scale; the append-only audit chain; the credential sanitizer; schema migrations."""
