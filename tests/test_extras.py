"""The lean core install: engine, API, dashboard, store and bus work without the extras,
and what needs an extra says which one.

The heavy libraries (scikit-learn, SciPy, NumPy, matplotlib) and the optional
clients (Ray, NATS, psycopg, the LLM SDKs, MLflow) are installed in this venv
(the dev extra has them), so the checks run in a subprocess whose import system
refuses them (a meta path hook), as a ``pip install mlwe`` would leave it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
from packaging.requirements import Requirement

from mlwe.core.extras import EXTRAS, MissingExtra, missing_extra
from tests.api.conftest import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))

#: What ``pip install mlwe`` does not bring: every extra's modules.
BLOCKED = sorted({m for e in EXTRAS.values() for m in e.modules})

#: Prepended to each subprocess: the import system refuses every extra's modules.
BLOCKER = f"""
import sys
BLOCKED = {BLOCKED!r}
class _Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Block())
for m in [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]:
    del sys.modules[m]
"""

#: The modules that need an extra at import, and which one (every other mlwe module
#: must import on the core install).
NEEDS_EXTRA = {
    "mlwe.bus.nats": "nats",
    "mlwe.pipelines.drift_retrain": "pipelines",
    "mlwe.pipelines.inference_scaling": "pipelines",
    "mlwe.pipelines.loadgen": "pipelines",
    "mlwe.pipelines.programs.digits": "pipelines",
    "mlwe.pipelines.programs.digitsdata": "pipelines",
    "mlwe.pipelines.programs.infer_server": "pipelines",
}

HEAVY = {"matplotlib", "scikit-learn", "scipy", "numpy"}


def run_core(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _name(req: str) -> str:
    return Requirement(req).name.lower()


def test_the_core_dependencies_hold_none_of_the_heavy_libraries() -> None:
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not core & HEAVY, core & HEAVY
    assert "pydantic-settings" in core


def test_every_extra_in_pyproject_is_in_the_table_with_the_same_distributions() -> None:
    declared = {k: v for k, v in PYPROJECT["project"]["optional-dependencies"].items() if k != "dev"}
    assert set(declared) == set(EXTRAS)
    for name, reqs in declared.items():
        assert sorted(_name(r) for r in reqs) == sorted(EXTRAS[name].requires), name
    # make test installs the dev extra: it must hold every extra's distributions
    dev = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    missing = {d for e in EXTRAS.values() for d in e.requires} - dev
    assert not missing, f"the dev extra lacks {missing}"


def test_the_missing_extra_message_names_the_extra_and_the_command() -> None:
    exc = missing_extra("reports", ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"))
    assert isinstance(exc, ImportError)  # code that falls back on a missing import still does
    assert str(exc) == (
        "replay and compare plots (mlwe replay/compare --out) needs the optional 'reports'"
        " part of mlwe (no module named 'matplotlib'): install it with pip install 'mlwe[reports]'"
    )
    assert isinstance(missing_extra("pipelines"), MissingExtra)


def test_every_core_module_imports_without_the_extras() -> None:
    code = """
import importlib, json, pkgutil
import mlwe
from mlwe.core.extras import MissingExtra
out = {}
for m in pkgutil.walk_packages(mlwe.__path__, "mlwe."):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except MissingExtra as exc:
        out[m.name] = exc.extra.name
    except Exception as exc:
        out[m.name] = "BROKEN " + repr(exc)
print("RESULT", json.dumps(out, sort_keys=True))
"""
    r = run_core(code)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    import json

    assert json.loads(line[len("RESULT "):]) == NEEDS_EXTRA


def test_the_blocker_really_blocks() -> None:
    r = run_core("import numpy")
    assert r.returncode == 1 and "No module named 'numpy'" in r.stderr


def test_the_server_runs_and_stores_a_submission_without_the_extras(tmp_path: Path) -> None:
    port = free_port()
    code = f"""
sys.argv = ["mlwe", "serve", "--port", "{port}", "--data-dir", {str(tmp_path)!r}, "--no-generator"]
from mlwe.cli import main
main()
"""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MLWE_DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "-c", BLOCKER + code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("dashboard:"):
                break
        m = re.search(r"#token=(mlwe_\S+)", "".join(lines))
        assert m, "".join(lines)
        url, h = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {m.group(1)}"}
        assert wait_for(lambda: _status(f"{url}/readyz") == 200, timeout=60)
        r = httpx.post(f"{url}/api/v1/workloads", headers=h,
                       json={"id": "lean-1", "name": "lean", "resources": {"cpu": 1}})
        assert r.status_code in (200, 201, 202), r.text
        assert httpx.get(f"{url}/api/v1/workloads/lean-1", headers=h).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # the audit chain verifies on the core install too
    v = run_core(f"""
sys.argv = ["mlwe", "audit", "verify", "--data-dir", {str(tmp_path)!r}]
from mlwe.cli import main
main()
""")
    assert v.returncode == 0 and "audit chain ok" in v.stdout, v.stdout + v.stderr


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_replay_plots_without_matplotlib_say_which_extra_before_replaying(tmp_path: Path) -> None:
    r = run_core(f"""
sys.argv = ["mlwe", "replay", "synthetic", "--limit", "5", "--out", {str(tmp_path / 'out')!r}]
from mlwe.cli import main
main()
""")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'mlwe[reports]'" in r.stderr
    assert "no module named 'matplotlib'" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written
    # without --out a replay needs no extra
    ok = run_core("""
sys.argv = ["mlwe", "replay", "synthetic", "--limit", "5", "--json"]
from mlwe.cli import main
main()
""")
    assert ok.returncode == 0, ok.stderr


def test_pipeline_programs_and_case_studies_name_the_pipelines_extra(tmp_path: Path) -> None:
    r = run_core("""
sys.argv = ["train_digits"]
from mlwe.programs.train_digits import main
raise SystemExit(main())
""")
    assert r.returncode == 2
    assert r.stderr.strip().endswith("install it with pip install 'mlwe[pipelines]'"), r.stderr
    ex = run_core(f"""
sys.argv = ["mlwe", "example", "drift-retrain", "--data-dir", {str(tmp_path)!r}]
from mlwe.cli import main
main()
""")
    assert ex.returncode == 2, ex.stdout + ex.stderr
    assert "pip install 'mlwe[pipelines]'" in ex.stderr and "Traceback" not in ex.stderr
    # a pipeline step that runs a digits program fails with the same message in its log
    prog = run_core("import runpy; runpy.run_module('mlwe.pipelines.programs.digits', run_name='__main__')")
    assert prog.returncode == 1
    assert prog.stderr.strip().splitlines()[-1].endswith("pip install 'mlwe[pipelines]'")


def test_a_postgres_url_without_psycopg_names_the_postgres_extra() -> None:
    r = run_core("""
sys.argv = ["mlwe", "audit", "verify", "--database-url", "postgresql://u@127.0.0.1/x"]
from mlwe.cli import main
main()
""")
    assert r.returncode == 2
    assert "pip install 'mlwe[postgres]'" in r.stderr, r.stderr
