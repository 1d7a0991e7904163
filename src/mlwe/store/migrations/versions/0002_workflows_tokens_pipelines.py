"""Workflows, API tokens, pipeline runs and steps, and the model registry.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

Written by hand; ``tests/store/test_migrations.py`` compares the upgraded
database with ``schema.metadata``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workflows",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("correlation_id", sa.String(256)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("data", sa.Text, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False),
    )
    op.create_index("ix_workflows_status", "workflows", ["status"])
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(128), nullable=False, unique=True),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("revoked", sa.Boolean, nullable=False),
    )
    op.create_table(
        "pipeline_runs",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("pipeline", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("correlation_id", sa.String(256)),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("metrics", sa.Text, nullable=False),
        sa.Column("artifacts", sa.Text, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("rationale", sa.Text),
    )
    op.create_index("ix_pipeline_runs_pipeline", "pipeline_runs", ["pipeline"])
    op.create_table(
        "pipeline_steps",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("step", sa.String(128), primary_key=True),
        sa.Column("workload_id", sa.String(128)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("metrics", sa.Text, nullable=False),
        sa.Column("outputs", sa.Text, nullable=False),
        sa.Column("started", sa.Float),
        sa.Column("finished", sa.Float),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("workloads", sa.Text, nullable=False),
        sa.Column("error", sa.Text),
    )
    op.create_table(
        "models",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("stage", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(128)),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("metrics", sa.Text, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("models", "pipeline_steps", "pipeline_runs", "api_tokens", "workflows"):
        op.drop_table(table)
