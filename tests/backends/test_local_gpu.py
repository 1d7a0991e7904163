"""The local backend with a real GPU: a CUDA program (PyTorch) run by a real daemon.

These run only where NVML finds an NVIDIA GPU and PyTorch can use it (the project's
device checks); elsewhere the GPU figures are the declared allocation, which
``test_local.py`` covers. What they prove on the hardware:

- the daemon hands the workload exactly its assigned device (``CUDA_VISIBLE_DEVICES``);
- the workload's GPU figures (utilisation, its own VRAM, power) come from NVML and
  are not labelled declared, per workload and per node;
- an eviction really frees the VRAM: the preemptor, which needs more memory than
  is left beside the victim, finds it free at its start and allocates it.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from mlwe.backends.local.telemetry import Nvml, catalog_model, machine_memory_mib
from mlwe.core import NodeSpec, State, WorkloadSpec
from mlwe.core.backend import StartCommand
from mlwe.core.catalog import DEFAULT_CATALOG
from tests.backends.harness import LocalHarness

PY = sys.executable
GIB = 1024.0  # MiB


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


_NV = Nvml.open()
pytestmark = pytest.mark.skipif(_NV is None or not _cuda(),
                                reason="needs an NVIDIA GPU (NVML) and PyTorch with CUDA")

#: A CUDA workload: hold ``--hold-gib`` of VRAM and multiply bf16 matrices for
#: ``--seconds`` in all (across attempts: it saves what it did on a stop and resumes).
PROG = r'''
import argparse, json, os, time
import torch
from mlwe import workload

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--hold-gib", type=float, required=True)
ap.add_argument("--seconds", type=float, required=True)
a = ap.parse_args()
done = (workload.resume_state() or {}).get("done", 0.0)
free, total = torch.cuda.mem_get_info()
info = {"attempt": workload.attempt(), "t_start": time.time(), "resumed_from": done,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_count": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0),
        "free_at_start_mib": free / 2**20, "total_mib": total / 2**20}
hold = torch.empty(int(a.hold_gib * 2**30), dtype=torch.uint8, device="cuda")
hold.fill_(1)
torch.cuda.synchronize()
info["held_mib"] = hold.numel() / 2**20
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t0, step = time.monotonic(), 0
while done + (time.monotonic() - t0) < a.seconds and not workload.should_stop():
    for _ in range(10):
        x = (x @ x).clamp_(-1, 1)
    torch.cuda.synchronize()
    step += 1
    workload.report(step=step, progress=min(1.0, (done + time.monotonic() - t0) / a.seconds))
done += time.monotonic() - t0
stopped = workload.should_stop()
if stopped:
    workload.save_state({"done": done}, progress=min(1.0, done / a.seconds))
del hold
torch.cuda.synchronize()
info.update(steps=step, stopped=stopped, t_end=time.time())
with open(a.out, "a") as f:
    f.write(json.dumps(info) + "\n")
raise SystemExit(0)
'''


def gpu_node(h: LocalHarness) -> NodeSpec:
    """One node over GPU 0, declared as the biggest catalogue model that device holds."""
    assert _NV is not None
    dev = _NV.devices[0]
    model = catalog_model(dev.memory_mib, dev.name)
    assert model is not None, dev
    # a Firecracker machine's memory starts small and grows: declare what it has now
    memory = min(16384, machine_memory_mib() // 2)
    return NodeSpec.model_validate({"name": "g0", "cpu": "4", "memory": f"{memory}Mi",
                                    "gpus": 1, "gpu_model": model})


def cuda_job(h: LocalHarness, wid: str, *, hold_gib: float, seconds: float,
             priority: str = "normal") -> WorkloadSpec:
    prog = h.tmp / "gpu_prog.py"
    prog.write_text(PROG)
    return WorkloadSpec.model_validate({
        "id": wid, "name": wid, "priority": priority, "max_retries": 0,
        "estimated_duration": seconds,
        "resources": {"gpu": 1, "vram": f"{int(hold_gib) + 2}Gi", "cpu": "1",
                      "memory": "1Gi"},
        "command": [PY, str(prog), "--out", str(h.tmp / f"{wid}.jsonl"),
                    "--hold-gib", str(hold_gib), "--seconds", str(seconds)],
    })


def runs(h: LocalHarness, wid: str) -> list[dict[str, object]]:
    path = h.tmp / f"{wid}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_cuda_workload_gets_its_device_and_nvml_measures_it(h: LocalHarness) -> None:
    h.start([gpu_node(h)])
    h.submit(cuda_job(h, "burn", hold_gib=8, seconds=8))
    h.run_until(lambda: h.state("burn") is State.SUCCEEDED, timeout=120, what="burn")
    (run,) = runs(h, "burn")
    (start,) = h.starts("burn")
    assert tuple(start.placement[0].devices) == (0,)
    assert run["cuda_visible_devices"] == "0" and run["device_count"] == 1
    assert run["held_mib"] == 8 * GIB and run["steps"] > 0  # type: ignore[operator]
    mine = [t for t in h.metrics("burn") if "cpu_pct" in t.metrics]
    assert mine and all(t.declared == () for t in mine)
    assert "gpus" not in mine[-1].metrics  # a measured figure, not the allocation
    # the workload's own VRAM (its processes, as NVML lists them), utilisation and power
    vram = max(t.metrics.get("vram_used_mib", 0.0) for t in mine)
    assert 8 * GIB <= vram <= 8 * GIB + 4 * GIB, vram
    assert max(t.metrics.get("gpu_util", 0.0) for t in mine) >= 0.5
    assert max(t.metrics.get("gpu_power_w", 0.0) for t in mine) > 0
    node = [t for t in h.metrics(None, "g0") if "cpu_util" in t.metrics]
    assert node and all(t.declared == () for t in node)
    assert max(t.metrics.get("vram_used_mib", 0.0) for t in node) >= 8 * GIB
    assert max(t.metrics.get("gpu_util", 0.0) for t in node) >= 0.5
    assert all(0.0 <= t.metrics.get("gpu_util", 0.0) <= 1.0 for t in node)
    assert h.rejected() == []
    print(f"\nGPU {run['name']}: workload vram_used_mib max {vram:.0f}, gpu_util max "
          f"{max(t.metrics.get('gpu_util', 0.0) for t in mine):.2f}, gpu_power_w max "
          f"{max(t.metrics.get('gpu_power_w', 0.0) for t in mine):.0f}, "
          f"{len(mine)} workload samples, {run['steps']} steps")


def test_an_eviction_frees_the_vram_before_the_preemptor_starts(h: LocalHarness) -> None:
    g0 = gpu_node(h)
    total = DEFAULT_CATALOG[g0.gpu_model or ""].vram_mib / GIB
    victim_gib, urgent_gib = round(total * 0.45), round(total * 0.7)  # together: too much
    h.start([g0])
    h.submit(cuda_job(h, "batch", hold_gib=victim_gib, seconds=20, priority="low"))
    h.run_until(lambda: any(t.metrics.get("vram_used_mib", 0.0) >= victim_gib * GIB
                            for t in h.metrics(None, "g0")),
                timeout=120, what="the victim to hold its VRAM")
    h.submit(cuda_job(h, "urgent", hold_gib=urgent_gib, seconds=3, priority="urgent"))
    h.run_until(lambda: h.state("urgent") is State.SUCCEEDED, timeout=120, what="urgent")
    (urgent,) = runs(h, "urgent")
    first = runs(h, "batch")[0]
    assert first["stopped"] is True  # it checkpointed on SIGTERM, in its grace period
    assert first["t_end"] <= urgent["t_start"]  # type: ignore[operator]
    assert urgent["free_at_start_mib"] >= urgent_gib * GIB  # type: ignore[operator]
    assert urgent["held_mib"] == urgent_gib * GIB
    # the victim resumes from its checkpoint and finishes its 20 s of work
    h.run_until(lambda: h.state("batch") is State.SUCCEEDED, timeout=120, what="batch")
    second = runs(h, "batch")[1]
    assert second["attempt"] > first["attempt"]  # type: ignore[operator]
    assert second["resumed_from"] > 0  # type: ignore[operator]
    assert [c.workload for c in h.sent if isinstance(c, StartCommand)] == ["batch", "urgent",
                                                                          "batch"]
    assert h.rejected() == []
    victim = h.cp.get("batch")
    asked = next(t.time for t in victim.history if t.target is State.PREEMPTING)
    released = next(t.time for t in victim.history if t.target is State.PREEMPTED)
    print(f"\nvictim held {first['held_mib']:.0f} MiB; stop asked -> release confirmed "
          f"{released - asked:.2f} s; victim end -> urgent start "
          f"{urgent['t_start'] - first['t_end']:.2f} s; urgent found "  # type: ignore[operator]
          f"{urgent['free_at_start_mib']:.0f} MiB free, held {urgent['held_mib']:.0f} MiB")
