"""Device check: the whole engine on a GPU machine, a real CUDA job through the API.

Run on a machine with an NVIDIA GPU and PyTorch (the project's device checks):

    OUT=/tmp/out python benchmarks/device_check_serve_gpu.py

It starts ``mlwe serve --backend local --no-generator`` (SQLite store, real daemon,
rules agent), reads the first-start admin token from its output, submits a CUDA
workload (``tests/backends/test_local_gpu.py``'s program: hold 8 GiB of VRAM and
multiply bf16 matrices for 15 s) over HTTP, follows the telemetry stream, and
checks: the GPU node is this machine's device as its catalogue model, the job
sees only its device, its VRAM and utilisation come from NVML (nothing labelled
declared), the node's figures too, and the audit chain verifies. It prints a
JSON summary (also written to ``$OUT/serve_gpu.json``) and exits 1 if a check
fails. Without a GPU it runs too, and the GPU checks fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mlwe.backends.local.telemetry import Nvml, catalog_model
from mlwe.client import Client

ROOT = Path(__file__).resolve().parent.parent
PORT = int(os.environ.get("MLWE_CHECK_PORT", "8765"))
GPU_NODE = "local-gpu-0"


def _program() -> str:
    text = (ROOT / "tests/backends/test_local_gpu.py").read_text()
    return text.split("PROG = r'''")[1].split("'''")[0]


def _token(log: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(r"#token=(\S+)\n", log.read_text())
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise SystemExit("mlwe serve exited:\n" + log.read_text()[-3000:])
        time.sleep(0.3)
    raise SystemExit("no admin token in mlwe serve's output")


def _follow(client: Client, into: list[dict[str, Any]], **kw: Any) -> None:
    """Collect telemetry payloads from the live stream (on a daemon thread)."""

    def run() -> None:
        for ev in client.stream(topics=("telemetry",), **kw):
            into.append(ev.data.get("data", ev.data))

    threading.Thread(target=run, daemon=True).start()


def _max(samples: list[dict[str, Any]], *keys: str) -> dict[str, float | None]:
    return {k: max((s.get("metrics", {}).get(k, 0.0) for s in samples), default=None)
            for k in keys}


def check(out: Path, work: Path) -> dict[str, Any]:
    (work / "prog.py").write_text(_program())
    log = out / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlwe.cli", "serve", "--backend", "local", "--no-generator",
             "--port", str(PORT), "--data-dir", str(work / "data")],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    summary: dict[str, Any] = {}
    try:
        t0 = time.time()
        token = _token(log, proc, 120)
        url = f"http://127.0.0.1:{PORT}"
        c = Client(url, token)
        while time.time() - t0 < 120:
            try:
                if c._http.get("/readyz").status_code == 200:
                    break
            except Exception:  # not listening yet
                pass
            time.sleep(0.3)
        summary["startup_s"] = round(time.time() - t0, 1)
        summary["nodes"] = [{k: n.get(k) for k in ("name", "gpus", "gpu_model", "status")}
                            for n in c.nodes()]
        mine: list[dict[str, Any]] = []
        everything: list[dict[str, Any]] = []
        _follow(Client(url, token), mine, workload="gpu-burn")
        _follow(Client(url, token), everything)
        time.sleep(1)
        spec = {"id": "gpu-burn", "name": "gpu burn", "priority": "high", "max_retries": 0,
                "estimated_duration": 15,
                "resources": {"gpu": 1, "vram": "10Gi", "cpu": "500m", "memory": "1Gi"},
                "command": [sys.executable, str(work / "prog.py"), "--out",
                            str(work / "run.jsonl"), "--hold-gib", "8", "--seconds", "15"]}
        c.submit([spec])
        w: dict[str, Any] = {}
        while time.time() - t0 < 240:
            w = c.workload("gpu-burn")
            if w.get("state") in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        time.sleep(2.5)  # the last samples
        runs = work / "run.jsonl"
        run = json.loads(runs.read_text().splitlines()[0]) if runs.exists() else {}
        node = [s for s in everything if s.get("workload") is None and s.get("node") == GPU_NODE]
        summary.update(
            state=w.get("state"), run=run, stream_samples=len(mine),
            workload_max=_max(mine, "vram_used_mib", "gpu_util", "gpu_power_w", "cpu_pct",
                              "rss_mib"),
            workload_declared=sorted({x for s in mine for x in s.get("declared", [])}),
            node_samples=len(node), node_max=_max(node, "vram_used_mib", "gpu_util",
                                                  "gpu_power_w"),
            stored_samples=len(c.get("/telemetry", workload="gpu-burn")["items"]),
            audit=c.verify_audit(), explain=c.explain("gpu-burn").get("summary"),
        )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    nv = Nvml.open()
    want = catalog_model(nv.devices[0].memory_mib, nv.devices[0].name) if nv else None
    summary["checks"] = {
        "the GPU node is this machine's device": want is not None and any(
            n["name"] == GPU_NODE and n["gpu_model"] == want for n in summary["nodes"]),
        "succeeded": summary["state"] == "succeeded",
        "sees only its device": summary["run"].get("cuda_visible_devices") == "0"
        and summary["run"].get("device_count") == 1,
        "its VRAM is measured": (summary["workload_max"]["vram_used_mib"] or 0) >= 8192,
        "its utilisation is measured": (summary["workload_max"]["gpu_util"] or 0) >= 0.5,
        "nothing labelled declared": summary["stream_samples"] > 0
        and summary["workload_declared"] == [],
        "the node's VRAM is measured": (summary["node_max"]["vram_used_mib"] or 0) >= 8192,
        "the audit chain verifies": bool(summary["audit"].get("ok")),
    }
    return summary


def main() -> int:
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="mlwe-device-check-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlwe-serve-gpu-") as work:
        summary = check(out, Path(work))
    text = json.dumps(summary, indent=1, default=str)
    (out / "serve_gpu.json").write_text(text)
    print(text)
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
