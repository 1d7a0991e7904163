"""Durable state behind one repository interface: SQLite by default, PostgreSQL for
scale; the append-only audit chain; the credential sanitizer; schema migrations.

``repository.Repository`` is the interface. It composes one module per aggregate
(``state``, ``cluster``, ``telemetry``, ``reasoning``, ``snapshots``, ``quarantine``,
``idempotency``), each holding its tables' SQL, over one transaction helper
(``db.Transactions``); ``events``, ``tokens``, ``workflows`` and ``pipelines`` hold
the SQL of tables other layers own."""
