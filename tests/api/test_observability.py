"""Logs and metrics: JSON-line logs with correlation ids, the access log, one line per
decision; /metrics public only by choice; per-node, per-model, per-queue series; and a
Grafana dashboard whose every query names a metric the server really exports."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlwe.api.auth import Role
from mlwe.api.context import ApiSettings
from mlwe.runtime.logs import LogConfigError, configure_logging
from tests.api.conftest import Api, make_api, wait_for

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mlwe-dashboard.json"


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = configure_logging("json", "info", stream=buf)
    try:
        yield buf
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logging.getLogger("uvicorn.access").disabled = False


def _lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_logs_carry_levels_correlation_ids_and_one_line_per_decision(
    api: Api, json_logs: io.StringIO
) -> None:
    r = api.client.post(
        "/api/v1/workloads",
        json={"id": "log-1", "name": "log-1", "resources": {"cpu": 1}, "estimated_duration": 3600},
        headers={**api.h(Role.SUBMITTER), "X-Correlation-ID": "req-42"},
    )
    assert r.status_code == 201 and r.headers["x-correlation-id"] == "req-42"
    assert api.client.get("/api/v1/workloads/nope", headers=api.h(Role.VIEWER)).status_code == 404
    assert wait_for(lambda: any(x.get("decision") == "place" and x.get("workload") == "log-1"
                                for x in _lines(json_logs)))
    lines = _lines(json_logs)
    access = [x for x in lines if x["logger"] == "mlwe.access"]
    submit = next(x for x in access if x["route"] == "/api/v1/workloads" and x["method"] == "POST")
    assert submit["status"] == 201 and submit["correlation_id"] == "req-42" and submit["level"] == "info"
    assert isinstance(submit["duration_ms"], float)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(submit["time"]))
    missing = next(x for x in access if x["status"] == 404)
    assert missing["route"] == "/api/v1/workloads/{workload_id}" and len(str(missing["correlation_id"])) == 16
    place = next(x for x in lines if x.get("decision") == "place" and x.get("workload") == "log-1")
    # the engine files a client's id under the token's subject (see test_tenancy.py)
    assert place["logger"] == "mlwe.decision" and place["correlation_id"] == r.json()["correlation_id"]
    assert r.json()["correlation_id"].endswith(".req-42")
    assert place["policy"] and place["chosen"] and isinstance(place["reasons"], list)


def test_log_configuration_is_checked() -> None:
    with pytest.raises(LogConfigError, match="log format 'xml'"):
        configure_logging("xml")
    with pytest.raises(LogConfigError, match="log level 'loud'"):
        configure_logging("json", "loud")


def test_metrics_need_a_token_unless_the_operator_makes_them_public(api: Api, tmp_path: Path) -> None:
    assert api.client.get("/metrics").status_code == 401
    assert api.client.get("/metrics", headers=api.h(Role.VIEWER)).status_code == 200
    public = make_api(tmp_path / "public", settings=ApiSettings(public_metrics=True))
    try:
        r = public.client.get("/metrics")
        assert r.status_code == 200 and "mlwe_node_gpus" in r.text
    finally:
        public.svc.close()


def _exported(api: Api) -> set[str]:
    api.client.get("/api/v1/workloads", headers=api.h(Role.VIEWER))  # so the HTTP series exist
    text = api.client.get("/metrics", headers=api.h(Role.VIEWER)).text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_per_node_model_and_queue_series_follow_prometheus_conventions(api: Api) -> None:
    text = api.client.get("/metrics", headers=api.h(Role.VIEWER)).text
    assert 'mlwe_node_gpus{gpu_model="T4",node="t4-0",status="ready"} 2.0' in text
    assert 'mlwe_gpu_model_gpus{gpu_model="A100-80GB"} 8.0' in text
    assert re.search(r'mlwe_node_memory_bytes\{gpu_model="none",node="cpu-0",status="ready"\} 1\.37438953472e\+11',
                     text)
    assert 'mlwe_queue_pending_workloads{queue="default"} 0.0' in text
    assert 'mlwe_preemption_lost_gpu_seconds_total{queue="default"} 0.0' in text
    assert 'mlwe_deadline_outcomes_total{outcome="missed"} 0.0' in text
    for line in text.splitlines():  # counters end in _total, and nothing counts in milli-units
        if line.startswith("# TYPE") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total") or f"{line.split()[2]}_total" in text
        assert "milli" not in line.split(" ")[0]


def test_every_grafana_query_names_a_metric_the_server_exports(api: Api) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exported = _exported(api)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15 and all(p["targets"] for p in dash["panels"])
    named = {m for e in exprs for m in re.findall(r"\bmlwe_[a-z0-9_]+\b", e)}
    missing = sorted(named - exported)
    assert missing == [], f"the dashboard asks for metrics the server does not export: {missing}"
    # and the per-queue, per-node and per-model series are all on it
    for family in ("mlwe_queue_pending_workloads", "mlwe_node_gpus_allocated", "mlwe_gpu_model_gpus_allocated",
                   "mlwe_preemption_lost_gpu_seconds_total", "mlwe_deadline_outcomes_total"):
        assert family in named
