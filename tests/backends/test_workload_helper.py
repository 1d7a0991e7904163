"""mlwe.workload: the in-workload helper (reports, stop hook, checkpoints), stdlib only."""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mlwe.workload as mw

SRC = Path(mw.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def test_the_helper_needs_only_the_standard_library() -> None:
    assert _imports(SRC / "workload.py") <= set(sys.stdlib_module_names)
    # and the synthetic program only adds the helper itself
    assert _imports(SRC / "programs" / "synthetic.py") <= set(sys.stdlib_module_names) | {"mlwe"}


def run_child(code: str, env: dict[str, str], *, term_after_ready: bool = False,
              timeout: float = 30) -> tuple[int, list[dict[str, Any]], str]:
    """Run ``code`` with a report pipe; returns (exit code, reports, stdout)."""
    r, w = os.pipe()
    full_env = {**os.environ, **env, "MLWE_REPORT_FD": str(w)}
    p = subprocess.Popen([sys.executable, "-c", code], env=full_env, pass_fds=(w,),
                         stdout=subprocess.PIPE, text=True)
    os.close(w)
    if term_after_ready:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=timeout)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    reports = [json.loads(line) for line in data.splitlines() if line.strip()]
    return p.returncode, reports, out


def test_reports_reach_the_daemon_through_the_pipe_as_json_lines() -> None:
    code = ("from mlwe import workload as mw\n"
            "mw.report(step=1, loss=0.5, progress=0.25, accuracy=0.9)\n"
            "mw.report(step=2, loss=float('nan'))\n")
    rc, reports, _ = run_child(code, {})
    assert rc == 0
    first = reports[0]
    assert (first["step"], first["loss"], first["progress"], first["metrics"]) == (
        1, 0.5, 0.25, {"accuracy": 0.9}
    )
    assert reports[1]["step"] == 2 and math.isnan(reports[1]["loss"])
    assert all(isinstance(m["t"], float) for m in reports)


BAD_REPORTS = {
    "progress above 1": ({"progress": 1.5}, ValueError, "progress must be a fraction in [0, 1]"),
    "negative progress": ({"progress": -0.1}, ValueError, "progress must be a fraction"),
    "text loss": ({"loss": "low"}, TypeError, "metric loss must be a number, got str"),
    "bool metric": ({"ok": True}, TypeError, "metric ok must be a number, got bool"),
}


@pytest.mark.parametrize(("kwargs", "exc", "message"), BAD_REPORTS.values(),
                         ids=BAD_REPORTS.keys())
def test_bad_reports_raise_a_clear_error(kwargs: dict[str, Any], exc: type[Exception],
                                         message: str) -> None:
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("]", r"\]")):
        mw.report(**kwargs)


def test_state_is_saved_atomically_and_read_back(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLWE_CHECKPOINT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("MLWE_ATTEMPT", "3")
    assert mw.resume_state() is None and mw.checkpoint_info() is None
    mw.save_state({"step": 7, "weights": [1.5, 2.5]}, progress=0.4, step=7)
    assert mw.resume_state() == {"step": 7, "weights": [1.5, 2.5]}
    info = mw.checkpoint_info()
    assert info is not None and (info["progress"], info["step"], info["attempt"]) == (0.4, 7, 3)
    mw.save_state({"step": 8}, progress=0.5)
    assert mw.resume_state() == {"step": 8}
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["checkpoint.json", "state.pkl"]
    with pytest.raises(ValueError, match="progress must be a fraction"):
        mw.save_state({}, progress=2.0)
    assert mw.resume_state() == {"step": 8}  # a refused save leaves the last one


def test_replicas_of_a_gang_keep_their_own_state(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLWE_CHECKPOINT_DIR", str(tmp_path / "ck"))
    for r, progress in ((0, 0.2), (1, 0.15)):
        monkeypatch.setenv("MLWE_REPLICA", str(r))
        mw.save_state({"replica": r}, progress=progress)
    for r, progress in ((0, 0.2), (1, 0.15)):  # the last writer did not win
        monkeypatch.setenv("MLWE_REPLICA", str(r))
        assert mw.resume_state() == {"replica": r}
        info = mw.checkpoint_info()
        assert info is not None and info["progress"] == progress


def test_sigterm_sets_should_stop_and_the_checkpoint_is_reported(tmp_path: Path) -> None:
    code = ("import time\nfrom mlwe import workload as mw\n"
            "assert not mw.should_stop()\nprint('ready', flush=True)\n"
            "while not mw.should_stop():\n    time.sleep(0.01)\n"
            "mw.save_state({'at': 42}, progress=0.6, step=42)\nprint('saved', flush=True)\n")
    env = {"MLWE_CHECKPOINT_DIR": str(tmp_path / "ck"), "MLWE_WORKLOAD_ID": "w1"}
    rc, reports, out = run_child(code, env, term_after_ready=True)
    assert rc == 0 and out.strip() == "saved"
    assert [(m.get("checkpoint"), m.get("progress"), m.get("step")) for m in reports] == [
        (True, 0.6, 42)
    ]
    assert pickle.loads((tmp_path / "ck" / "state.pkl").read_bytes()) == {"at": 42}


def test_run_by_hand_it_works_without_a_daemon(tmp_path: Path) -> None:
    code = ("from mlwe import workload as mw\n"
            "mw.report(step=1, progress=0.5)\n"
            "mw.save_state({'x': 1}, progress=0.5)\n"
            "print(mw.checkpoint_dir(), mw.workload_id(), mw.attempt(), mw.gpu_indices())\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MLWE_") and k != "CUDA_VISIBLE_DEVICES"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [".mlwe-checkpoint", "None", "0", "[]"]
    assert (tmp_path / ".mlwe-checkpoint" / "state.pkl").exists()


def test_a_report_never_blocks_when_the_daemon_does_not_read() -> None:
    # nobody reads the pipe: its buffer fills, and reports are dropped instead of blocking
    # (a blocked program would hit the subprocess timeout)
    code = ("from mlwe import workload as mw\n"
            "for i in range(5000):\n    mw.report(step=i, loss=1.0, progress=0.5, a=1.0, b=2.0)\n"
            "print(mw.dropped_reports > 0, flush=True)\n")
    r, w = os.pipe()
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MLWE_REPORT_FD": str(w)},
                       pass_fds=(w,), capture_output=True, text=True, timeout=60)
    os.close(w)
    os.close(r)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"]


def test_gpu_indices_come_from_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert mw.gpu_indices() == [2, 5]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert mw.gpu_indices() == []
