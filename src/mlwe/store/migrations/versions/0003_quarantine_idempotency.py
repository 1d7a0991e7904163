"""Quarantined records and Idempotency-Keys of submissions.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Written by hand; ``tests/store/test_migrations.py`` compares the upgraded
database with ``schema.metadata``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quarantine",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("record_table", sa.String(32), nullable=False),
        sa.Column("record_key", sa.String(256), nullable=False),
        sa.Column("problem", sa.Text, nullable=False),
        sa.Column("record", sa.Text, nullable=False),
        sa.Column("quarantined_at", sa.Float, nullable=False),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("key", sa.String(512), primary_key=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
    )
    op.create_index("ix_idempotency_keys_created", "idempotency_keys", ["created"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_created", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_table("quarantine")
