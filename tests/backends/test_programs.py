"""The built-in workload programs: synthetic's modes really behave so, and train_digits
resumes from a SIGTERM checkpoint to exactly the result of an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest


@dataclass
class Run:
    code: int
    reports: list[dict[str, Any]]
    stdout: str
    max_rss_mib: float = 0.0
    losses: list[float] = field(default_factory=list)


def run_program(module: str, args: list[str], ckpt: Path, *, term_when: Any = None,
                timeout: float = 60) -> Run:
    """Run ``python -m module args`` with a report pipe; ``term_when(reports)`` -> SIGTERM."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    env = {**os.environ, "MLWE_REPORT_FD": str(w), "MLWE_CHECKPOINT_DIR": str(ckpt),
           "MLWE_WORKLOAD_ID": "prog"}
    p = subprocess.Popen([sys.executable, "-m", module, *args], env=env, pass_fds=(w,),
                         stdout=subprocess.PIPE, text=True)
    os.close(w)
    buf = b""
    reports: list[dict[str, Any]] = []
    max_rss = 0.0
    termed = False
    proc = psutil.Process(p.pid)
    end = time.monotonic() + timeout
    while True:
        try:
            chunk = os.read(r, 65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                reports.append(json.loads(line))
        elif chunk == b"" and p.poll() is not None:
            break
        with contextlib.suppress(psutil.Error):
            max_rss = max(max_rss, proc.memory_info().rss / 2**20)
        if term_when is not None and not termed and term_when(reports):
            p.send_signal(signal.SIGTERM)
            termed = True
        if time.monotonic() >= end:
            p.kill()  # never left behind (a held program would wait for ever)
            p.wait()
            raise AssertionError("program did not finish")
        time.sleep(0.01)
    os.close(r)
    out = p.stdout.read() if p.stdout else ""
    p.wait()
    losses = [m["loss"] for m in reports if "loss" in m]
    return Run(p.returncode, reports, out, max_rss, losses)


SYNTH = "mlwe.programs.synthetic"
BASE = ["--work", "1.0", "--report-every", "0.05", "--phases", "0.3:1", "--memory", "8Mi"]


def _past(fraction: float) -> Any:
    return lambda reps: any(m.get("progress", 0) > fraction for m in reps)


#: name -> (module, args, SIGTERM when); run all at once (they mostly sleep), asserted below
RUNS: dict[str, tuple[str, list[str], Any]] = {
    "normal": (SYNTH, BASE, None),
    "diverge": (SYNTH, [*BASE, "--mode", "diverge", "--at", "0.3"], None),
    "nan": (SYNTH, [*BASE, "--mode", "nan", "--at", "0.5"], None),
    "plateau": (SYNTH, [*BASE, "--mode", "plateau", "--at", "0.2"], None),
    "leak": (SYNTH, [*BASE, "--mode", "leak", "--leak", "64Mi"], None),
    "resident": (SYNTH, ["--work", "0.8", "--memory", "96Mi", "--phases", "0.1:1"], None),
    "crash": (SYNTH, [*BASE, "--mode", "crash", "--at", "0.3", "--exit-code", "7"], None),
    "ignore-sigterm": (SYNTH, [*BASE, "--mode", "ignore-sigterm"], _past(0.2)),
    "interrupted": (SYNTH, [*BASE, "--work", "1.5"], _past(0.2)),
    "digits-straight": ("mlwe.programs.train_digits", ["--epochs", "3", "--seed", "4"], None),
    "digits-interrupted": (
        "mlwe.programs.train_digits", ["--epochs", "3", "--seed", "4", "--batch-delay", "0.01"],
        lambda reps: any(m.get("progress", 0) > 0 for m in reps[1:]),
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("programs")
    with ThreadPoolExecutor(max_workers=len(RUNS)) as pool:
        futures = {name: pool.submit(run_program, module, args, base / name, term_when=when)
                   for name, (module, args, when) in RUNS.items()}
        done = {name: f.result() for name, f in futures.items()}
    done["_base"] = Run(0, [], str(base))
    return done


def progresses(run: Run) -> list[float]:
    return [m["progress"] for m in run.reports if "progress" in m]


def test_normal_mode_falls_in_loss_and_finishes(runs: dict[str, Run]) -> None:
    run = runs["normal"]
    assert run.code == 0
    assert progresses(run)[-1] == 1.0
    assert len(run.losses) >= 5
    assert run.losses[-1] < run.losses[0] / 2


def test_diverge_mode_blows_up_after_its_point(runs: dict[str, Run]) -> None:
    run = runs["diverge"]
    assert run.code == 0
    assert run.losses[-1] > 4 * min(run.losses)


def test_nan_mode_reports_nan_losses(runs: dict[str, Run]) -> None:
    run = runs["nan"]
    assert any(math.isnan(x) for x in run.losses)
    assert not math.isnan(run.losses[0])


def test_plateau_mode_stops_improving(runs: dict[str, Run]) -> None:
    run = runs["plateau"]
    late = [m["loss"] for m in run.reports if "loss" in m and m["progress"] >= 0.3]
    assert len(late) >= 3
    assert max(late) - min(late) < 0.05  # noise only
    assert run.losses[0] - min(late) > 0.2  # it did improve before


def test_leak_mode_really_grows_its_memory(runs: dict[str, Run]) -> None:
    run = runs["leak"]
    mem = [m["metrics"]["memory_mib"] for m in run.reports if "memory_mib" in m.get("metrics", {})]
    assert mem[-1] >= mem[0] + 30
    assert run.max_rss_mib >= 8 + 30  # resident, not just reserved


def test_memory_is_resident(runs: dict[str, Run]) -> None:
    run = runs["resident"]
    assert run.code == 0
    assert run.max_rss_mib >= 96


def test_crash_mode_exits_with_its_code(runs: dict[str, Run]) -> None:
    run = runs["crash"]
    assert run.code == 7
    assert max(progresses(run)) < 0.6


def test_ignore_sigterm_mode_runs_on_after_sigterm(runs: dict[str, Run]) -> None:
    run = runs["ignore-sigterm"]
    assert run.code == 0
    assert progresses(run)[-1] == 1.0
    assert not (Path(runs["_base"].stdout) / "ignore-sigterm" / "state.pkl").exists()


def test_sigterm_checkpoints_and_the_next_run_resumes(runs: dict[str, Run]) -> None:
    first = runs["interrupted"]
    assert first.code == 0
    (ckpt,) = [m for m in first.reports if m.get("checkpoint")]
    assert 0.2 < ckpt["progress"] < 1.0
    second = run_program(SYNTH, [*BASE, "--work", "1.5"], Path(runs["_base"].stdout) / "interrupted")
    assert second.code == 0
    assert second.reports[0]["metrics"]["resumed_from"] == pytest.approx(ckpt["progress"])
    assert "resumed from a checkpoint" in second.stdout


def _at_barrier(reps: list[dict[str, Any]]) -> int:
    """Reports at the same progress, at least half the work: a program held at 0.5."""
    ps = [m["progress"] for m in reps if "progress" in m]
    return sum(1 for x in ps if ps[-1] >= 0.5 and x == ps[-1])


def test_a_held_program_waits_at_its_barrier_until_released(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    seen_before: list[int] = []

    def release_when_held(reps: list[dict[str, Any]]) -> bool:
        if not gate.exists() and _at_barrier(reps) >= 5:  # it sits at half its work
            seen_before.append(len(reps))
            gate.touch()
        return False

    run = run_program(SYNTH, [*BASE, "--hold-at", "0.5", "--hold-file", str(gate)],
                      tmp_path / "ckpt", term_when=release_when_held)
    assert run.code == 0
    assert progresses(run)[-1] == 1.0
    (n,) = seen_before
    before = progresses(Run(0, run.reports[:n], ""))
    assert max(before) < 0.6  # nothing past the barrier before the release
    # held, it keeps its loss curve and memory reports coming (it looks like running)
    assert all("loss" in m for m in run.reports[1:n])


def test_a_held_program_still_checkpoints_and_stops_on_sigterm(tmp_path: Path) -> None:
    run = run_program(SYNTH, [*BASE, "--hold-at", "0.5", "--hold-file", str(tmp_path / "never")],
                      tmp_path / "ckpt", term_when=lambda reps: _at_barrier(reps) >= 3)
    assert run.code == 0
    (ckpt,) = [m for m in run.reports if m.get("checkpoint")]
    assert 0.5 <= ckpt["progress"] < 0.6
    assert "stopped by SIGTERM while held" in run.stdout


def test_bad_arguments_are_refused_clearly(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", SYNTH, "--phases", "fast"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "phase 'fast' is not DUTY:SECONDS" in r.stderr
    r = subprocess.run([sys.executable, "-m", SYNTH, "--memory", "lots"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "not a size: 'lots'" in r.stderr
    r = subprocess.run([sys.executable, "-m", SYNTH, "--hold-at", "0.5"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert "--hold-at (a fraction in [0, 1]) and --hold-file go together" in r.stderr


def result_of(run: Run) -> dict[str, Any]:
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    loaded: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return loaded


def test_train_digits_resumes_to_the_same_result(runs: dict[str, Run]) -> None:
    straight = runs["digits-straight"]
    assert straight.code == 0
    expected = result_of(straight)
    assert expected["test_accuracy"] > 0.85  # it really learns
    interrupted = runs["digits-interrupted"]
    assert interrupted.code == 0
    assert "stopped by SIGTERM" in interrupted.stdout
    (ckpt,) = [m for m in interrupted.reports if m.get("checkpoint")]
    assert 0 < ckpt["progress"] < 1
    resumed = run_program("mlwe.programs.train_digits", ["--epochs", "3", "--seed", "4"],
                          Path(runs["_base"].stdout) / "digits-interrupted")
    assert resumed.code == 0
    assert "resumed at epoch" in resumed.stdout
    assert resumed.reports[0]["metrics"]["resumed_from"] == pytest.approx(ckpt["progress"])
    assert result_of(resumed) == expected  # the same weights, bit for bit
