"""What runs inside a Ray actor: one replica's program as a real process tree.

:class:`ReplicaProcess` owns one replica's program on the node Ray put it on:

- it starts the program (an argv, no shell) in its own session, so the whole
  tree can be signalled as one process group, with the environment the local
  daemon also gives (``MLWE_WORKLOAD_ID``, ``MLWE_ATTEMPT``, ``MLWE_REPLICA``,
  ``MLWE_CHECKPOINT_DIR``, ``MLWE_REPORT_FD``, ``CUDA_VISIBLE_DEVICES``);
- the program's parent-death signal is SIGKILL, so a killed actor (``ray.kill``,
  a dead raylet) takes its program with it instead of leaving an orphan that
  still holds memory;
- it reads the :mod:`mlwe.workload` helper's reports (JSON lines on an
  inherited pipe) and keeps the latest progress, loss, metrics and checkpoint;
- :meth:`ReplicaProcess.stop` is the graceful eviction: SIGTERM to the group,
  up to ``grace_s`` for a checkpoint and exit, then SIGKILL to the group, and it
  returns only once no live process of the group is left;
- :meth:`ReplicaProcess.sample` measures the tree with psutil (CPU, RSS).

It imports nothing from Ray: the Ray side (:class:`ReplicaRunner`, the actor
class) is a thin shell around it, and the process logic is tested without Ray.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import psutil

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
# exit codes of a program that could not start, as a shell (and the local daemon) gives them
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_START_FAILED = 125
RESCAN_S = 5.0  # how often a sample looks for new descendants (known ones: every sample)
MAX_REPORTS = 256  # reports kept between two drains; older ones are counted and dropped


class StartError(Exception):
    """The program could not be started; the message says why (shown to the user)."""

    def __init__(self, message: str, exit_code: int = EXIT_START_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _load_prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn: Callable[..., int] = libc.prctl
        return fn
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()  # resolved once, in the parent: the child between fork and exec only calls it


def _die_with_parent() -> None:
    # runs in the child between fork and exec: a single libc call, nothing that takes a lock
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class _Spawner:
    """One long-lived thread that forks every program of this process.

    The parent-death signal fires when the *thread* that forked the child ends,
    not the process; Ray runs actor methods on pool threads, so the fork happens
    on this thread, which lives as long as the process."""

    _instance: _Spawner | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]]] = (
            queue.Queue()
        )
        threading.Thread(target=self._loop, name="mlwe-spawner", daemon=True).start()

    @classmethod
    def get(cls) -> _Spawner:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Spawner()
            return cls._instance

    def _loop(self) -> None:
        while True:
            fn, reply = self._jobs.get()
            try:
                reply.put((True, fn()))
            except BaseException as exc:
                reply.put((False, exc))

    def run(self, fn: Callable[[], T]) -> T:
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
        self._jobs.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        out: T = value
        return out


def exit_code_of(returncode: int) -> int:
    """Popen's code (negative: killed by that signal) as a shell would show it (128 + n)."""
    return 128 - returncode if returncode < 0 else returncode


def group_alive(pgid: int, extra: Sequence[psutil.Process] = ()) -> list[int]:
    """Pids of the live (not zombie) processes of group ``pgid`` and of ``extra``.

    A zombie holds no memory or devices, only its process-table entry until
    someone reaps it, so it does not count as holding resources."""
    alive: set[int] = set()
    for p in (*psutil.process_iter(), *extra):
        try:
            if (p in extra or os.getpgid(p.pid) == pgid) and p.status() != psutil.STATUS_ZOMBIE:
                alive.add(p.pid)
        except (psutil.NoSuchProcess, ProcessLookupError, psutil.AccessDenied):
            continue
    return sorted(alive)


@dataclass(frozen=True, slots=True)
class StopOutcome:
    exit_code: int
    forced: bool  # SIGKILL was needed (the grace period ran out, or grace_s was 0)
    survivors: tuple[int, ...]  # pids still alive after the kill (empty on success)
    checkpoint_progress: float | None  # progress saved by the last checkpoint of this run
    stop_s: float  # seconds from the signal to the group being gone


class ReplicaProcess:
    """One replica's program, started in its own session (see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | None = None,
        log_path: str | None = None,
    ) -> None:
        if not argv:
            raise StartError("the workload has no command to run (spec.command is empty)")
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid = 0
        self.started_at = 0.0
        self._exit: int | None = None
        self.returncode: int | None = None  # Popen's: negative when killed by a signal
        self._done = threading.Event()
        self._stop_requested = False
        self._reports: deque[dict[str, Any]] = deque(maxlen=MAX_REPORTS)
        self.dropped_reports = 0
        self.reports_seen = 0
        self.latest: dict[str, float] = {}
        self.progress: float | None = None
        self.checkpoint_progress: float | None = None
        self.checkpoints = 0
        self._rlock = threading.Lock()
        self._tree: dict[int, psutil.Process] = {}
        self._reader: threading.Thread | None = None
        self._next_rescan = 0.0
        self._rescan_every = 0.125

    # ------------------------------------------------------------------- start
    def start(self) -> int:
        """Start the program; returns its pid. Raises :class:`StartError` with the reason."""
        ckpt = self.env.get("MLWE_CHECKPOINT_DIR")
        if ckpt:
            try:
                Path(ckpt).mkdir(parents=True, exist_ok=True)
                probe = Path(ckpt) / f".mlwe-write-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                raise StartError(
                    f"checkpoint directory {ckpt} is not writable: {exc.strerror or exc}"
                ) from None
        read_fd, write_fd = os.pipe()
        env = {**self.env, "MLWE_REPORT_FD": str(write_fd)}
        out: Any = subprocess.DEVNULL
        log = None
        try:
            if self.log_path:
                Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
                log = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child, closed below)
                out = log

            def spawn() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    self.argv,
                    env=env,
                    cwd=self.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: signal the whole tree
                    pass_fds=(write_fd,),
                    preexec_fn=_die_with_parent,
                )

            try:
                self.proc = _Spawner.get().run(spawn)
            except FileNotFoundError:
                raise StartError(f"command not found: {self.argv[0]!r}", EXIT_NOT_FOUND) from None
            except PermissionError:
                raise StartError(
                    f"command not executable: {self.argv[0]!r}", EXIT_NOT_EXECUTABLE
                ) from None
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                raise StartError(f"cannot start {self.argv[0]!r}: {exc}") from None
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child has its copy; EOF comes when the tree is gone
            if log is not None:
                log.close()
        self.pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        self.started_at = time.monotonic()
        self._tree = {self.proc.pid: psutil.Process(self.proc.pid)}
        self._reader = threading.Thread(target=self._read_reports, args=(read_fd,), daemon=True)
        self._reader.start()
        threading.Thread(target=self._reap, daemon=True).start()
        return self.proc.pid

    def _reap(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        self.returncode = code
        self._exit = exit_code_of(code)
        self._done.set()

    @property
    def killed_by(self) -> str | None:
        """The signal's name when the program was killed by one (``SIGKILL``), else None."""
        rc = self.returncode
        if rc is None or rc >= 0:
            return None
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"

    # ----------------------------------------------------------------- reports
    def _read_reports(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue
                if isinstance(msg, dict):
                    self._take(msg)

    def _take(self, msg: dict[str, Any]) -> None:
        with self._rlock:
            self.reports_seen += 1
            if len(self._reports) == self._reports.maxlen:
                self.dropped_reports += 1
            self._reports.append(msg)
            p = msg.get("progress")
            if _fraction(p):
                self.progress = float(p)
                if msg.get("checkpoint"):
                    self.checkpoint_progress = float(p)
            if msg.get("checkpoint"):
                self.checkpoints += 1
            for key in ("step", "loss"):
                v = msg.get(key)
                if _number(v):
                    self.latest[key] = float(v)
            metrics = msg.get("metrics")
            if isinstance(metrics, dict):
                for k, v in metrics.items():
                    if isinstance(k, str) and _number(v):
                        self.latest[k] = float(v)

    def finish_reports(self, timeout: float = 2.0) -> None:
        """Once the tree is gone, wait for the reader to take the last lines of the pipe
        (the final checkpoint's report is written just before the program exits)."""
        if self._reader is not None and self._exit is not None:
            self._reader.join(timeout)

    def drain_reports(self) -> list[dict[str, Any]]:
        with self._rlock:
            out = list(self._reports)
            self._reports.clear()
            return out

    # --------------------------------------------------------------- lifecycle
    @property
    def exit_code(self) -> int | None:
        return self._exit

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self._exit

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _descendants(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace_s: float, *, settle_s: float = 10.0) -> StopOutcome:
        """SIGTERM the group, wait up to ``grace_s``, SIGKILL what is left, wait until gone.

        ``grace_s == 0`` is a force-stop. Returns once no live process of the
        group (nor any descendant that left it) remains, or after ``settle_s``
        more seconds with the survivors named."""
        if self.proc is None:
            raise RuntimeError("stop() before start()")
        self._stop_requested = True
        t0 = time.monotonic()
        extra = self._descendants()  # children that moved to their own group still count
        forced = False
        if grace_s > 0 and self._exit is None:
            self._signal_group(signal.SIGTERM)
            deadline = t0 + grace_s
            while time.monotonic() < deadline:
                if self._done.is_set() and not group_alive(self.pgid, _live(extra)):
                    break
                time.sleep(0.02)
        if self._exit is None or group_alive(self.pgid, _live(extra)):
            forced = True  # the grace ran out (or was 0) with something still alive
            self._signal_group(signal.SIGKILL)
            for p in _live(extra):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        self._done.wait(settle_s)
        deadline = time.monotonic() + settle_s
        survivors = group_alive(self.pgid, _live(extra))
        while survivors and time.monotonic() < deadline:
            time.sleep(0.02)
            survivors = group_alive(self.pgid, _live(extra))
        if not survivors:
            self.finish_reports()
        code = self._exit if self._exit is not None else -1
        return StopOutcome(
            code, forced, tuple(survivors), self.checkpoint_progress, time.monotonic() - t0
        )

    # --------------------------------------------------------------- telemetry
    def pids(self) -> list[int]:
        """The tree's processes as of the last sample."""
        return list(self._tree)

    def sample(self) -> dict[str, float]:
        """CPU (percent of one core, since the last sample) and RSS of the whole tree."""
        if self.proc is None or self._exit is not None:
            return {"processes": 0.0}
        now = time.monotonic()
        if now >= self._next_rescan or not self._tree:
            # finding descendants reads the whole process table: not on every sample
            self._rescan_every = min(RESCAN_S, self._rescan_every * 2)  # children come early
            self._next_rescan = now + self._rescan_every
            try:
                current = [psutil.Process(self.proc.pid), *self._descendants()]
            except psutil.NoSuchProcess:
                return {"processes": 0.0}
        else:
            current = list(self._tree.values())
        tree: dict[int, psutil.Process] = {}
        cpu = 0.0
        rss = 0
        for p in current:
            known = self._tree.get(p.pid, p)  # keep the object: cpu_percent is since its last call
            try:
                with known.oneshot():
                    cpu += known.cpu_percent(None)
                    rss += known.memory_info().rss
                tree[p.pid] = known
            except psutil.NoSuchProcess:
                continue
        self._tree = tree
        return {"cpu_pct": round(cpu, 2), "rss_mib": round(rss / 2**20, 2), "processes": float(len(tree))}


def _live(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fraction(v: Any) -> TypeGuard[int | float]:
    return _number(v) and 0.0 <= float(v) <= 1.0


class ReplicaRunner:
    """The Ray actor class: one per replica of an attempt (``ray.remote`` is applied by the backend).

    Methods are called concurrently (the actor is threaded): ``wait`` blocks
    until the program exits while ``sample`` and ``stop`` are served."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = dict(meta)
        self.process: ReplicaProcess | None = None
        self.start_error: str | None = None
        self.stopped = False
        self._lock = threading.Lock()

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        log_path: str | None,
        meta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Start the program once (a repeated call reports the first result). ``meta``
        says which replica of which attempt this actor now runs (a warm actor learns it
        here, so an engine restarted later can find out)."""
        with self._lock:
            if meta and self.process is None and self.start_error is None:
                self.meta.update(meta)
            if self.process is not None:
                return {"ok": True, "pid": self.process.proc.pid if self.process.proc else 0}
            if self.start_error is not None:
                return {"ok": False, "error": self.start_error, "exit_code": EXIT_START_FAILED}
            if self.stopped:  # the stop overtook the start: nothing may start now
                self.start_error = "stopped before it started"
                return {"ok": False, "error": self.start_error, "exit_code": EXIT_START_FAILED}
            # the worker's environment without any MLWE_* of its own, as the local daemon
            # does; "python" (or "mlwe") resolves to this Python environment first
            base = {k: v for k, v in os.environ.items() if not k.startswith("MLWE_")}
            base["PATH"] = os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", os.defpath)
            base.setdefault("PYTHONUNBUFFERED", "1")
            merged = {**base, **env}
            try:
                proc = ReplicaProcess(argv, merged, cwd=cwd, log_path=log_path)
                pid = proc.start()
            except StartError as exc:
                self.start_error = str(exc)
                return {"ok": False, "error": str(exc), "exit_code": exc.exit_code}
            self.process = proc
            return {"ok": True, "pid": pid, "ray_node_id": _ray_node_id(), "actor_pid": os.getpid()}

    def wait(self) -> dict[str, Any]:
        """Block until the program exits: its exit code (128 + n when killed by signal n)
        and the signal's name, if any."""
        proc = self.process
        if proc is None:
            return {"code": EXIT_START_FAILED, "signal": None}
        code = proc.wait()
        assert code is not None
        return {"code": code, "signal": proc.killed_by}

    def stop(self, grace_s: float) -> dict[str, Any]:
        with self._lock:  # waits for a start in progress; a later start is refused
            self.stopped = True
            proc = self.process
        if proc is None:
            return {"exit_code": -1, "forced": False, "survivors": [], "checkpoint_progress": None,
                    "stop_s": 0.0}
        out = proc.stop(grace_s)
        return {
            "exit_code": out.exit_code,
            "forced": out.forced,
            "survivors": list(out.survivors),
            "checkpoint_progress": out.checkpoint_progress,
            "stop_s": out.stop_s,
        }

    def sample(self) -> dict[str, Any]:
        proc = self.process
        if proc is None:
            return {"metrics": {}, "reports": [], "progress": None, "checkpoint_progress": None}
        proc.finish_reports()  # after the exit: everything it wrote is in
        metrics = proc.sample()
        with proc._rlock:
            metrics.update(proc.latest)
        devices = [int(d) for d in self.meta.get("devices") or ()]
        gpu = gpu_sample(devices, proc.pids()) if devices and proc.exit_code is None else {}
        metrics.update(gpu)
        return {
            "metrics": metrics,
            "gpu_measured": bool(gpu),  # else the backend reports the allocation, labelled so
            "host": host_metrics(),
            "reports": proc.drain_reports(),
            "progress": proc.progress,
            "checkpoint_progress": proc.checkpoint_progress,
            "dropped_reports": proc.dropped_reports,
        }

    def info(self) -> dict[str, Any]:
        proc = self.process
        return {
            **self.meta,
            "pid": proc.proc.pid if proc is not None and proc.proc is not None else None,
            "exit_code": proc.exit_code if proc is not None else None,
            "start_error": self.start_error,
        }


_nvml: Any = None
_nvml_tried = False


def _open_nvml() -> Any:
    """NVML (the local daemon's wrapper) when this machine has a GPU driver, else None."""
    global _nvml, _nvml_tried
    if not _nvml_tried:
        _nvml_tried = True
        try:
            from mlwe.backends.local.telemetry import Nvml

            _nvml = Nvml.open()
        except Exception:
            _nvml = None
    return _nvml


def gpu_sample(devices: list[int], pids: list[int]) -> dict[str, float]:
    """Measured GPU figures of a replica's devices (utilisation, power, VRAM its processes
    use); empty where no GPU can be read: nothing is invented."""
    nv = _open_nvml()
    if nv is None or not devices or any(d >= len(nv.devices) for d in devices):
        return {}
    samples = [nv.sample(d) for d in devices]
    out: dict[str, float] = {}
    utils = [x["gpu_util"] for x in samples if "gpu_util" in x]
    if utils:
        out["gpu_util"] = sum(utils) / len(utils)
    power = [x["gpu_power_w"] for x in samples if "gpu_power_w" in x]
    if power:
        out["gpu_power_w"] = sum(power)
    mine = set(pids)
    used = [v for d in devices for pid, v in nv.process_vram(d).items() if pid in mine]
    if used:
        out["vram_used_mib"] = sum(used)
    return out


def host_metrics() -> dict[str, float]:
    """The machine the actor runs on (the local daemon's host sample: CPU, memory, load)."""
    try:
        from mlwe.backends.local.telemetry import host_sample

        return host_sample()
    except Exception:
        return {}


def _ray_node_id() -> str | None:
    ray: Any = sys.modules.get("ray")  # loaded in a Ray worker; never imported just for this
    if ray is None or not ray.is_initialized():
        return None  # the runner used on its own
    try:
        node_id: str = ray.get_runtime_context().get_node_id()
        return node_id
    except Exception:
        return None


def kill_groups(pgids: Sequence[int], settle_s: float = 10.0) -> list[int]:
    """SIGKILL each process group and wait until none has a live process (the force path
    after an actor that ran them was killed); returns the pids still alive."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + settle_s
    while True:
        alive = [pid for g in pgids for pid in group_alive(g)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)
