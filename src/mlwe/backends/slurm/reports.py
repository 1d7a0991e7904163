"""The Slurm backend's reading of the replicas' record files (shared storage).

Each task appends its replica's records to ``r<index>.jsonl`` in the attempt's
directory: started, the program's reports, CPU/RSS samples, exit. They are
tailed here: ``Started`` once every replica's program runs, ``Progress`` from
replica 0's reports, telemetry from the reports and samples.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, TypeGuard

from mlwe.backends.slurm.state import _Attempt, _Replica, _SlurmState
from mlwe.core.actions import Progress, Started
from mlwe.core.backend import Telemetry


class _Reports(_SlurmState):
    """Tailing the record files and turning records into facts and telemetry."""

    def _read_files(self, att: _Attempt) -> None:
        for r in att.replicas.values():
            path = att.dir / f"r{r.index}.jsonl"
            try:
                with open(path, "rb") as f:
                    f.seek(r.offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            r.offset += len(data)
            data = r.partial + data
            lines = data.split(b"\n")
            r.partial = lines.pop()
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    self._on_record(att, r, rec)

    def _on_record(self, att: _Attempt, r: _Replica, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "started":
            r.started = True
            if not att.started_emitted and all(x.started for x in att.replicas.values()):
                att.started_emitted = True
                att.started_s = time.monotonic() - att.submitted_at
                if not att.adopted:
                    self._emit(Started(att.workload, att.attempt), att.correlation_id)
                if att.pending_progress is not None:
                    p, ck = att.pending_progress
                    att.pending_progress = None
                    self._progress(att, p, ck)
        elif kind == "report":
            self._on_report(att, r, rec.get("data"))
        elif kind == "sample":
            m = rec.get("metrics")
            if isinstance(m, dict):
                metrics = {k: float(v) for k, v in m.items()
                           if isinstance(v, int | float) and not isinstance(v, bool)}
                metrics["replica"] = float(r.index)
                metrics["attempt"] = float(att.attempt)
                declared: tuple[str, ...] = ()
                if att.gpus_per_replica:
                    metrics["gpus"] = float(att.gpus_per_replica)
                    declared = ("gpus",)
                self._telemetry.append(Telemetry(self.clock.now(), r.node, att.workload,
                                                 metrics, declared))
        elif kind == "exited":
            r.exit = rec
            saved = rec.get("checkpoint")
            if r.index == 0 and _fraction(saved):
                att.checkpoint = float(saved)
            s = rec.get("stop_s")
            if isinstance(s, int | float):
                att.stop_wait_s = max(att.stop_wait_s or 0.0, float(s))
            self._next_squeue = 0.0

    def _on_report(self, att: _Attempt, r: _Replica, data: Any) -> None:
        if not isinstance(data, dict):
            return
        p = data.get("progress")
        ckpt = bool(data.get("checkpoint"))
        if r.index == 0 and _fraction(p):
            if ckpt:
                att.checkpoint = float(p)
            if not att.final and not att.adopted:
                if att.started_emitted:
                    self._progress(att, float(p), ckpt)
                elif att.pending_progress is None or ckpt or not att.pending_progress[1]:
                    att.pending_progress = (float(p), ckpt)
        metrics: dict[str, float] = {}
        raw = data.get("metrics")
        if isinstance(raw, dict):
            metrics.update({str(k): float(v) for k, v in raw.items()
                            if isinstance(v, int | float) and not isinstance(v, bool)
                            and math.isfinite(v)})
        for k in ("loss", "step", "progress"):
            v = data.get(k)
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics[k] = float(v)
        if ckpt:
            metrics["checkpoint"] = 1.0
        if metrics and not att.adopted:
            metrics["replica"] = float(r.index)
            metrics["attempt"] = float(att.attempt)
            self._telemetry.append(Telemetry(self.clock.now(), r.node, att.workload, metrics))

    def _progress(self, att: _Attempt, p: float, checkpointed: bool) -> None:
        last = att.last_progress
        if not checkpointed and last is not None and (
            p == last or (p < 1.0 and abs(p - last) < self.config.progress_step)
        ):
            return
        att.last_progress = p
        self._emit(Progress(att.workload, att.attempt, p, checkpointed=checkpointed),
                   att.correlation_id)

    @staticmethod
    def _failed_replica(att: _Attempt) -> _Replica | None:
        fails = [r for r in att.replicas.values()
                 if r.exit is not None and not r.exit.get("stopped")
                 and (r.exit.get("code") != 0 or str(r.exit.get("cause") or ""))]
        return min(fails, key=lambda r: float(r.exit.get("t", 0.0) if r.exit else 0.0),
                   default=None)

def _fraction(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0

