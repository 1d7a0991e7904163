"""The database schema (SQLAlchemy Core). Alembic migrations are generated from it.

Bump ``SCHEMA_VERSION`` together with a new migration in ``store/migrations``.
JSON documents are stored as text (portable across SQLite and PostgreSQL) after
the credential sanitizer has run on them.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    true,
)

#: The Alembic revision this code expects; the engine refuses any other.
SCHEMA_VERSION = "0004"

metadata = MetaData()

workloads = Table(
    "workloads",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("seq", BigInteger, nullable=False),  # arrival order
    Column("spec", Text, nullable=False),  # WorkloadSpec JSON (sanitised)
    Column("submit_time", Float, nullable=False),
    Column("deadline", Float),
    Column("state", String(16), nullable=False),
    Column("attempt", Integer, nullable=False, default=0),
    Column("failures", Integer, nullable=False, default=0),
    Column("work_done", Float, nullable=False, default=0.0),
    Column("progress", Float, nullable=False, default=0.0),
    Column("priority_override", Integer),
    Column("placement", Text, nullable=False, default="[]"),  # JSON list of replica allocs
    Column("started_at", Float),
    Column("failure_cause", String(64)),
    Column("correlation_id", String(256)),  # as wide as every other correlation/cause id
    Column("updated_version", BigInteger, nullable=False, default=0),
    # the rest of the control plane's record, so a recovered workload is identical
    Column("run_base_work", Float, nullable=False, default=0.0),
    Column("last_checkpoint_at", Float),
    Column("preempted_by", String(128)),
    Column("victims", Text, nullable=False, default="[]"),  # JSON list of workload ids
    Column("preemptions", Integer, nullable=False, default=0),
    Column("borrowing", Boolean, nullable=False, default=False),
    Column("pending_reason", Text, nullable=False, default=""),
    Column("exit_code", Integer),
)
Index("ix_workloads_state", workloads.c.state)

transitions = Table(
    "transitions",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("workload_id", String(128), nullable=False),
    # position in the workload's history: with the unique index below, a write retried
    # after a commit whose outcome was unknown cannot store a transition twice
    Column("step", Integer, nullable=False),
    Column("time", Float, nullable=False),
    Column("source", String(16)),
    Column("target", String(16), nullable=False),
    Column("reason", Text, nullable=False),
    Column("cause_id", String(256)),
)
Index("ix_transitions_workload", transitions.c.workload_id)
Index("ux_transitions_workload_step", transitions.c.workload_id, transitions.c.step, unique=True)

nodes = Table(
    "nodes",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("spec", Text, nullable=False),  # NodeSpec JSON
    Column("status", String(16), nullable=False),
    # order the node was added in: placement tie-breaks depend on it, so recovery keeps it
    Column("position", Integer, nullable=False, default=0),
)

queues = Table(
    "queues",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("spec", Text, nullable=False),  # QueueSpec JSON
)

decisions = Table(
    "decisions",
    metadata,
    Column("seq", BigInteger, primary_key=True),
    Column("time", Float, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("workload", String(128), nullable=False),
    Column("cause_id", String(256)),
    Column("record", Text, nullable=False),  # DecisionRecord JSON
)
Index("ix_decisions_workload", decisions.c.workload)
Index("ix_decisions_cause", decisions.c.cause_id)

reasoning = Table(
    "reasoning",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False),
    Column("correlation_id", String(256)),
    Column("record", Text, nullable=False),  # agent reasoning trace JSON
)

telemetry = Table(
    "telemetry",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False),
    Column("node", String(128), nullable=False),
    Column("workload", String(128)),
    Column("resolution_s", Integer, nullable=False),  # downsampling bucket
    Column("metrics", Text, nullable=False),
)
Index("ix_telemetry_time", telemetry.c.time)

snapshots = Table(
    "snapshots",
    metadata,
    Column("version", BigInteger, primary_key=True),
    Column("time", Float, nullable=False),
    Column("state", Text, nullable=False),
)

processed_events = Table(
    "processed_events",
    metadata,
    Column("event_id", String(256), primary_key=True),
    Column("processed_at", Float, nullable=False),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("event_id", String(256), primary_key=True),
    Column("time", Float, nullable=False),
    Column("subject", String(256), nullable=False),
    Column("payload", Text, nullable=False),
    Column("error", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("replayed", Boolean, nullable=False, default=False),
)

audit = Table(
    "audit",
    metadata,
    Column("seq", BigInteger, primary_key=True),
    Column("time", Float, nullable=False),
    Column("kind", String(32), nullable=False),  # decision, proposal, operator, config
    Column("actor", String(128), nullable=False),
    Column("workload", String(128)),
    Column("correlation_id", String(256)),
    Column("payload", Text, nullable=False),  # canonical JSON (sanitised)
    Column("prev_hash", String(64), nullable=False),
    Column("hash", String(64), nullable=False),
)
Index("ix_audit_workload", audit.c.workload)
Index("ix_audit_correlation", audit.c.correlation_id)

meta_kv = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)


# ------------------------------------------------------------ revision 0002
# Multi-step workflows (rescheduling, failure recovery): persisted so that a
# crash mid-workflow resumes at the right step.
workflows = Table(
    "workflows",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("kind", String(64), nullable=False),
    Column("correlation_id", String(256)),
    Column("status", String(16), nullable=False),  # running, done, failed, compensated
    Column("step", Integer, nullable=False, default=0),
    Column("data", Text, nullable=False),  # JSON (sanitised)
    Column("created", Float, nullable=False),
    Column("updated", Float, nullable=False),
)
Index("ix_workflows_status", workflows.c.status)

# API bearer tokens: only a hash of each token is stored.
api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("role", String(16), nullable=False),  # viewer, submitter, operator, admin
    Column("token_hash", String(128), nullable=False, unique=True),
    Column("created", Float, nullable=False),
    Column("revoked", Boolean, nullable=False, default=False),
    # admission policy (migration 0004); NULL: no limit. The token's id is its subject.
    Column("queues", Text),  # a JSON list of the queues it may submit to
    Column("max_priority", Integer),  # the highest priority it may ask for
    Column("allow_protected", Boolean, nullable=False, default=True, server_default=true()),
)

# ML pipelines: runs, their steps, and the model registry.
pipeline_runs = Table(
    "pipeline_runs",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("pipeline", String(128), nullable=False),
    Column("status", String(16), nullable=False),
    Column("correlation_id", String(256)),
    Column("spec", Text, nullable=False),  # pipeline spec JSON
    Column("params", Text, nullable=False),
    Column("metrics", Text, nullable=False),
    Column("artifacts", Text, nullable=False),
    Column("created", Float, nullable=False),
    Column("updated", Float, nullable=False),
    Column("actor", String(128), nullable=False, default="user"),  # who started it
    Column("rationale", Text),  # why, when an agent started it (its steps are proposals)
)
Index("ix_pipeline_runs_pipeline", pipeline_runs.c.pipeline)

pipeline_steps = Table(
    "pipeline_steps",
    metadata,
    Column("run_id", String(128), primary_key=True),
    Column("step", String(128), primary_key=True),
    Column("workload_id", String(128)),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    Column("metrics", Text, nullable=False),
    Column("outputs", Text, nullable=False),
    Column("started", Float),
    Column("finished", Float),
    Column("kind", String(16), nullable=False, default="batch"),  # batch or service
    Column("workloads", Text, nullable=False, default="[]"),  # JSON: every workload id (replicas)
    Column("error", Text),  # why the step failed, in words
)

models = Table(
    "models",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("version", Integer, primary_key=True),
    Column("stage", String(16), nullable=False),  # candidate, production, archived
    Column("run_id", String(128)),
    Column("path", Text, nullable=False),
    Column("metrics", Text, nullable=False),
    Column("created", Float, nullable=False),
)

# ------------------------------------------------------------------ revision 0003
# A stored record recovery could not read back: kept here whole (not lost, not in
# the way of a start), listed by `mlwe quarantine list`, resubmitted or dropped.
quarantine = Table(
    "quarantine",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("record_table", String(32), nullable=False),  # workload, node, queue
    Column("record_key", String(256), nullable=False),
    Column("problem", Text, nullable=False),
    Column("record", Text, nullable=False),  # JSON: the stored row (and its transitions)
    Column("quarantined_at", Float, nullable=False),
)

# A submission's Idempotency-Key (scoped by who sent it) and the first answer to it.
idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("key", String(512), primary_key=True),
    Column("request_hash", String(64), nullable=False),
    Column("status", Integer, nullable=False),
    Column("response", Text, nullable=False),
    Column("created", Float, nullable=False),
)
Index("ix_idempotency_keys_created", idempotency_keys.c.created)
