"""API tokens get an admission policy: queues, highest priority, protected.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Existing tokens keep what they could do (any queue, any priority, protected
allowed). Ownership moves from the token's name to its id (the subject): a
workload submitted before this revision is labelled with a name only, and
only an operator may cancel it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("queues", sa.Text))
        batch.add_column(sa.Column("max_priority", sa.Integer))
        batch.add_column(
            sa.Column("allow_protected", sa.Boolean, nullable=False, server_default=sa.true())
        )


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("allow_protected")
        batch.drop_column("max_priority")
        batch.drop_column("queues")
