"""The Ray runner's process logic without Ray: real programs, real signals, real trees.

What runs inside each Ray actor is :class:`ReplicaProcess`; these tests pin its
behaviour (graceful stop with a checkpoint, force after the grace, the whole
tree gone before stop returns, clear start errors, reports read from the
helper's pipe) on plain processes, so they are fast and need no cluster."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from mlwe.backends.ray.runner import (
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_START_FAILED,
    ReplicaProcess,
    ReplicaRunner,
    StartError,
    group_alive,
)

SYNTH = [sys.executable, "-m", "mlwe.programs.synthetic"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLWE_")}
    env.update(MLWE_WORKLOAD_ID="w", MLWE_ATTEMPT="1", MLWE_REPLICA="0",
               MLWE_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    env.update(extra)
    return env


def _wait_for(pred, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_graceful_stop_checkpoints_and_the_whole_tree_is_gone(tmp_path: Path) -> None:
    p = ReplicaProcess(
        [*SYNTH, "--work", "60", "--report-every", "0.05", "--children", "2",
         "--memory", "8Mi", "--child-memory", "8Mi", "--checkpoint-delay", "0.2"],
        _env(tmp_path),
    )
    pid = p.start()
    _wait_for(lambda: p.progress is not None and p.progress > 0)
    _wait_for(lambda: p.sample()["processes"] == 3.0)  # the program and its two children
    members = [c.pid for c in psutil.Process(pid).children(recursive=True)] + [pid]
    out = p.stop(10.0)
    assert out.exit_code == 0  # it checkpointed and exited by itself
    assert not out.forced
    assert out.survivors == ()
    assert out.checkpoint_progress is not None and out.checkpoint_progress > 0
    assert out.stop_s >= 0.2  # it took its checkpoint time, inside the grace
    assert group_alive(pid) == []
    for m in members:
        assert not psutil.pid_exists(m) or psutil.Process(m).status() == psutil.STATUS_ZOMBIE
    saved = (tmp_path / "ckpt" / "checkpoint.json").read_text()
    assert '"progress"' in saved
    reports = p.drain_reports()
    assert any(r.get("checkpoint") for r in reports)
    assert p.drain_reports() == []  # drained


def test_a_program_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    p = ReplicaProcess(
        [*SYNTH, "--work", "60", "--mode", "ignore-sigterm", "--children", "1",
         "--children-ignore-sigterm"],
        _env(tmp_path),
    )
    pid = p.start()
    _wait_for(lambda: p.sample()["processes"] == 2.0)
    t0 = time.monotonic()
    out = p.stop(0.5)
    assert out.forced
    assert out.exit_code == 128 + 9  # SIGKILL
    assert p.killed_by == "SIGKILL"
    assert out.survivors == ()
    assert time.monotonic() - t0 >= 0.5  # the grace was given
    assert group_alive(pid) == []


def test_grace_zero_is_a_force_stop(tmp_path: Path) -> None:
    p = ReplicaProcess([*SYNTH, "--work", "60"], _env(tmp_path))
    pid = p.start()
    _wait_for(lambda: p.sample().get("rss_mib", 0) > 0)
    out = p.stop(0)
    assert out.forced and out.exit_code == 137 and out.checkpoint_progress is None
    assert group_alive(pid) == []


def test_a_child_that_left_the_group_is_still_killed(tmp_path: Path) -> None:
    # the child calls setsid(): it is no longer in the program's group, but it is a descendant
    code = (
        "import os, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    p = ReplicaProcess([sys.executable, "-c", code], _env(tmp_path))
    pid = p.start()
    _wait_for(lambda: len(psutil.Process(pid).children()) == 1)
    child = psutil.Process(pid).children()[0]
    _wait_for(lambda: os.getsid(child.pid) == child.pid)
    out = p.stop(0.2)
    assert out.survivors == ()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_exit_code_and_metrics_of_a_program_that_ends(tmp_path: Path) -> None:
    p = ReplicaProcess([*SYNTH, "--work", "0.5", "--report-every", "0.05", "--memory", "40Mi"],
                       _env(tmp_path))
    p.start()
    samples = []
    while p.wait(0.1) is None:
        samples.append(p.sample())
    assert p.exit_code == 0 and p.killed_by is None
    assert max(s.get("rss_mib", 0.0) for s in samples) >= 40  # the touched 40 MiB are resident
    assert p.progress == 1.0
    assert "loss" in p.latest and "step" in p.latest


def test_crash_exit_code_is_reported(tmp_path: Path) -> None:
    p = ReplicaProcess([*SYNTH, "--work", "5", "--mode", "crash", "--at", "0", "--exit-code", "7"],
                       _env(tmp_path))
    p.start()
    assert p.wait(20) == 7


@pytest.mark.parametrize(
    ("argv", "env_extra", "code", "words"),
    [
        (["/nonexistent/program"], {}, EXIT_NOT_FOUND, "command not found: '/nonexistent/program'"),
        (["{tmp}/plain.txt"], {}, EXIT_NOT_EXECUTABLE, "command not executable"),
        (["true"], {"MLWE_CHECKPOINT_DIR": "/proc/mlwe-no"}, EXIT_START_FAILED,
         "checkpoint directory /proc/mlwe-no is not writable"),
    ],
    ids=["not-found", "not-executable", "checkpoint-dir-not-writable"],
)
def test_start_errors_are_clear(
    tmp_path: Path, argv: list[str], env_extra: dict[str, str], code: int, words: str
) -> None:
    (tmp_path / "plain.txt").write_text("not a program")  # mode 644: not executable
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(StartError) as info:
        ReplicaProcess(argv, _env(tmp_path, **env_extra)).start()
    assert info.value.exit_code == code
    assert words in str(info.value)


def test_empty_command_is_refused() -> None:
    with pytest.raises(StartError, match="no command"):
        ReplicaProcess([], {})


def test_runner_environment_and_stop_before_start(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    runner = ReplicaRunner({"workload": "w"})
    os.environ["MLWE_LEAK"] = "from-the-worker"  # an MLWE_* of the worker must not leak
    try:
        res = runner.start(
            [sys.executable, "-c",
             f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.environ.items())))"],
            {"MLWE_WORKLOAD_ID": "w", "CUDA_VISIBLE_DEVICES": "1,3"}, None,
            str(tmp_path / "logs" / "a1-r0.log"),
        )
    finally:
        del os.environ["MLWE_LEAK"]
    assert res["ok"] and res["pid"] > 0
    assert runner.wait() == {"code": 0, "signal": None}
    env = dict(eval(out.read_text()))  # our own file, written just above
    assert env["MLWE_WORKLOAD_ID"] == "w" and env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "MLWE_LEAK" not in env
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert (tmp_path / "logs" / "a1-r0.log").exists()

    # a stop that overtakes the start: the start is refused, nothing is left running
    r2 = ReplicaRunner({"workload": "w2"})
    assert r2.stop(5.0)["exit_code"] == -1
    res2 = r2.start([*SYNTH, "--work", "60"], {}, None, None)
    assert not res2["ok"] and "stopped before it started" in res2["error"]


class FakeNvml:
    """A test double for NVML (no GPU on this machine): two devices, fixed readings."""

    devices = ("gpu0", "gpu1")

    def sample(self, index: int) -> dict[str, float]:
        return {"gpu_util": [0.5, 0.9][index], "gpu_power_w": [100.0, 300.0][index]}

    def process_vram(self, index: int) -> dict[int, float]:
        return {1234: 1000.0 * (index + 1), 999: 5.0}  # pid 999 is not the replica's


def test_gpu_figures_are_measured_only_where_nvml_reads_them(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from mlwe.backends.ray import runner

    monkeypatch.setattr(runner, "_nvml_tried", True)
    monkeypatch.setattr(runner, "_nvml", None)
    assert runner.gpu_sample([0], [1234]) == {}  # no driver: nothing invented
    monkeypatch.setattr(runner, "_nvml", FakeNvml())
    assert runner.gpu_sample([0, 1], [1234]) == {
        "gpu_util": pytest.approx(0.7), "gpu_power_w": 400.0, "vram_used_mib": 3000.0}
    assert runner.gpu_sample([2], [1234]) == {}  # a device the machine does not have
