"""What runs in each Slurm task: one replica's program, and its reports written to a file.

``python -m mlwe.backends.slurm.task ATTEMPT_DIR`` is the command ``srun``
launches for every task of an attempt's job. ``ATTEMPT_DIR`` (on storage the
engine and the nodes share, as checkpoints are) holds ``meta.json``, written
by the engine before ``sbatch``. The task:

- finds its replica index from where Slurm put it: ``meta["replicas"]`` maps
  node name -> replica indices, indexed by ``SLURM_LOCALID`` on ``SLURMD_NODENAME``;
- runs the workload's command as a process tree of its own
  (:class:`mlwe.backends.ray.runner.ReplicaProcess`, which imports nothing from
  Ray) with the environment every backend gives (``MLWE_WORKLOAD_ID``,
  ``MLWE_ATTEMPT``, ``MLWE_REPLICA``, ``MLWE_CHECKPOINT_DIR``,
  ``MLWE_REPORT_FD``, ``MLWE_RESUME_WORK_S``, ``CUDA_VISIBLE_DEVICES``: the
  task's share of the GPUs Slurm gave the job on this node);
- appends JSON lines to ``r<replica>.jsonl``: ``started`` (pid), ``report``
  (what the :mod:`mlwe.workload` helper sent), ``sample`` (CPU and RSS of the
  tree), ``exited`` (code, signal, checkpoint, stop time). The engine tails
  these files, so reports survive an engine restart;
- on SIGTERM (``scancel --signal=TERM``, the engine's graceful stop) it stops
  the program within the grace the engine wrote to ``stop.json`` (default
  ``meta["default_grace_s"]``): SIGTERM to the tree, wait, SIGKILL; the
  engine's ``scancel`` after the grace period is the backstop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mlwe.backends.ray.runner import EXIT_START_FAILED, ReplicaProcess, StartError

REPORT_FLUSH_S = 0.1


class _Out:
    """The replica's record file: one JSON object per line, each written with one write."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lock = threading.Lock()

    def write(self, kind: str, **data: Any) -> None:
        line = json.dumps({"type": kind, "t": time.time(), **data}, separators=(",", ":"))
        with self.lock:
            os.write(self.fd, (line + "\n").encode())


def replica_index(meta: dict[str, Any], env: dict[str, str]) -> int:
    """This task's replica index: the ``SLURM_LOCALID``-th index placed on this node."""
    node = env.get("SLURMD_NODENAME", "")
    local = int(env.get("SLURM_LOCALID", "0"))
    indices = meta["replicas"].get(node)
    if not indices or local >= len(indices):
        raise LookupError(f"no replica of {meta['workload']} attempt {meta['attempt']} is placed"
                          f" as task {local} on node {node!r} (placement: {meta['replicas']})")
    return int(indices[local])


def gpu_share(meta: dict[str, Any], env: dict[str, str], index: int) -> str:
    """The GPUs this replica may use: its slice of those Slurm gave the job on this node."""
    per = int(meta["gpus_per_replica"])
    if per <= 0:
        return ""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    node_indices = meta["replicas"][env.get("SLURMD_NODENAME", "")]
    k = node_indices.index(index)
    return ",".join(visible[k * per:(k + 1) * per])


def task_env(meta: dict[str, Any], env_in: dict[str, str], adir: Path, index: int
             ) -> dict[str, str]:
    """The program's environment: the task's (less its ``MLWE_*``), the workload's own, and
    the ``MLWE_*`` variables that tell the program who it is."""
    node = env_in.get("SLURMD_NODENAME", "")
    env = {k: v for k, v in env_in.items() if not k.startswith("MLWE_")}
    python_dir = os.path.dirname(sys.executable)
    env["PATH"] = python_dir + os.pathsep + env.get("PATH", os.defpath)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({str(k): str(v) for k, v in (meta.get("env") or {}).items()})
    ckpt = meta.get("checkpoint_dir") or str(adir / "checkpoint")
    env.update(
        MLWE_WORKLOAD_ID=str(meta["workload"]),
        MLWE_ATTEMPT=str(meta["attempt"]),
        MLWE_REPLICA=str(index),
        MLWE_REPLICAS=str(meta["total"]),
        MLWE_NODE=node,
        MLWE_CHECKPOINT_DIR=ckpt,
        MLWE_RESUME_WORK_S=str(float(meta.get("resume_work_s", 0.0))),
        CUDA_VISIBLE_DEVICES=gpu_share(meta, env_in, index),
    )
    if "OMP_NUM_THREADS" not in (meta.get("env") or {}):
        env["OMP_NUM_THREADS"] = str(max(1, int(meta.get("cpus_per_replica", 1))))
    return env


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mlwe.backends.slurm.task ATTEMPT_DIR", file=sys.stderr)
        return 2
    adir = Path(argv[0])
    meta = json.loads((adir / "meta.json").read_text())
    env_in = dict(os.environ)
    index = replica_index(meta, env_in)
    out = _Out(adir / f"r{index}.jsonl")
    node = env_in.get("SLURMD_NODENAME", "")
    env = task_env(meta, env_in, adir, index)
    term = threading.Event()
    term_at: list[float] = []

    def on_term(*_: Any) -> None:
        term_at.append(time.monotonic())
        term.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    proc = ReplicaProcess(meta["command"], env, log_path=str(adir / f"r{index}.log"))
    try:
        pid = proc.start()
    except StartError as exc:
        out.write("exited", replica=index, node=node, code=exc.exit_code,
                  cause=f"start-failed: {exc}")
        return exc.exit_code
    except Exception as exc:  # anything else that stops the start: say it, with its code
        out.write("exited", replica=index, node=node, code=EXIT_START_FAILED,
                  cause=f"start-failed: {type(exc).__name__}: {exc}")
        return EXIT_START_FAILED
    out.write("started", replica=index, node=node, pid=pid)
    telemetry_s = float(meta.get("telemetry_s", 1.0))
    next_sample = time.monotonic() + telemetry_s
    stop_result: dict[str, Any] = {}
    stopper: threading.Thread | None = None

    def stop() -> None:
        grace = float(meta.get("default_grace_s", 10.0))
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            grace = float(json.loads((adir / "stop.json").read_text())["grace_s"])
        r = proc.stop(max(0.0, grace))
        stop_result.update(forced=r.forced, stop_s=round(r.stop_s, 4))

    while proc.wait(REPORT_FLUSH_S) is None:
        if term.is_set() and stopper is None:
            stopper = threading.Thread(target=stop, daemon=True)
            stopper.start()
        for r in proc.drain_reports():
            out.write("report", replica=index, data=r)
        if time.monotonic() >= next_sample:
            next_sample += telemetry_s
            out.write("sample", replica=index, node=node, metrics=proc.sample())
    if stopper is not None:
        stopper.join(30)
    if term_at and "stop_s" not in stop_result:
        # Slurm signals every process of the step: the program may have exited on its
        # own SIGTERM before the stopper ran
        stop_result.update(forced=False, stop_s=round(time.monotonic() - term_at[0], 4))
    proc.finish_reports()
    for r in proc.drain_reports():
        out.write("report", replica=index, data=r)
    code = proc.exit_code if proc.exit_code is not None else -1
    out.write("exited", replica=index, node=node, code=code, signal=proc.killed_by,
              checkpoint=proc.checkpoint_progress, stopped=term.is_set(), **stop_result)
    return code if 0 <= code < 256 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
