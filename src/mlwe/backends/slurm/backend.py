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
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import queue
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeGuard

from mlwe.backends.slurm.commands import (
    DOWN_NODE_STATES,
    SlurmCommands,
    SlurmError,
    SlurmJobInfo,
    SlurmNodeInfo,
)
from mlwe.core.actions import Exited, Progress, Released, Started
from mlwe.core.backend import (
    Command,
    Event,
    Fact,
    NodeDown,
    NodeUp,
    RunningAttempt,
    StartCommand,
    StopCommand,
    Telemetry,
    dispatch,
)
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.spec import ClusterSpec, NodeSpec

log = logging.getLogger("mlwe.slurm")

COMMENT_KEY = "mlwe"
EXIT_START_FAILED = 125


class _Clock(Protocol):
    def now(self) -> float: ...


class _EpochClock:
    def now(self) -> float:
        return time.time()


@dataclass
class SlurmBackendConfig:
    """How the Slurm backend reaches Slurm and behaves (figures in seconds)."""

    prefix: str = "mlwe"  # this engine's jobs: --comment {"mlwe": prefix, ...}
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    run_dir: str | None = None  # shared by engine and nodes: scripts, reports, logs
    checkpoint_root: str | None = None  # shared; default <run_dir>/checkpoints
    python: str = sys.executable  # the Python (with mlwe) the tasks run under
    slurm_conf: str | None = None  # SLURM_CONF for the commands; None: Slurm's default
    bin_dir: str | None = None  # where sbatch & co live; None: PATH
    command_timeout_s: float = 30.0
    tick_s: float = 0.05  # how often the report files are read
    squeue_fast_s: float = 0.2
    squeue_slow_s: float = 2.0
    node_period_s: float = 1.0
    #: a node Slurm flags NOT_RESPONDING (a missed ping, often a busy slurmd) is lost only
    #: once the flag lasts this long, or when Slurm itself sets it DOWN
    not_responding_s: float = 5.0
    telemetry_period_s: float = 1.0  # the tasks' CPU/RSS samples
    start_timeout_s: float = 300.0  # a job Slurm keeps pending longer fails to start
    stop_margin_s: float = 10.0  # after the force: Slurm must have ended the job by then
    default_grace_s: float = 10.0  # for a SIGTERM that did not come from this engine
    progress_step: float = 0.0  # progress is reported when it moved this much (or checkpointed)
    extra_sbatch: tuple[str, ...] = ()  # e.g. ("--qos=mlwe",)

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in ':"\\ '):
            raise ValueError(f"prefix {self.prefix!r} must be non-empty, without ':', quotes,"
                             " backslashes or spaces")
        for name in ("tick_s", "squeue_fast_s", "squeue_slow_s", "node_period_s",
                     "telemetry_period_s", "start_timeout_s", "command_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("stop_margin_s", "default_grace_s", "progress_step", "not_responding_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must not be negative, got {v!r}")


@dataclass
class _Replica:
    index: int
    node: str
    offset: int = 0
    partial: bytes = b""
    started: bool = False
    exit: dict[str, Any] | None = None


@dataclass
class _Attempt:
    workload: str
    attempt: int
    correlation_id: str | None
    dir: Path
    replicas: dict[int, _Replica]
    gpus_per_replica: int = 0
    job_id: int | None = None
    submitted_at: float = 0.0  # monotonic
    submit_error: str | None = None
    slurm: list[SlurmJobInfo] = field(default_factory=list)  # the job's components, last seen
    seen_in_squeue: bool = False
    started_emitted: bool = False
    pending_progress: tuple[float, bool] | None = None
    last_progress: float | None = None
    checkpoint: float | None = None
    stop_requested: bool = False
    grace_s: float = 0.0
    stop_sent: bool = False
    force_at: float | None = None  # monotonic: when the force is due
    forced: bool = False
    gang_broken: bool = False
    final: bool = False
    lost: bool = False
    adopted: bool = False
    started_s: float | None = None  # submit -> Started, seconds
    stop_wait_s: float | None = None  # slowest replica's SIGTERM -> exit

    @property
    def key(self) -> tuple[str, int]:
        return (self.workload, self.attempt)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.node for r in self.replicas.values()))


def comment_of(prefix: str, workload: str, attempt: int, adir: Path) -> str:
    return json.dumps({COMMENT_KEY: prefix, "w": workload, "a": attempt, "d": str(adir)},
                      separators=(",", ":"))


def parse_comment(text: str, prefix: str) -> tuple[str, int, Path] | None:
    """(workload, attempt, attempt dir) from one of this engine's job comments, else None."""
    try:
        data = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict) or data.get(COMMENT_KEY) != prefix:
        return None
    try:
        return str(data["w"]), int(data["a"]), Path(str(data["d"]))
    except (KeyError, TypeError, ValueError):
        return None


def job_components(placement: Sequence[tuple[str, int]], gpus_per_replica: int,
                   cpus_per_replica: int, memory_mib_per_replica: int,
                   gres_type: Callable[[str], str]) -> list[list[str]]:
    """The ``sbatch`` options of each job component for a placement (node per replica).

    Nodes alike (as many replicas, the same GRES type) share one component; one
    component is a plain job, several a heterogeneous one."""
    per_node: dict[str, int] = {}
    for node, _ in placement:
        per_node[node] = per_node.get(node, 0) + 1
    groups: dict[tuple[int, str], list[str]] = {}
    for node, count in per_node.items():
        gtype = gres_type(node) if gpus_per_replica else ""
        groups.setdefault((count, gtype), []).append(node)
    out = []
    for (count, gtype), nodes in groups.items():
        opts = [f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}",
                f"--ntasks-per-node={count}", f"--cpus-per-task={cpus_per_replica}",
                f"--mem={max(1, count * memory_mib_per_replica)}M"]
        if gpus_per_replica:
            n = count * gpus_per_replica
            opts.append(f"--gres=gpu:{gtype}:{n}" if gtype else f"--gres=gpu:{n}")
        out.append(opts)
    return out


def gpu_model_of(gres_type: str, catalog: GpuCatalog = DEFAULT_CATALOG) -> str | None:
    """The catalogue model a GRES type names (``t4`` -> ``T4``, ``a100_80gb`` -> ``A100-80GB``)."""
    def norm(s: str) -> str:
        return "".join(c for c in s.lower() if c.isalnum())

    want = norm(gres_type)
    for name in catalog.names():
        if norm(name) == want:
            return name
    family = [n for n in catalog.names() if norm(n.split("-")[0]) == want]
    if family:
        return max(family, key=lambda n: (catalog[n].vram_mib, catalog[n].rank))
    return None


def discover_cluster(commands: SlurmCommands, partition: str | None = None,
                     catalog: GpuCatalog = DEFAULT_CATALOG) -> ClusterSpec:
    """A ClusterSpec of Slurm's nodes (in ``partition``, if given) as Slurm reports them.

    A node whose GPUs are of a type the catalogue does not know is refused with
    the reason (extend the catalogue, or write the cluster file by hand)."""
    specs = []
    problems = []
    for n in sorted(commands.nodes(), key=lambda n: n.name):
        if partition and partition not in n.partitions:
            continue
        gpus = {t: c for t, c in n.gpus.items() if c > 0}
        model = None
        if len(gpus) > 1:
            problems.append(f"node {n.name}: several GPU types {sorted(gpus)} (mlwe nodes have"
                            " one model)")
            continue
        if gpus:
            gtype = next(iter(gpus))
            model = gpu_model_of(gtype, catalog)
            if model is None:
                problems.append(f"node {n.name}: GRES type {gtype!r} is no known GPU model"
                                f" (known: {', '.join(catalog.names())})")
                continue
        specs.append(NodeSpec(name=n.name, cpu=str(n.cpus), memory=f"{max(1, n.memory_mib)}Mi",
                              gpus=sum(gpus.values()), gpu_model=model,
                              labels={"slurm/partition": ",".join(n.partitions)}))
    if problems:
        raise ValueError("cannot describe the Slurm cluster: " + "; ".join(problems))
    if not specs:
        raise ValueError("Slurm reports no node" + (f" in partition {partition}" if partition
                                                     else ""))
    return ClusterSpec(nodes=tuple(specs))


class SlurmBackend:
    """The Backend protocol over Slurm (see the module docstring)."""

    name = "slurm"

    def __init__(self, cluster: ClusterSpec, config: SlurmBackendConfig | None = None, *,
                 clock: _Clock | None = None, commands: SlurmCommands | None = None) -> None:
        self.cluster = cluster
        self.config = cfg = config or SlurmBackendConfig()
        self.clock: _Clock = clock or _EpochClock()
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

    # ================================================================= events
    def _emit(self, fact: Fact, correlation_id: str | None = None) -> None:
        self._events.append(
            Event(f"slurm-{self._iid}-{next(self._n)}", self.clock.now(), fact, correlation_id)
        )
        self._wake.set()
        for listener in self.event_listeners:
            listener()

    def _error(self, text: str) -> None:
        log.warning("%s", text)
        self.errors.append(text)

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
        spec = c.spec
        with self._lock:
            if att.stop_requested or att.final:
                if att.stop_requested and not att.final:
                    att.final = True
                    self._emit(Released(att.workload, att.attempt), att.correlation_id)
                return
        res = c.placement[0].res
        cpus = max(1, -(-res.cpu // 1000))
        placement = [(a.node, i) for i, a in enumerate(c.placement)]
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
        comps = job_components(placement, att.gpus_per_replica, cpus, res.ram,
                               lambda n: self._gres.get(n, ""))
        het = f" --het-group=0-{len(comps) - 1}" if len(comps) > 1 else ""
        task = f"{_sh(cfg.python)} -m mlwe.backends.slurm.task {_sh(str(att.dir))}"
        script = att.dir / "job.sh"
        stop_file = _sh(str(att.dir / "stop.json"))
        script.write_text(
            "#!/bin/sh\n"
            "# written by mlwe: one srun step, one task per replica\n"
            f"srun --kill-on-bad-exit=1 --unbuffered{het} {task}\n"
            "rc=$?\n"
            "# a stop mlwe asked for ends the job cleanly, whatever srun says of its signal\n"
            f"[ -f {stop_file} ] && exit 0\n"
            "exit $rc\n"
        )
        common = [f"--job-name={cfg.prefix}:{c.workload}:{c.attempt}",
                  f"--comment={comment_of(cfg.prefix, c.workload, c.attempt, att.dir)}",
                  f"--output={att.dir / 'job.out'}", f"--chdir={att.dir}", "--no-requeue",
                  "--export=ALL"]
        if cfg.partition:
            common.append(f"--partition={cfg.partition}")
        if cfg.account:
            common.append(f"--account={cfg.account}")
        args: list[str] = []
        for k, opts in enumerate(comps):
            if k:
                args.append(":")
            args += [*common, *cfg.extra_sbatch, *opts] if k == 0 else [*opts]
            if k and cfg.partition:
                args.append(f"--partition={cfg.partition}")
        args.append(str(script))
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

    # ------------------------------------------------------------ file reports
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

    # ------------------------------------------------------------------ nodes
    def _check_nodes(self, nodes: Iterable[SlurmNodeInfo]) -> list[str]:
        have = {n.name: n for n in nodes}
        problems = []
        for name, spec in self._specs.items():
            n = have.get(name)
            if n is None:
                problems.append(f"node {name} is not a Slurm node (Slurm has:"
                                f" {', '.join(sorted(have)[:20]) or 'none'})")
                continue
            if self.config.partition and n.partitions and self.config.partition not in n.partitions:
                problems.append(f"node {name} is not in partition {self.config.partition}")
            if n.cpus * 1000 < spec.cpu:
                problems.append(f"node {name}: declares {spec.cpu}m CPU, Slurm has {n.cpus}")
            if n.memory_mib and n.memory_mib < spec.memory:
                problems.append(f"node {name}: declares {spec.memory} MiB, Slurm has"
                                f" {n.memory_mib}")
            if spec.gpus:
                count = sum(n.gpus.values())
                if count < spec.gpus:
                    problems.append(f"node {name}: declares {spec.gpus} GPUs, Slurm's GRES has"
                                    f" {count}")
                types = [t for t, c in n.gpus.items() if c > 0]
                if len(types) == 1:
                    self._gres[name] = types[0]
        return problems

    def _on_nodes(self, nodes: Iterable[SlurmNodeInfo]) -> None:
        seen = set()
        now = self.clock.now()
        for n in nodes:
            if n.name not in self._specs:
                continue
            seen.add(n.name)
            down = n.down
            if down and not (n.flags - {"NOT_RESPONDING"}) & DOWN_NODE_STATES:
                # only NOT_RESPONDING: lost once it lasts (Slurm's own DOWN comes later)
                since = self._not_responding.setdefault(n.name, time.monotonic())
                down = time.monotonic() - since >= self.config.not_responding_s
            else:
                self._not_responding.pop(n.name, None)
            self._node_state(n.name, down, f"Slurm says {n.describe()}")
            metrics = {"slurm_cpus": float(n.cpus), "slurm_alloc_cpus": float(n.alloc_cpus),
                       "slurm_alloc_memory_mib": float(n.alloc_memory_mib),
                       "up": 0.0 if self._down.get(n.name) else 1.0}
            if n.cpu_load is not None:
                metrics["load_1m"] = n.cpu_load
            if n.free_memory_mib is not None:
                metrics["mem_free_mib"] = float(n.free_memory_mib)
            self._telemetry.append(Telemetry(now, n.name, None, metrics))
        for name in self._specs:
            if name not in seen:
                self._node_state(name, True, "no longer a Slurm node")

    def _node_state(self, name: str, down: bool, reason: str) -> None:
        if down == self._down.get(name):
            return
        self._down[name] = down
        if not down:
            self._emit(NodeUp(name))
            return
        log.warning("node %s down: %s", name, reason)
        self._emit(NodeDown(name, reason))
        for a in self._attempts.values():
            if a.final or name not in a.nodes:
                continue
            # the control plane fails it (node-lost) when it handles NodeDown; the
            # replicas elsewhere must not keep running
            a.final = a.lost = True
            if a.job_id is not None:
                self._work.put(("cancel", a))

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


def _fraction(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0


def _sh(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
