"""A background workload generator, so a fresh ``mlwe serve`` has a living cluster to show.

It submits a realistic mix (fine-tunes and gang training runs on A100/H100,
batch embedding and inference slices on T4, CPU data processing on
high-memory nodes), some with deadlines, through ``Engine.submit`` like any
client. It keeps the queue short: it submits only while fewer than
``max_pending`` workloads wait, so the cluster stays busy without piling up.
Seeded: the same seed gives the same sequence of specs.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
from typing import Any

from mlwe.core.lifecycle import QUEUED
from mlwe.core.spec import WorkloadSpec
from mlwe.runtime.engine import Engine

log = logging.getLogger("mlwe.generator")

_ADJ = ("amber", "brisk", "cobalt", "dusky", "ember", "frosty", "gilded", "hazel", "indigo", "jade")
_NOUN = ("otter", "falcon", "lynx", "heron", "badger", "marten", "ibis", "wren", "yak", "viper")


def _name(rng: random.Random, kind: str) -> str:
    return f"{kind}-{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"


def process_spec(rng: random.Random, seq: int) -> dict[str, Any]:
    """A small workload that runs a real program (``mlwe.programs.synthetic``), for the
    local and Ray backends: seconds of real CPU work, a little resident memory, a loss curve."""
    work = rng.choice((20, 40, 60, 90))
    gpu = rng.random() < 0.5
    kind = rng.choice(("fine-tune", "training")) if gpu else "data-processing"
    spec: dict[str, Any] = {
        "id": f"gen-{seq:05d}",
        "kind": kind,
        "priority": rng.choice(("batch", "normal", "normal", "high")),
        "resources": {"cpu": "250m", "memory": "128Mi", **({"gpu": 1} if gpu else {})},
        "estimated_duration": f"{work}s",
        "checkpoint_interval": "10s",
        "command": [
            sys.executable, "-m", "mlwe.programs.synthetic", "--work", str(work),
            "--memory", "32Mi", "--phases", "0.3:1,0.1:1", "--checkpoint-every", "10",
        ],
        "labels": {"generator": "mlwe-serve"},
    }
    spec["name"] = _name(rng, kind)
    return spec


def random_spec(rng: random.Random, models: set[str], seq: int) -> dict[str, Any]:
    """One workload spec (a dict) of a realistic mix, for the GPU models present."""
    big = sorted(m for m in models if m.startswith(("A100", "H100")))
    small = sorted(m for m in models if m.startswith(("T4", "L4", "A10")))
    roll = rng.random()
    wid = f"gen-{seq:05d}"
    if roll < 0.30 and big:
        gpus = rng.choice((1, 2, 2, 4, 4, 8))
        spec: dict[str, Any] = {
            "kind": "fine-tune",
            "priority": rng.choice(("normal", "normal", "high", "batch")),
            "resources": {"gpu": gpus, "cpu": 4 * gpus, "memory": f"{24 * gpus}Gi"},
            "gpu_models": big,
            "estimated_duration": rng.choice(("3m", "5m", "8m", "12m")),
            "checkpoint_interval": "1m",
            "restart_cost": "10s",
        }
        if rng.random() < 0.3:
            spec["deadline_in"] = rng.choice(("15m", "25m", "40m"))
    elif roll < 0.45 and big:
        spec = {
            "kind": "training",
            "priority": rng.choice(("normal", "batch")),
            "replicas": 2,
            "resources": {"gpu": 4, "cpu": 16, "memory": "96Gi"},
            "gpu_models": big,
            "estimated_duration": rng.choice(("6m", "10m", "15m")),
            "checkpoint_interval": "2m",
            "restart_cost": "20s",
        }
    elif roll < 0.65 and small:
        spec = {
            "kind": "batch-embedding",
            "priority": rng.choice(("batch", "low", "normal")),
            "resources": {"gpu": rng.choice((1, "500m")), "cpu": 4, "memory": "16Gi"},
            "gpu_models": small,
            "estimated_duration": rng.choice(("2m", "4m", "6m")),
            "checkpoint_interval": "1m",
        }
    elif roll < 0.78 and small:
        spec = {
            "kind": "inference",
            "priority": "high",
            "resources": {"gpu": "250m", "cpu": 2, "memory": "8Gi"},
            "gpu_models": small,
            "estimated_duration": rng.choice(("5m", "10m")),
        }
    else:
        spec = {
            "kind": "data-processing",
            "priority": rng.choice(("batch", "low")),
            "resources": {"cpu": rng.choice((8, 16, 32)), "memory": rng.choice(("64Gi", "256Gi", "512Gi"))},
            "estimated_duration": rng.choice(("2m", "5m", "9m")),
        }
    spec["id"] = wid
    spec["name"] = _name(rng, spec["kind"])
    spec["labels"] = {"generator": "mlwe-serve"}
    return spec


class WorkloadGenerator:
    def __init__(
        self,
        engine: Engine,
        *,
        seed: int = 0,
        period_s: float = 2.0,
        max_pending: int = 6,
        actor: str = "generator",
        real_processes: bool = False,
    ) -> None:
        self.real_processes = real_processes
        self.engine = engine
        self.rng = random.Random(seed)
        self.period_s = period_s
        self.max_pending = max_pending
        self.actor = actor
        self.submitted = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0

    def step(self) -> str | None:
        """Submit one workload if the queue is short; returns its id."""
        eng = self.engine
        with eng.lock:
            waiting = sum(1 for wid in eng.reads.queued if eng.reads.workloads[wid].state in QUEUED)
            models = set(eng.reads.capacity.models()) - {""}
            taken = set(eng.reads.workloads)
        if waiting >= self.max_pending:
            return None
        self._seq += 1
        while f"gen-{self._seq:05d}" in taken:  # a restarted server continues the sequence
            self._seq += 1
        data = (
            process_spec(self.rng, self._seq)
            if self.real_processes
            else random_spec(self.rng, models, self._seq)
        )
        spec = WorkloadSpec.model_validate(data, context={"catalog": eng.reads.catalog})
        result = eng.submit([spec], actor=self.actor)
        if not result.accepted:
            log.warning("generator: %s refused: %s", spec.id, "; ".join(result.reasons()))
            return None
        self.submitted += 1
        return result.created[0]

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.period_s * (0.5 + self.rng.random())):
                try:
                    self.step()
                except Exception:
                    log.exception("generator step failed")

        self._thread = threading.Thread(target=loop, name="mlwe-generator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
