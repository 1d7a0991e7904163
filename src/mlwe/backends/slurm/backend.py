"""SlurmBackend: the Backend protocol over an existing Slurm cluster.

The control plane decides admission, placement and preemption; Slurm executes:

- **Placement -> one job per attempt.** A gang is one job pinned to the nodes the
  control plane chose: ``--nodelist`` with ``--nodes``, ``--ntasks-per-node`` (the
  replicas on each node), ``--cpus-per-task``, ``--mem`` (per node) and
  ``--gres=gpu:<type>:N`` (the node's own GRES type name, as Slurm reports it).
  When the replicas per node (or the GPU type) differ between nodes, the job is
  a heterogeneous job, one component per group of alike nodes: still one job,
  started whole or not at all. The batch script runs one ``srun`` step whose
  tasks are :mod:`mlwe.backends.slurm.task` wrappers, one per replica.
- **Reports through shared files.** Each task appends its replica's records
  (started, the program's reports, CPU/RSS samples, exit) to a file in the
  attempt's directory under ``run_dir`` (shared storage, as checkpoints are);
  this backend tails them. ``Started`` comes once every replica's program runs;
  ``Progress`` from replica 0's reports; telemetry from the reports, the samples
  and, per node, Slurm's node record (load, memory, allocated CPUs).
- **Stopping.** A stop writes the grace to ``stop.json``, sends
  ``scancel --signal=TERM`` (to the job's steps: the wrappers pass SIGTERM to
  the programs, which checkpoint and exit), and after ``grace_s``, if the job
  still runs, ``scancel --signal=KILL --full`` then ``scancel``. ``Released``
  is reported only once Slurm itself says the job is over (a terminal state,
  not COMPLETING: its nodes are free again), with the last checkpoint's progress.
- **Exits.** When the job reaches a terminal state by itself: the first replica
  that failed decides the code and cause (``srun --kill-on-bad-exit`` ends the
  rest of a broken gang; this backend also cancels the job), OUT_OF_MEMORY is
  ``oom``, a job that vanished or was cancelled outside mlwe is an error.
- **Nodes.** Slurm's node table (``scontrol --json show nodes``, ``sinfo --json``
  on 22.05, else ``scontrol -o show nodes``) is read every ``node_period_s``; a
  node that is DOWN / FAIL / ... (or NOT_RESPONDING for ``not_responding_s``:
  one missed ping of a busy slurmd is no loss) becomes ``NodeDown`` (its
  attempts are cancelled: the control plane fails them as node-lost), one that
  comes back ``NodeUp``. :func:`discover_cluster` builds a ClusterSpec from it.
- **Restarts.** Jobs carry a ``--comment`` naming this engine's prefix, the
  workload and the attempt; :meth:`SlurmBackend.inventory` lists those still
  running and adopts them (their files are read from the start again).

Slurm is asked from one thread of the backend's own (commands are queued by
:meth:`send`), so the engine's loop never waits for a Slurm command.
``squeue`` runs every ``squeue_fast_s`` while an attempt waits on Slurm (a
start, a stop, an exit to confirm), every ``squeue_slow_s`` otherwise.

Its parts: the options (:mod:`.config`), the bookkeeping (:mod:`.state`), the
job's comment, components, files and arguments (:mod:`.jobs`), the record
files (:mod:`.reports`), the nodes (:mod:`.nodes`) and :func:`discover_cluster`
(:mod:`.discovery`); this module is :class:`SlurmBackend` itself: the protocol,
its thread, submitting, stopping and Slurm's view of the jobs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlwe.backends.common import WallClock
from mlwe.backends.slurm.commands import SlurmCommands, SlurmError, SlurmJobInfo
from mlwe.backends.slurm.config import SlurmBackendConfig
from mlwe.backends.slurm.discovery import discover_cluster, gpu_model_of
from mlwe.backends.slurm.jobs import (
    _write_json,
    comment_of,
    job_components,
    parse_comment,
    sbatch_args,
    write_job_script,
)
from mlwe.backends.slurm.nodes import _NodeWatch
from mlwe.backends.slurm.state import EXIT_START_FAILED, _Attempt, _Replica, log
from mlwe.core.actions import Exited, Released
from mlwe.core.backend import (
    Command,
    Event,
    RunningAttempt,
    StartCommand,
    StopCommand,
    Telemetry,
    dispatch,
)
from mlwe.core.clock import Clock
from mlwe.core.spec import ClusterSpec

__all__ = [  # what other modules import from here
    "SlurmBackend", "SlurmBackendConfig", "comment_of", "discover_cluster", "gpu_model_of",
    "job_components", "parse_comment",
]


class SlurmBackend(_NodeWatch):
    """The Backend protocol over Slurm (see the module docstring)."""

    name = "slurm"

    def __init__(self, cluster: ClusterSpec, config: SlurmBackendConfig | None = None, *,
                 clock: Clock | None = None, commands: SlurmCommands | None = None) -> None:
        self.cluster = cluster
        self.config = cfg = config or SlurmBackendConfig()
        self.clock: Clock = clock or WallClock()
        self.slurm = commands or SlurmCommands(slurm_conf=cfg.slurm_conf, bin_dir=cfg.bin_dir,
                                               timeout_s=cfg.command_timeout_s)
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="mlwe-slurm-")).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = Path(cfg.checkpoint_root or self.run_dir / "checkpoints").resolve()
        self._iid = uuid.uuid4().hex[:8]
        self._n = itertools.count(1)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self.event_listeners: list[Callable[[], None]] = []
        self._events: list[Event] = []
        self._telemetry: deque[Telemetry] = deque(maxlen=200_000)
        self._seen: set[str] = set()
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._work: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.errors: deque[str] = deque(maxlen=1000)
        self._specs = {n.name: n for n in cluster.all_nodes()}
        self._down: dict[str, bool] = dict.fromkeys(self._specs, False)
        self._gres: dict[str, str] = {}
        self._not_responding: dict[str, float] = {}  # node -> when first seen so (monotonic)
        self._next_squeue = 0.0
        self._next_nodes = 0.0
        self._closed = False
        self.squeue_calls = 0
        nodes = self.slurm.nodes()  # fails here, with Slurm's error, if Slurm is not reachable
        problems = self._check_nodes(nodes)
        if problems:
            raise ValueError("the cluster spec does not match Slurm: " + "; ".join(problems))
        self._on_nodes(nodes)
        self._next_nodes = time.monotonic() + cfg.node_period_s
        self._thread = threading.Thread(target=self._loop, name="mlwe-slurm", daemon=True)
        self._thread.start()

    # ================================================================ protocol
    def send(self, commands: Sequence[Command]) -> None:
        with self._lock:
            dispatch(commands, self._seen, self._start, self._stop)

    def poll(self) -> list[Event]:
        with self._lock:
            out, self._events = self._events, []
            self._wake.clear()
            return out

    def drain_telemetry(self) -> list[Telemetry]:
        with self._lock:
            out = list(self._telemetry)
            self._telemetry.clear()
            return out

    def inventory(self) -> list[RunningAttempt]:
        """This engine's jobs (by prefix) that Slurm still runs; each is adopted."""
        jobs = self.slurm.jobs()
        by_leader: dict[int, list[SlurmJobInfo]] = {}
        for j in jobs:
            by_leader.setdefault(j.leader, []).append(j)
        out = []
        with self._lock:
            for leader, comps in by_leader.items():
                if all(c.terminal for c in comps):
                    continue
                parsed = next((p for c in comps if (p := parse_comment(c.comment,
                                                                       self.config.prefix))), None)
                if parsed is None:
                    continue
                wid, attempt, adir = parsed
                att = self._attempts.get((wid, attempt))
                if att is None:
                    att = self._adopt(wid, attempt, adir, leader)
                    if att is None:
                        continue
                att.slurm = comps
                att.seen_in_squeue = True
                if not att.final:
                    out.append(RunningAttempt(wid, attempt, att.nodes))
        return out

    def close(self) -> None:
        """Cancel every job this backend runs, wait (briefly) for Slurm to confirm, stop."""
        with self._lock:
            if self._closed:
                return
            live = [a for a in self._attempts.values() if not a.final and a.job_id is not None]
        for a in live:
            with contextlib.suppress(SlurmError):
                self.slurm.scancel(a.job_id or 0)
        end = time.monotonic() + 10.0
        while live and time.monotonic() < end:
            with self._lock:
                if all(a.final for a in live):
                    break
            time.sleep(0.05)
        self.detach()

    def detach(self) -> None:
        """Stop watching without stopping anything: the jobs keep running and the next
        engine with the same prefix adopts them through :meth:`inventory`."""
        with self._lock:
            self._closed = True
        self._work.put(("wake", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # ========================================================== engine helpers
    def wait(self, timeout: float) -> bool:
        """Block until an event is ready to poll (or ``timeout``)."""
        return self._wake.wait(timeout)

    def attempt_info(self, workload: str, attempt: int) -> dict[str, Any] | None:
        with self._lock:
            a = self._attempts.get((workload, attempt))
            if a is None:
                return None
            return {"job_id": a.job_id, "nodes": list(a.nodes), "started_s": a.started_s,
                    "stop_wait_s": a.stop_wait_s, "forced": a.forced, "final": a.final,
                    "slurm_states": [j.state for j in a.slurm], "dir": str(a.dir)}

    # ================================================================ commands
    def _start(self, c: StartCommand) -> None:
        key = (c.workload, c.attempt)
        if key in self._attempts:
            return
        adir = self.run_dir / c.workload / f"a{c.attempt}"
        replicas = {i: _Replica(i, a.node) for i, a in enumerate(c.placement)}
        gpu_milli = c.placement[0].res.gpu if c.placement else 0
        att = _Attempt(c.workload, c.attempt, c.correlation_id, adir, replicas,
                       gpus_per_replica=-(-gpu_milli // 1000))
        self._attempts[key] = att
        down = [n for n in att.nodes if self._down.get(n)]
        if down:
            # the control plane learns (or learnt) of the loss through NodeDown
            att.final = att.lost = True
            return
        self._work.put(("submit", (att, c)))

    def _stop(self, c: StopCommand) -> None:
        att = self._attempts.get((c.workload, c.attempt))
        if att is None:
            self._emit(Released(c.workload, c.attempt), c.correlation_id)  # nothing held
            return
        if att.final:
            return
        if att.stop_requested:
            # a second stop may only shorten the grace
            if att.force_at is not None:
                att.force_at = min(att.force_at, time.monotonic() + max(0.0, c.grace_s))
            return
        att.stop_requested = True
        att.grace_s = max(0.0, c.grace_s)
        self._work.put(("stop", att))

    # ============================================================ the thread
    def _loop(self) -> None:
        cfg = self.config
        while True:
            with self._lock:
                if self._closed:
                    return
            deadline = time.monotonic() + cfg.tick_s
            while True:  # commands first: a start or stop waits for nothing else
                timeout = deadline - time.monotonic()
                try:
                    kind, item = self._work.get(timeout=max(0.0, timeout))
                except queue.Empty:
                    break
                try:
                    if kind == "submit":
                        self._submit(*item)
                    elif kind == "stop":
                        self._signal_stop(item)
                    elif kind == "cancel":
                        self._cancel(item)
                except Exception as exc:  # keep the loop alive; say what failed
                    self._error(f"{kind}: {type(exc).__name__}: {exc}")
                if time.monotonic() >= deadline:
                    break
            try:
                self._tick()
            except Exception as exc:
                self._error(f"slurm backend: {type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            live = [a for a in self._attempts.values() if not a.final and a.job_id is not None]
            for a in live:
                self._read_files(a)
        for a in live:
            if a.force_at is not None and not a.forced and now >= a.force_at:
                self._force(a)
            if (not a.gang_broken and not a.stop_requested and len(a.replicas) > 1
                    and self._failed_replica(a)):
                a.gang_broken = True  # the others of a broken gang would only hang
                self._cancel(a)
        waiting = any(not a.started_emitted or a.stop_requested or a.gang_broken
                      or any(r.exit is not None for r in a.replicas.values()) for a in live)
        if now >= self._next_squeue:
            self._next_squeue = now + (self.config.squeue_fast_s if waiting
                                       else self.config.squeue_slow_s)
            if live:
                self._check_jobs(live)
        elif waiting:
            self._next_squeue = min(self._next_squeue, now + self.config.squeue_fast_s)
        if now >= self._next_nodes:
            self._next_nodes = now + self.config.node_period_s
            try:
                nodes = self.slurm.nodes()
            except SlurmError as exc:
                self._error(f"reading Slurm's nodes: {exc}")
            else:
                with self._lock:
                    self._on_nodes(nodes)

    # ----------------------------------------------------------------- submit
    def _submit(self, att: _Attempt, c: StartCommand) -> None:
        cfg = self.config
        with self._lock:
            if att.stop_requested or att.final:
                if att.stop_requested and not att.final:
                    att.final = True
                    self._emit(Released(att.workload, att.attempt), att.correlation_id)
                return
        res = c.placement[0].res
        cpus = max(1, -(-res.cpu // 1000))
        placement = [(a.node, i) for i, a in enumerate(c.placement)]
        self._prepare_dir(att, c, placement, cpus)
        comps = job_components(placement, att.gpus_per_replica, cpus, res.ram,
                               lambda n: self._gres.get(n, ""))
        script = write_job_script(att.dir, cfg.python, len(comps))
        args = sbatch_args(cfg, c.workload, c.attempt, att.dir, comps, script)
        att.submitted_at = time.monotonic()
        try:
            job_id = self.slurm.sbatch(args)
        except SlurmError as exc:
            with self._lock:
                att.final = True
                self._error(f"{c.workload} attempt {c.attempt}: {exc}")
                if att.stop_requested:
                    self._emit(Released(att.workload, att.attempt), att.correlation_id)
                else:
                    self._emit(Exited(att.workload, att.attempt, EXIT_START_FAILED,
                                      f"start-failed: {exc}"), att.correlation_id)
            return
        with self._lock:
            att.job_id = job_id
        log.info("%s attempt %d: Slurm job %d on %s", c.workload, c.attempt, job_id,
                 ",".join(att.nodes))
        self._next_squeue = 0.0

    def _prepare_dir(self, att: _Attempt, c: StartCommand, placement: list[tuple[str, int]],
                     cpus: int) -> None:
        """The attempt's directory afresh (no records, no stop file of an earlier
        submission), its checkpoint directory, and ``meta.json`` for its tasks."""
        cfg = self.config
        spec = c.spec
        per_node: dict[str, list[int]] = {}
        for node, i in placement:
            per_node.setdefault(node, []).append(i)
        ckpt = self.checkpoint_root / c.workload
        att.dir.mkdir(parents=True, exist_ok=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        for r in att.replicas.values():  # a resubmission of the same attempt starts afresh
            with contextlib.suppress(FileNotFoundError):
                (att.dir / f"r{r.index}.jsonl").unlink()
        with contextlib.suppress(FileNotFoundError):
            (att.dir / "stop.json").unlink()
        meta = {
            "workload": c.workload, "attempt": c.attempt, "total": len(c.placement),
            "replicas": per_node, "nodes": {str(i): n for n, i in placement},
            "gpus_per_replica": att.gpus_per_replica, "cpus_per_replica": cpus,
            "command": list(spec.command), "env": dict(spec.env),
            "checkpoint_dir": str(ckpt), "resume_work_s": c.resume_work_s,
            "telemetry_s": cfg.telemetry_period_s, "default_grace_s": cfg.default_grace_s,
            "correlation_id": c.correlation_id,
        }
        _write_json(att.dir / "meta.json", meta)

    # ------------------------------------------------------------------- stop
    def _signal_stop(self, att: _Attempt) -> None:
        with self._lock:
            if att.final:
                return
            job = att.job_id
            grace = att.grace_s
        if job is None:
            return  # not submitted yet: _submit sees stop_requested and releases
        _write_json(att.dir / "stop.json", {"grace_s": grace})
        if grace <= 0 or not any(r.started for r in att.replicas.values()):
            self._force(att)  # nothing to checkpoint (or no time to): end it now
            return
        self.slurm.scancel(job, signal="TERM")
        with self._lock:
            att.stop_sent = True
            att.force_at = time.monotonic() + grace
        self._next_squeue = 0.0

    def _force(self, att: _Attempt) -> None:
        if att.job_id is None:
            return
        att.forced = True
        self.slurm.scancel(att.job_id, signal="KILL", full=True)
        self.slurm.scancel(att.job_id)
        self._next_squeue = 0.0

    def _cancel(self, att: _Attempt) -> None:
        if att.job_id is not None:
            self.slurm.scancel(att.job_id)
            self._next_squeue = 0.0

    # -------------------------------------------------------------- job state
    def _check_jobs(self, live: list[_Attempt]) -> None:
        try:
            jobs = self.slurm.jobs()
        except SlurmError as exc:
            self._error(f"squeue: {exc}")
            return
        self.squeue_calls += 1
        by_leader: dict[int, list[SlurmJobInfo]] = {}
        for j in jobs:
            by_leader.setdefault(j.leader, []).append(j)
        now = time.monotonic()
        with self._lock:
            for a in live:
                if a.final or a.job_id is None:
                    continue
                comps = by_leader.get(a.job_id, [])
                a.slurm = comps
                if comps:
                    a.seen_in_squeue = True
                elif not a.seen_in_squeue and now - a.submitted_at < 30.0:
                    continue  # not listed yet (a slow controller): look again
                if comps and not all(c.terminal for c in comps):
                    pending = [c for c in comps if c.state == "PENDING"]
                    if (pending and not a.started_emitted and not a.stop_requested
                            and now - a.submitted_at > self.config.start_timeout_s):
                        why = pending[0].reason or "no reason given"
                        self._error(f"{a.workload} attempt {a.attempt}: Slurm kept job"
                                    f" {a.job_id} pending for {self.config.start_timeout_s:g}s"
                                    f" ({why}); cancelled")
                        a.submit_error = f"start-failed: Slurm kept the job pending ({why})"
                        self._work.put(("cancel", a))
                    continue
                self._read_files(a)  # the last lines, written just before the end
                self._settle(a, comps)

    def _settle(self, a: _Attempt, comps: list[SlurmJobInfo]) -> None:
        """The job is over in Slurm's own view: report the attempt's end, once."""
        a.final = True
        if a.lost:
            return
        if a.stop_requested:
            self._emit(Released(a.workload, a.attempt, checkpointed_progress=a.checkpoint),
                       a.correlation_id)
            return
        states = {c.state for c in comps}
        failed = self._failed_replica(a)
        if a.submit_error is not None:
            self._emit(Exited(a.workload, a.attempt, EXIT_START_FAILED, a.submit_error),
                       a.correlation_id)
        elif "NODE_FAIL" in states:
            self._emit(Exited(a.workload, a.attempt, -1, "node-lost"), a.correlation_id)
        elif "OUT_OF_MEMORY" in states:
            self._emit(Exited(a.workload, a.attempt, -1, "oom"), a.correlation_id)
        elif failed is not None and failed.exit is not None:
            code = failed.exit.get("code")
            cause = str(failed.exit.get("cause") or "error")
            self._emit(Exited(a.workload, a.attempt, code if isinstance(code, int) else -1,
                              cause), a.correlation_id)
        elif (states <= {"COMPLETED"} and comps
              and all(r.exit is not None and r.exit.get("code") == 0
                      for r in a.replicas.values())):
            self._emit(Exited(a.workload, a.attempt, 0), a.correlation_id)
        else:
            what = "+".join(sorted(states)) if states else "gone from squeue"
            code = next((c.exit_code for c in comps if c.exit_code), None)
            self._emit(Exited(a.workload, a.attempt, code if code is not None else -1,
                              f"error: the Slurm job ended {what} without every replica's"
                              " exit"), a.correlation_id)

    # --------------------------------------------------------------- adoption
    def _adopt(self, wid: str, attempt: int, adir: Path, job_id: int) -> _Attempt | None:
        try:
            meta = json.loads((adir / "meta.json").read_text())
        except (OSError, ValueError) as exc:
            self._error(f"cannot adopt Slurm job {job_id} ({wid} attempt {attempt}): {exc}")
            return None
        nodes = meta.get("nodes") or {}
        replicas = {int(i): _Replica(int(i), str(n)) for i, n in nodes.items()}
        att = _Attempt(wid, attempt, meta.get("correlation_id"), adir, replicas,
                       gpus_per_replica=int(meta.get("gpus_per_replica", 0)), job_id=job_id,
                       submitted_at=time.monotonic(), started_emitted=True, adopted=True)
        self._attempts[(wid, attempt)] = att
        self._read_files(att)  # catch up (checkpoint, exits) without replaying events
        att.adopted = False  # from now on, like any other attempt
        att.started_emitted = True
        return att

