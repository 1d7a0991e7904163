"""One replica on a workload daemon: its record, its environment, its process, its end.

:class:`Replica` is what the daemon (:mod:`.daemon`) knows of a replica it
runs; :func:`replica_env` is the environment its program gets, and
:func:`popen_replica` starts that program in a session of its own, with
SIGKILL as its parent-death signal (it dies with the daemon).
:func:`parse_report` reads one line of the :mod:`mlwe.workload` helper's
reports, and :func:`exit_status` is the exit code and cause reported once the
replica's whole tree is gone.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mlwe.backends.local.procs import ProcessTree
from mlwe.backends.local.protocol import ProtocolError

#: Exit codes of replicas that never ran (shell and container conventions).
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_START_FAILED = 125

Key = tuple[str, int, int]  # workload, attempt, replica

_PR_SET_PDEATHSIG = 1
try:
    _LIBC: Any = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - no libc to load
    _LIBC = None



def _child_setup(parent: int) -> Callable[[], None]:
    def setup() -> None:
        # die with the daemon: a workload whose daemon is gone is on a lost node,
        # and the engine will run it again elsewhere
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(EXIT_START_FAILED)

    return setup


@dataclass
class Replica:
    key: Key
    replicas: int
    node: str
    correlation_id: str | None
    devices: tuple[int, ...]  # physical GPU indices
    gpu_milli: int
    vram_mib: int
    started: float = field(default_factory=time.monotonic)
    proc: subprocess.Popen[bytes] | None = None
    tree: ProcessTree | None = None
    pidfd: int | None = None
    report_fd: int | None = None
    report_buf: bytes = b""
    log_file: IO[bytes] | None = None
    returncode: int | None = None
    engine_stop: bool = False  # the engine asked for the stop (preempt, cancel, orphan)
    shutdown: bool = False  # the daemon is shutting down
    stop_deadline: float | None = None
    forced: bool = False
    term_at: float | None = None  # when SIGTERM was sent
    exit_at: float | None = None  # when the root process exited
    next_check: float | None = None  # when to look again whether the tree is gone
    pending: dict[str, Any] | None = None  # coalesced report not yet sent
    checkpoint: float | None = None  # progress of the last checkpoint reported
    bad_reports: int = 0

    @property
    def stopping(self) -> bool:
        return self.engine_stop or self.shutdown



def replica_env(msg: dict[str, Any], rep: Replica, ckpt: Path, report_fd: int) -> dict[str, str]:
    """The environment of a replica's program: the daemon's (less its ``MLWE_*``), the
    workload's own, and the ``MLWE_*`` variables that tell the program who it is."""
    wid, attempt, index = rep.key
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLWE_")}
    # programs named "python" or "mlwe" resolve to this daemon's environment first
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", os.defpath)
    env.setdefault("PYTHONUNBUFFERED", "1")
    user_env = msg.get("env") or {}
    if isinstance(user_env, dict):
        env.update({str(k): str(v) for k, v in user_env.items()})
    cpu_milli = int(msg.get("cpu_milli", 0))
    if cpu_milli and "OMP_NUM_THREADS" not in user_env:
        env["OMP_NUM_THREADS"] = str(max(1, -(-cpu_milli // 1000)))
    env.update(
        MLWE_WORKLOAD_ID=wid,
        MLWE_ATTEMPT=str(attempt),
        MLWE_REPLICA=str(index),
        MLWE_REPLICAS=str(rep.replicas),
        MLWE_NODE=rep.node,
        MLWE_CHECKPOINT_DIR=str(ckpt),
        MLWE_REPORT_FD=str(report_fd),
        MLWE_RESUME_WORK_S=str(float(msg.get("resume_work_s", 0.0))),
        CUDA_VISIBLE_DEVICES=",".join(str(d) for d in rep.devices),
    )
    return env


def popen_replica(
    command: list[str], env: dict[str, str], log_file: IO[bytes] | None, report_fd: int
) -> subprocess.Popen[bytes]:
    """Start a replica's program (its output to ``log_file``, ``report_fd`` inherited)."""
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
        env=env, pass_fds=(report_fd,), start_new_session=True,
        preexec_fn=_child_setup(os.getpid()),  # single-threaded daemon: safe
    )


def exit_status(rep: Replica) -> tuple[int, str]:
    """The exit code and cause to report for a replica whose whole tree is gone."""
    rc = rep.returncode if rep.returncode is not None else -signal.SIGKILL
    if rc < 0:
        sig = -rc
        code = 128 + sig
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        cause = f"killed by {name}" + (" after the grace period" if rep.forced else "")
    else:
        code, cause = rc, ("" if rc == 0 else "error")
    if rep.shutdown and not rep.engine_stop:
        cause = "daemon-shutdown"
    return code, cause


def parse_report(line: bytes) -> dict[str, Any]:
    """A report line from :mod:`mlwe.workload` (a JSON object without a type)."""
    try:
        m = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(str(exc)) from None
    if not isinstance(m, dict):
        raise ProtocolError("a report is a JSON object")
    return m
