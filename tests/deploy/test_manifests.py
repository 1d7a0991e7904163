"""deploy/: the systemd unit and the Kubernetes manifest agree with the code and the image.

Each file is parsed (the Containerfile by its instructions, the manifest as YAML, the unit
by its sections) and cross-checked: ports, the user and its uid, probe paths (routes the
API serves without a token), the data directory, and every ``MLWE_*`` name (a setting of
``mlwe serve``, with a value its settings accept).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from mlwe.api.app import PUBLIC_PATHS
from mlwe.runtime.settings import SERVE_ENV_VARS, ServeSettings

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
K8S = ROOT / "deploy/kubernetes/mlwe.yaml"
UNIT = ROOT / "deploy/systemd/mlwe.service"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# ------------------------------------------------------------------ parsers
def containerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for ln in joined.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


class Image:
    """What the Containerfile's final stage declares."""

    def __init__(self, text: str) -> None:
        instrs = containerfile(text)
        last_from = max(i for i, (w, _) in enumerate(instrs) if w == "FROM")
        self.args: dict[str, str] = {}
        self.env: dict[str, str] = {}
        self.run: list[str] = []
        self.expose: list[int] = []
        self.volumes: list[str] = []
        self.user = self.healthcheck = ""
        self.entrypoint: list[str] = []
        for i, (word, rest) in enumerate(instrs):
            if word == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                self.args[k] = v.strip('"')
            if i < last_from:
                continue
            if word == "ENV":
                self.env.update(kv.split("=", 1) for kv in shlex.split(rest))
            elif word == "RUN":
                self.run.append(rest)
            elif word == "EXPOSE":
                self.expose += [int(p.split("/")[0]) for p in rest.split()]
            elif word == "VOLUME":
                self.volumes += json.loads(rest)
            elif word == "USER":
                self.user = re.sub(r"\$\{(\w+)\}", lambda m: self.args[m.group(1)], rest)
            elif word == "HEALTHCHECK":
                self.healthcheck = rest
            elif word == "ENTRYPOINT":
                self.entrypoint = json.loads(rest)

    @property
    def uid(self) -> int:
        return int(self.user.split(":")[0])

    @property
    def gid(self) -> int:
        return int(self.user.split(":")[1])

    @property
    def user_name(self) -> str:
        """The name of the passwd entry the final stage writes for the uid."""
        for r in self.run:
            m = re.search(r"([a-z_][a-z0-9_-]*):x:\$\{MLWE_UID\}:", r)
            if m:
                return m.group(1)
        raise AssertionError("the Containerfile writes no passwd entry for MLWE_UID")


def systemd_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values in order]}} (a key may repeat, as Environment= does)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for raw in text.splitlines():
        ln = raw.strip()
        if not ln or ln.startswith(("#", ";")):
            continue
        if ln.startswith("["):
            section = ln.strip("[]")
            continue
        k, _, v = ln.partition("=")
        out[section][k.strip()].append(v.strip())
    return out


IMAGE = Image(CONTAINERFILE.read_text())
DOCS = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
UNIT_CFG = systemd_unit(UNIT.read_text())


def kind(k: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == k]
    return doc


def _container() -> dict[str, Any]:
    (c,) = kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def _k8s_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container()["env"] if "value" in e}


def _unit_env() -> dict[str, str]:
    return dict(v.split("=", 1) for v in UNIT_CFG["Service"]["Environment"])


def _settings_of(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> ServeSettings:
    """What mlwe serve makes of ``env`` (other MLWE_* variables of this machine removed)."""
    import os

    for k in list(os.environ):
        if k.upper().startswith("MLWE_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ServeSettings.load()


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    from tests.api.conftest import make_api

    api = make_api(tmp_path_factory.mktemp("routes"))
    try:
        return {getattr(r, "path", "") for r in api.svc.app.routes}
    finally:
        api.svc.close()


# ------------------------------------------------------------------ the image
def test_the_image_runs_mlwe_serve_as_a_non_root_user_on_its_data_volume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert IMAGE.entrypoint == ["mlwe", "serve"]
    assert IMAGE.uid == int(IMAGE.args["MLWE_UID"]) == IMAGE.gid and IMAGE.uid != 0
    assert IMAGE.user_name == "mlwe"
    assert IMAGE.volumes == [IMAGE.env["MLWE_DATA_DIR"]]
    assert IMAGE.expose == [int(IMAGE.env["MLWE_PORT"])]
    assert set(k for k in IMAGE.env if k.startswith("MLWE_")) <= set(SERVE_ENV_VARS)
    s = _settings_of({k: v for k, v in IMAGE.env.items() if k.startswith("MLWE_")}, monkeypatch)
    assert (s.host, s.port, str(s.data_dir), s.generator) == ("0.0.0.0", 8080, "/var/lib/mlwe", False)
    # the health check asks /readyz on the configured port
    assert "/readyz" in IMAGE.healthcheck and "MLWE_PORT" in IMAGE.healthcheck
    assert IMAGE.args["BASE"].startswith("docker.io/library/python:3.11-slim")


def test_the_probe_paths_are_served_without_a_token(routes: set[str]) -> None:
    for path in ("/readyz", "/healthz"):
        assert path in routes and path in PUBLIC_PATHS


# ------------------------------------------------------------------ Kubernetes
def test_the_manifest_has_a_deployment_a_service_and_a_claim_that_fit_together() -> None:
    assert sorted(d["kind"] for d in DOCS) == ["Deployment", "PersistentVolumeClaim", "Service"]
    dep, svc, pvc = kind("Deployment"), kind("Service"), kind("PersistentVolumeClaim")
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    c = _container()
    assert c["image"].endswith(f":{VERSION}")
    # ports: the Service targets the container's named port, which is the image's
    (port,) = c["ports"]
    assert port["containerPort"] == IMAGE.expose[0] == int(_k8s_env()["MLWE_PORT"])
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] == port["name"]


def test_the_probes_ask_the_served_health_paths_on_the_container_port(routes: set[str]) -> None:
    c = _container()
    names = {p["name"] for p in c["ports"]}
    probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for name, probe in probes.items():
        path, port = probe["httpGet"]["path"], probe["httpGet"]["port"]
        assert path in routes and path in PUBLIC_PATHS, name
        assert port in names or port == IMAGE.expose[0], name
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_security_context_matches_the_image() -> None:
    pod = kind("Deployment")["spec"]["template"]["spec"]
    psc, csc = pod["securityContext"], _container()["securityContext"]
    assert psc["runAsNonRoot"] is True and csc["runAsNonRoot"] is True
    assert psc["runAsUser"] == csc["runAsUser"] == IMAGE.uid
    assert psc["runAsGroup"] == csc["runAsGroup"] == psc["fsGroup"] == IMAGE.gid
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    # a read-only root: the server writes only to its data volume and /tmp
    assert csc["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    assert set(mounts) == {IMAGE.env["MLWE_DATA_DIR"], "/tmp"}
    assert IMAGE.env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_the_manifest_sets_only_serve_settings_with_values_they_accept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {e["name"] for e in _container()["env"]}
    assert names <= set(SERVE_ENV_VARS), names - set(SERVE_ENV_VARS)
    env = _k8s_env()
    for k in ("MLWE_HOST", "MLWE_PORT", "MLWE_DATA_DIR"):
        assert env[k] == IMAGE.env[k], k
    s = _settings_of(env, monkeypatch)
    assert s.port == IMAGE.expose[0] and str(s.data_dir) == IMAGE.env["MLWE_DATA_DIR"]


# ------------------------------------------------------------------ systemd
def test_the_unit_runs_mlwe_serve_as_the_image_user_with_serve_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    svc = UNIT_CFG["Service"]
    assert svc["User"] == [IMAGE.user_name] and svc["Group"] == [IMAGE.user_name]
    (exec_start,) = svc["ExecStart"]
    prog, *args = shlex.split(exec_start)
    assert Path(prog).name == "mlwe" and args == ["serve"]
    env = _unit_env()
    names = {k for k in env if k.startswith("MLWE_")}
    assert names <= set(SERVE_ENV_VARS), names - set(SERVE_ENV_VARS)
    for k in ("MLWE_HOST", "MLWE_PORT", "MLWE_DATA_DIR", "MLWE_GENERATOR"):
        assert env[k] == IMAGE.env[k], k
    # StateDirectory= makes /var/lib/<name>, owned by User=: the data directory
    assert env["MLWE_DATA_DIR"] == f"/var/lib/{svc['StateDirectory'][0]}"
    s = _settings_of({k: env[k] for k in names}, monkeypatch)
    assert s.port == IMAGE.expose[0]
    assert UNIT_CFG["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_accepts_every_key_of_the_unit() -> None:
    if shutil.which("systemd-analyze") is None:
        why = "systemd-analyze not installed (`make image-tools` installs systemd as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why + ": the unit's keys are not checked by systemd")
    r = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True,
                       timeout=60)
    # the only complaint allowed: the venv of a host install is not on this machine
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    other = [ln for ln in lines if "/opt/mlwe/bin/mlwe is not executable" not in ln]
    assert not other, other
