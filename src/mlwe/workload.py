"""The in-workload helper: what a program run by the engine imports to talk back.

Standard library only, so any program (and any Python environment) can use it:

    from mlwe import workload as mw

    state = mw.resume_state() or {"step": 0}
    while state["step"] < steps:
        ...
        mw.report(step=state["step"], loss=loss, progress=state["step"] / steps)
        if mw.should_stop():          # SIGTERM arrived: the engine wants the resources
            mw.save_state(state, progress=state["step"] / steps)
            raise SystemExit(0)

It owns the workload side of the local daemon's contract: the environment the
daemon sets (``MLWE_WORKLOAD_ID``, ``MLWE_ATTEMPT``, ``MLWE_REPLICA``,
``MLWE_CHECKPOINT_DIR``, ``MLWE_REPORT_FD``, ``CUDA_VISIBLE_DEVICES``), the
report channel (JSON lines on an inherited pipe), and the checkpoint files.
Run by hand (no daemon), reports go nowhere and checkpoints go to
``./.mlwe-checkpoint``, so the same program works outside the engine.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pickle
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "attempt",
    "checkpoint_dir",
    "checkpoint_info",
    "gpu_indices",
    "on_stop",
    "replica",
    "report",
    "resume_state",
    "save_state",
    "should_stop",
    "workload_id",
]

STATE_FILE = "state.pkl"
INFO_FILE = "checkpoint.json"


def _own(name: str) -> str:
    """This replica's file of that name: every replica of a gang shares the checkpoint
    directory, so each keeps its own state (replica 0 uses the plain name)."""
    r = replica()
    if r == 0:
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}.r{r}{dot}{ext}"

_stop = threading.Event()
_callbacks: list[Callable[[], None]] = []
_hook_installed = False
_lock = threading.Lock()
_fd: int | None = None
_fd_ready = False
dropped_reports = 0  # reports lost because the daemon was not reading (never blocks the program)


# --------------------------------------------------------------------- identity
def workload_id() -> str | None:
    return os.environ.get("MLWE_WORKLOAD_ID")


def attempt() -> int:
    return int(os.environ.get("MLWE_ATTEMPT", "0"))


def replica() -> int:
    """This process's replica index within its gang (0 when not a gang)."""
    return int(os.environ.get("MLWE_REPLICA", "0"))


def gpu_indices() -> list[int]:
    """The GPU indices assigned to this replica (from ``CUDA_VISIBLE_DEVICES``)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(x) for x in raw.split(",") if x.strip().isdigit()]


def checkpoint_dir() -> Path:
    """The workload's checkpoint directory (kept across attempts), created if missing."""
    path = Path(os.environ.get("MLWE_CHECKPOINT_DIR") or ".mlwe-checkpoint")
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------- stopping
def _on_sigterm(signum: int, frame: Any) -> None:
    _stop.set()
    for cb in list(_callbacks):
        cb()


def _install_hook() -> None:
    global _hook_installed
    with _lock:
        if _hook_installed:
            return
        # signal handlers can only be set from the main thread; elsewhere the
        # program keeps the default action (terminate) and should_stop() stays False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm)
            _hook_installed = True


def should_stop() -> bool:
    """True once the engine asked this workload to stop (SIGTERM): checkpoint and exit.

    The first call installs the SIGTERM hook; call it (or :func:`on_stop`) early."""
    _install_hook()
    return _stop.is_set()


def on_stop(callback: Callable[[], None]) -> None:
    """Run ``callback`` (from the signal handler, keep it short) when a stop is asked."""
    _install_hook()
    _callbacks.append(callback)


# -------------------------------------------------------------------- reporting
def _report_fd() -> int | None:
    global _fd, _fd_ready
    if _fd_ready:
        return _fd
    _fd_ready = True
    raw = os.environ.get("MLWE_REPORT_FD")
    if raw and raw.isdigit():
        fd = int(raw)
        try:
            os.set_blocking(fd, False)  # a slow daemon must never stall the program
            _fd = fd
        except OSError:
            _fd = None
    return _fd


def _send(msg: dict[str, Any], *, must: bool) -> None:
    global _fd, dropped_reports
    fd = _report_fd()
    if fd is None:
        return
    data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
    if len(data) > 4000:  # one write of at most PIPE_BUF bytes is atomic
        raise ValueError("report too large (keep metrics to a few numbers)")
    deadline = time.monotonic() + (2.0 if must else 0.0)
    while True:
        try:
            os.write(fd, data)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                dropped_reports += 1
                return
            time.sleep(0.005)
        except OSError as exc:  # the daemon is gone: stop trying
            if exc.errno in (errno.EPIPE, errno.EBADF):
                _fd = None
                return
            raise


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"metric {name} must be a number, got {type(v).__name__}")
    return float(v)


def report(
    step: int | None = None,
    loss: float | None = None,
    progress: float | None = None,
    **metrics: float,
) -> None:
    """Report progress (a fraction in [0, 1]), the loss and any numeric metrics.

    Cheap and non-blocking; call it as often as convenient (the daemon
    coalesces). NaN and infinite losses are reported as they are: they are
    exactly what the engine's monitors look for."""
    msg: dict[str, Any] = {"t": time.time()}
    if step is not None:
        msg["step"] = int(step)
    if loss is not None:
        msg["loss"] = _number("loss", loss)
    if progress is not None:
        p = _number("progress", progress)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"progress must be a fraction in [0, 1], got {progress!r}")
        msg["progress"] = p
    if metrics:
        msg["metrics"] = {k: _number(k, v) for k, v in metrics.items()}
    _install_hook()
    _send(msg, must=False)


# ------------------------------------------------------------------ checkpoints
def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_state(state: Any, *, progress: float | None = None, step: int | None = None) -> Path:
    """Save ``state`` (any picklable object) as this workload's checkpoint, atomically,
    and tell the engine how far it got (``progress``, a fraction in [0, 1])."""
    if progress is not None and not (math.isfinite(progress) and 0.0 <= progress <= 1.0):
        raise ValueError(f"progress must be a fraction in [0, 1], got {progress!r}")
    d = checkpoint_dir()
    _atomic_write(d / _own(STATE_FILE), pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    info = {"progress": progress, "step": step, "time": time.time(), "attempt": attempt()}
    _atomic_write(d / _own(INFO_FILE), json.dumps(info).encode())
    msg: dict[str, Any] = {"t": time.time(), "checkpoint": True}
    if progress is not None:
        msg["progress"] = float(progress)
    if step is not None:
        msg["step"] = int(step)
    _send(msg, must=True)  # the engine counts on knowing what was saved
    return d / _own(STATE_FILE)


def resume_state() -> Any | None:
    """The state saved by the last checkpoint of this workload, or None (a fresh start).

    The checkpoint directory belongs to this workload alone, which is why
    unpickling it is acceptable here."""
    path = Path(os.environ.get("MLWE_CHECKPOINT_DIR") or ".mlwe-checkpoint") / _own(STATE_FILE)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return pickle.loads(data)


def checkpoint_info() -> dict[str, Any] | None:
    """Metadata of the last checkpoint (progress, step, time, attempt), or None."""
    path = Path(os.environ.get("MLWE_CHECKPOINT_DIR") or ".mlwe-checkpoint") / _own(INFO_FILE)
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return loaded if isinstance(loaded, dict) else None
