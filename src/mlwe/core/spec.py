"""What users write: workload, node, queue and cluster specs, validated with pydantic.

These models are the edge of the core. Everything is checked here (types,
ranges, units, cross-field rules, GPU models against the catalogue) so that
nothing invalid reaches the control plane. Quantities accept human units
("16Gi", "500m", "1h30m") and are stored as the engine's integers.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.resources import (
    UNLIMITED,
    Resources,
    parse_cpu_milli,
    parse_duration_s,
    parse_gpu_milli,
    parse_memory_mib,
)

#: Named priority classes. Workloads may give a name or an integer.
DEFAULT_PRIORITY_CLASSES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "best-effort": 0,
        "low": 10,
        "batch": 20,
        "normal": 50,
        "high": 100,
        "urgent": 500,
        "critical": 1000,
    }
)

#: Ids and names of things (workloads, queues, nodes): matched in full (a trailing
#: newline is not allowed, as ``$`` would).
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: Engine-clock times (absolute deadlines) are at most this (the year 5138 as epoch
#: seconds; a simulated clock starts at 0).
MAX_TIME: Final = 1e11
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Environment variables a backend sets for every workload (MLWE_* too): a spec may not.
RESERVED_ENV: Final = frozenset({"CUDA_VISIBLE_DEVICES"})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class WorkloadKind(enum.StrEnum):
    FINE_TUNE = "fine-tune"
    TRAINING = "training"
    BATCH_EMBEDDING = "batch-embedding"
    DATA_PROCESSING = "data-processing"
    INFERENCE = "inference"
    OTHER = "other"


class NodeStatus(enum.StrEnum):
    READY = "ready"  # schedulable
    CORDONED = "cordoned"  # runs what it has, takes nothing new
    DOWN = "down"  # lost or failed: nothing runs, nothing placed


def _catalog(info: ValidationInfo) -> GpuCatalog:
    ctx = info.context if isinstance(info.context, dict) else {}
    cat = ctx.get("catalog", DEFAULT_CATALOG)
    assert isinstance(cat, GpuCatalog)
    return cat


def _priority_classes(info: ValidationInfo) -> Mapping[str, int]:
    ctx = info.context if isinstance(info.context, dict) else {}
    classes = ctx.get("priority_classes", DEFAULT_PRIORITY_CLASSES)
    assert isinstance(classes, Mapping)
    return classes


MemoryMiB = Annotated[int, BeforeValidator(parse_memory_mib), Field(ge=0)]
CpuMilli = Annotated[int, BeforeValidator(parse_cpu_milli), Field(ge=0)]
GpuMilli = Annotated[int, BeforeValidator(parse_gpu_milli), Field(ge=0)]
Seconds = Annotated[float, BeforeValidator(parse_duration_s), Field(ge=0)]
PositiveSeconds = Annotated[float, BeforeValidator(parse_duration_s), Field(gt=0)]


def _check_id(v: str | None) -> str | None:
    if v is not None and not _ID.fullmatch(v):
        raise ValueError(
            "must start with a letter or digit and contain only letters, digits, '.', '_' or '-'"
            " (at most 128 characters)"
        )
    return v


class ReplicaResources(BaseModel):
    """Resources of one replica. GPUs are whole (1, 2, 8) or one fraction (< 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    gpu: GpuMilli = 0
    vram: MemoryMiB | None = Field(
        default=None,
        description="VRAM per replica; defaults to the whole memory of the GPUs it gets"
        " (a fraction of a GPU gets that fraction of its memory)",
    )
    cpu: CpuMilli = 1000
    memory: MemoryMiB = 1024

    @field_serializer("gpu", "cpu")
    def _milli(self, v: int) -> str:
        return f"{v}m"  # exact, and reads back to the same integer

    @field_validator("gpu")
    @classmethod
    def _whole_or_fraction(cls, v: int) -> int:
        if v > 1000 and v % 1000:
            raise ValueError("a replica asks for whole GPUs (1, 2, 8) or one fraction below 1")
        if v > 64_000:
            raise ValueError("at most 64 GPUs per replica")
        return v

    @model_validator(mode="after")
    def _nonzero(self) -> ReplicaResources:
        if self.gpu == 0 and self.cpu == 0 and self.memory == 0:
            raise ValueError("a replica must ask for some gpu, cpu or memory")
        if self.vram and not self.gpu:
            raise ValueError("vram asked for without any gpu")
        return self


class GangPlacement(enum.StrEnum):
    PACK = "pack"  # as few nodes as possible (the nodes with the most room first)
    SPREAD = "spread"  # as many nodes as possible (one replica per node, then again)


class GangShape(BaseModel):
    """How a gang's replicas lie on nodes (MPI-style jobs): checked by the control plane.

    ``tasks_per_node``: every node the gang uses holds exactly this many of its
    replicas (the replica count must be a multiple). ``max_replicas_per_node``:
    no node holds more. ``placement``: pack onto few nodes or spread over many
    (a preference the placement honours; the counts are hard rules)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks_per_node: int | None = Field(default=None, ge=1, le=4096)
    max_replicas_per_node: int | None = Field(default=None, ge=1, le=4096)
    placement: GangPlacement = GangPlacement.PACK

    @model_validator(mode="after")
    def _consistent(self) -> GangShape:
        t, m = self.tasks_per_node, self.max_replicas_per_node
        if t is not None and m is not None and m < t:
            raise ValueError(f"max_replicas_per_node ({m}) is less than tasks_per_node ({t})")
        return self

    def per_node_problems(self, counts: Mapping[str, int]) -> list[str]:
        """What a placement with ``counts`` replicas per node breaks of this shape."""
        out = []
        for node, c in sorted(counts.items()):
            if self.tasks_per_node is not None and c != self.tasks_per_node:
                out.append(f"node {node} holds {c} replicas; the gang asks tasks_per_node="
                           f"{self.tasks_per_node}")
            elif self.max_replicas_per_node is not None and c > self.max_replicas_per_node:
                out.append(f"node {node} holds {c} replicas; the gang allows at most"
                           f" max_replicas_per_node={self.max_replicas_per_node}")
        return out


class WorkloadSpec(BaseModel):
    """A workload as the user asks for it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    id: str | None = Field(default=None, description="stable id; assigned on submit when absent")
    name: str = Field(min_length=1, max_length=200)
    kind: WorkloadKind = WorkloadKind.OTHER
    queue: str = "default"
    priority: int = Field(default=50, ge=0, le=1_000_000)
    priority_class: str | None = None
    replicas: int = Field(default=1, ge=1, le=4096)
    gang: GangShape | None = Field(default=None, description="how the replicas lie on nodes")
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    gpu_models: tuple[str, ...] = Field(default=(), description="accepted GPU models; empty = any")
    min_vram_per_gpu: MemoryMiB = 0
    node_selector: dict[str, str] = Field(default_factory=dict)
    estimated_duration: PositiveSeconds | None = None
    deadline: float | None = Field(
        default=None, gt=0, le=MAX_TIME, description="absolute, engine clock seconds"
    )
    deadline_in: PositiveSeconds | None = Field(
        default=None, description="relative deadline, resolved at submission"
    )
    checkpoint_interval: PositiveSeconds | None = None
    checkpoint_cost: Seconds = 0.0
    restart_cost: Seconds = 0.0
    protected: bool = False
    min_runtime: Seconds = 0.0
    min_progress: float = Field(default=0.0, ge=0.0, le=1.0)
    max_retries: int = Field(default=3, ge=0, le=100)
    labels: dict[str, str] = Field(default_factory=dict)
    command: tuple[str, ...] = Field(
        default=(),
        max_length=4096,
        description="program and arguments a real backend runs (an argv, no shell);"
        " empty: nothing to run (the simulator does not need one)",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the program"
    )

    @field_validator("id")
    @classmethod
    def _valid_id(cls, v: str | None) -> str | None:
        return _check_id(v)

    @field_validator("command")
    @classmethod
    def _valid_command(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if v and not v[0].strip():
            raise ValueError("command[0] (the program) must not be empty")
        for i, arg in enumerate(v):
            if "\x00" in arg:
                raise ValueError(f"command[{i}] contains a NUL character")
        return v

    @field_validator("env")
    @classmethod
    def _valid_env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(
                    f"environment variable name {key!r} must be letters, digits and '_',"
                    " not starting with a digit"
                )
            if key in RESERVED_ENV or key.startswith("MLWE_"):
                raise ValueError(f"environment variable {key} is set by the engine; do not set it")
            if "\x00" in value:
                raise ValueError(f"environment variable {key} contains a NUL character")
        return v

    @field_validator("name")
    @classmethod
    def _printable(cls, v: str) -> str:
        if _CONTROL.search(v):
            raise ValueError("must not contain control characters")
        return v

    @field_validator("queue")
    @classmethod
    def _queue_id(cls, v: str) -> str:
        checked = _check_id(v)
        assert checked is not None
        return checked

    @model_validator(mode="before")
    @classmethod
    def _priority_class(cls, data: Any, info: ValidationInfo) -> Any:
        # remember the class name; the priority field itself turns it into an integer
        if (
            isinstance(data, dict)
            and isinstance(data.get("priority"), str)
            and data["priority"] in _priority_classes(info)
            and "priority_class" not in data
        ):
            data = {**data, "priority_class": data["priority"]}
        return data

    @field_validator("priority", mode="before")
    @classmethod
    def _priority_value(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool):
            raise ValueError("priority must be an integer or a priority class name")
        if isinstance(v, str) and not v.strip().lstrip("-").isdigit():
            classes = _priority_classes(info)
            if v not in classes:
                raise ValueError(f"unknown priority class {v!r}; known: {', '.join(classes)}")
            return classes[v]
        return v

    @field_validator("gpu_models")
    @classmethod
    def _known_models(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        cat = _catalog(info)
        unknown = [m for m in v if m not in cat]
        if unknown:
            raise ValueError(
                f"unknown GPU model(s) {', '.join(unknown)}; known: {', '.join(cat.names())}"
            )
        return tuple(dict.fromkeys(v))

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> WorkloadSpec:
        gpu = self.resources.gpu
        if (self.gpu_models or self.min_vram_per_gpu) and not gpu:
            raise ValueError("gpu_models / min_vram_per_gpu given for a workload that asks no GPU")
        if self.deadline is not None and self.deadline_in is not None:
            raise ValueError("give deadline or deadline_in, not both")
        tpn = self.gang.tasks_per_node if self.gang is not None else None
        if tpn is not None and self.replicas % tpn:
            raise ValueError(f"gang.tasks_per_node ({tpn}) must divide replicas ({self.replicas})")
        if self.min_vram_per_gpu:
            cat = _catalog(info)
            pool = self.gpu_models or tuple(cat.names())
            if not any(cat[m].vram_mib >= self.min_vram_per_gpu for m in pool):
                raise ValueError(
                    f"no accepted GPU model has {self.min_vram_per_gpu} MiB of VRAM per GPU"
                )
        if self.resources.vram is not None and gpu:
            cat = _catalog(info)
            pool = self.gpu_models or tuple(cat.names())
            devices = max(1, gpu // 1000)
            if not any(self.resources.vram <= cat[m].vram_mib * devices for m in pool):
                raise ValueError("resources.vram is more than the accepted GPUs have")
        return self

    def replica_request(self) -> Resources:
        """Per-replica request without VRAM (VRAM depends on the GPU model chosen)."""
        r = self.resources
        return Resources(gpu=r.gpu, vram=0, cpu=r.cpu, ram=r.memory)


class NodeSpec(BaseModel):
    """A node of the cluster: a GPU node of one model, or a CPU / high-memory node."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    gpu_model: str | None = None
    gpus: int = Field(default=0, ge=0, le=64)
    cpu: CpuMilli = 32_000
    memory: MemoryMiB = 262_144
    labels: dict[str, str] = Field(default_factory=dict)
    status: NodeStatus = NodeStatus.READY

    @field_serializer("cpu")
    def _milli(self, v: int) -> str:
        return f"{v}m"

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        checked = _check_id(v)
        assert checked is not None
        return checked

    @model_validator(mode="after")
    def _model_matches(self, info: ValidationInfo) -> NodeSpec:
        if self.gpus and not self.gpu_model:
            raise ValueError("a node with gpus needs a gpu_model")
        if self.gpu_model and not self.gpus:
            raise ValueError("gpu_model given for a node with 0 gpus")
        if self.gpu_model and self.gpu_model not in _catalog(info):
            raise ValueError(
                f"unknown GPU model {self.gpu_model!r}; known: {', '.join(_catalog(info).names())}"
            )
        if self.cpu <= 0:
            raise ValueError("a node needs some cpu")
        return self


class QueueSpec(BaseModel):
    """A queue (team): nominal quota per resource, borrowing within a cohort.

    Resources left out of ``nominal`` are not limited. ``borrowing_limit``
    caps how far above nominal the queue may go using its cohort's idle quota.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    cohort: str | None = None
    nominal: ReplicaQuota | None = None
    borrowing_limit: ReplicaQuota | None = None
    weight: float = Field(default=1.0, gt=0, le=1e6)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        checked = _check_id(v)
        assert checked is not None
        return checked

    def nominal_vector(self) -> Resources:
        return (self.nominal or ReplicaQuota()).vector()

    def borrow_vector(self) -> Resources:
        if self.cohort is None:
            return Resources()
        return (self.borrowing_limit or ReplicaQuota()).vector()


class ReplicaQuota(BaseModel):
    """A quota vector; a resource left out is unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_serializer("gpu", "cpu")
    def _milli(self, v: int | None) -> str | None:
        return None if v is None else f"{v}m"

    gpu: GpuMilli | None = None
    vram: MemoryMiB | None = None
    cpu: CpuMilli | None = None
    memory: MemoryMiB | None = None

    def vector(self) -> Resources:
        def q(v: int | None) -> int:
            return UNLIMITED if v is None else v

        return Resources(q(self.gpu), q(self.vram), q(self.cpu), q(self.memory))


class ClusterSpec(BaseModel):
    """Nodes (explicit, or ``pools`` of identical nodes) and queues."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    nodes: tuple[NodeSpec, ...] = ()
    pools: tuple[NodePool, ...] = ()
    queues: tuple[QueueSpec, ...] = ()

    def all_nodes(self) -> list[NodeSpec]:
        out = list(self.nodes)
        for pool in self.pools:
            for i in range(pool.count):
                # the pool was validated (with its catalogue); its nodes need not be again
                out.append(
                    NodeSpec.model_construct(
                        name=f"{pool.prefix}-{i}",
                        gpu_model=pool.gpu_model,
                        gpus=pool.gpus,
                        cpu=pool.cpu,
                        memory=pool.memory,
                        labels=dict(pool.labels),
                        status=NodeStatus.READY,
                    )
                )
        return out

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        names = [n.name for n in self.all_nodes()]
        dup = (
            sorted({n for n in names if names.count(n) > 1})
            if len(set(names)) != len(names)
            else []
        )
        if dup:
            raise ValueError(f"duplicate node names: {', '.join(dup[:10])}")
        qnames = [q.name for q in self.queues]
        if len(set(qnames)) != len(qnames):
            raise ValueError("duplicate queue names")
        return self


class NodePool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    prefix: str

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, v: str) -> str:
        checked = _check_id(f"{v}-0")
        assert checked is not None
        return v

    @field_serializer("cpu")
    def _milli(self, v: int) -> str:
        return f"{v}m"
    count: int = Field(ge=1, le=100_000)
    gpu_model: str | None = None
    gpus: int = Field(default=0, ge=0, le=64)
    cpu: CpuMilli = 32_000
    memory: MemoryMiB = 262_144
    labels: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _model_matches(self, info: ValidationInfo) -> NodePool:
        if bool(self.gpus) != bool(self.gpu_model):
            raise ValueError("gpus and gpu_model go together")
        if self.gpu_model and self.gpu_model not in _catalog(info):
            raise ValueError(f"unknown GPU model {self.gpu_model!r}")
        return self


QueueSpec.model_rebuild()
ClusterSpec.model_rebuild()
