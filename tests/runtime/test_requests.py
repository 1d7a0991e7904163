"""The one request path: every door into the engine meets the same checks.

A table over entry points (direct submit, group-commit submit, agent proposal,
bus ingress by actions and by payload) x inputs (clean, a credential in an
identity field, a non-finite number, a hostile id): the same outcome at every
door, and a refused request leaves the store as it was. Then durability: a
request the store cannot take is rolled back in memory (an error answer means
nothing was kept), and one request the store refuses is rejected alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlwe.bus.base import EnvelopeError
from mlwe.core.actions import SetPriority, Submit
from mlwe.core.spec import WorkloadSpec
from mlwe.runtime import Engine
from mlwe.runtime.engine import RequestRejected
from mlwe.runtime.ingress import decode_request
from mlwe.runtime.requests import StoreRefused
from mlwe.store import db
from tests.runtime.test_engine import job, open_engine

GITHUB_TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0" * 2

#: input kind -> (the spec as a client would send it, a fragment of the refusal)
INPUTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "clean": ({"id": "ok-1", "name": "ok", "resources": {"cpu": 1, "memory": "1Gi"}}, None),
    "credential-id": ({"id": GITHUB_TOKEN, "name": "x"}, "credential"),
    "credential-label": ({"id": "lab", "name": "x", "labels": {"note": f"key{GITHUB_TOKEN}"}},
                         "credential"),
    "non-finite": ({"id": "nf", "name": "x", "estimated_duration": float("inf")}, "finite"),
    "hostile-id": ({"id": "abc\n", "name": "x"}, "id"),
}


def _as_spec(doc: dict[str, Any]) -> WorkloadSpec:
    """What code (an agent, a plug-in) may hand the engine: a spec built without validation."""
    return WorkloadSpec.model_construct(**_defaults(doc))


def _defaults(doc: dict[str, Any]) -> dict[str, Any]:
    base = WorkloadSpec(name="template").model_dump()
    base.update({k: v for k, v in doc.items() if k != "resources"})
    if "resources" in doc:
        base["resources"] = WorkloadSpec(name="t", resources=doc["resources"]).resources
    else:
        base["resources"] = WorkloadSpec(name="t").resources
    return base


def via_submit(eng: Engine, doc: dict[str, Any]) -> tuple[bool, str]:
    r = eng.submit([_as_spec(doc)], actor="t")
    return r.accepted, " ".join(r.reasons())


def via_submit_many(eng: Engine, doc: dict[str, Any]) -> tuple[bool, str]:
    [r] = eng.submit_many([([_as_spec(doc)], "t", None)])
    return r.accepted, " ".join(r.reasons())


def via_proposal(eng: Engine, doc: dict[str, Any]) -> tuple[bool, str]:
    r = eng.propose([Submit(_as_spec(doc))], actor="agent", rationale="test")
    return r.accepted, " ".join(r.reasons())


def via_ingest(eng: Engine, doc: dict[str, Any]) -> tuple[bool, str]:
    try:
        return eng.ingest(f"ev-{doc['id']!r}", [Submit(_as_spec(doc))], actor="bus"), ""
    except RequestRejected as exc:
        return False, str(exc)


def via_bus_payload(eng: Engine, doc: dict[str, Any]) -> tuple[bool, str]:
    try:
        actions, actor = decode_request({"type": "submit", "workloads": [doc]}, eng.cp.catalog)
        return eng.ingest(f"evp-{doc['id']!r}", actions, actor=actor), ""
    except (RequestRejected, EnvelopeError) as exc:
        return False, str(exc)


DOORS: dict[str, Callable[[Engine, dict[str, Any]], tuple[bool, str]]] = {
    "submit": via_submit,
    "submit_many": via_submit_many,
    "proposal": via_proposal,
    "ingest": via_ingest,
    "bus-payload": via_bus_payload,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    eng = open_engine(tmp_path_factory.mktemp("requests"))
    yield eng
    eng.close()


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("door", sorted(DOORS))
def test_every_door_gives_the_same_outcome(engine: Engine, door: str, kind: str) -> None:
    doc, refusal = INPUTS[kind]
    doc = {**doc, "id": f"{doc['id']}"} if refusal else {**doc, "id": f"{doc['id']}-{door}"}
    stored = engine.repo.count_workloads()
    accepted, why = DOORS[door](engine, doc)
    if refusal is None:
        assert accepted, why
        assert engine.repo.count_workloads() == stored + 1
    else:
        assert not accepted and refusal in why.lower(), why
        assert engine.repo.count_workloads() == stored  # nothing of it was stored
        assert doc["id"] not in engine.cp.workloads


def test_a_number_out_of_range_in_an_operator_action_is_refused(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)
    assert eng.submit([job("a")]).accepted
    r = eng.propose([SetPriority("a", 10**30, "huge")], actor="agent")
    assert not r.accepted and "out of range" in " ".join(r.reasons())
    with pytest.raises(RequestRejected, match="finite"):
        eng.note_audit("operator", "ops", {"figure": float("nan")})
    eng.close()


def test_a_store_outage_rolls_the_request_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = open_engine(tmp_path)
    assert eng.submit([job("before")]).accepted
    version, stored = eng.cp.version, eng.repo.count_workloads()
    real = eng.writer.flush

    def down(*a: Any, **k: Any) -> int:
        raise db.StoreUnavailable("database unavailable after 5 attempts: connection refused")

    monkeypatch.setattr(eng.writer, "flush", down)
    with pytest.raises(StoreRefused, match="nothing was kept"):
        eng.submit([job("during")])
    # nothing of it in memory either: it will not start, and a retry is not a duplicate
    assert "during" not in eng.cp.workloads and eng.cp.version == version
    assert not eng.writer.pending()
    monkeypatch.setattr(eng.writer, "flush", real)
    assert eng.degraded is not None
    r = eng.submit([job("during")])  # the client's retry
    assert r.accepted and eng.repo.count_workloads() == stored + 1
    assert eng.degraded is None
    eng.close()


def test_a_request_the_store_refuses_is_rejected_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = open_engine(tmp_path)
    real = eng.repo.insert_workloads

    def picky(workloads: Any, *a: Any, **k: Any) -> None:
        if any(w.id == "poison" for w in workloads):
            raise ValueError("the database cannot hold this row")
        real(workloads, *a, **k)

    monkeypatch.setattr(eng.repo, "insert_workloads", picky)
    results = eng.submit_many([([job("good-1")], "t", None), ([job("poison")], "t", None),
                               ([job("good-2")], "t", None)])
    assert [r.accepted for r in results] == [True, False, True]
    assert "store refused it" in " ".join(results[1].reasons())
    assert set(eng.cp.workloads) == {"good-1", "good-2"}
    assert eng.repo.count_workloads() == 2
    # the audit records queued for the rolled-back group went with it: one each, kept alone
    requests = [(e.kind, e.workload) for e in eng.audit.entries() if e.kind != "decision"
                and e.workload is not None]
    assert requests == [("request", "good-1"), ("request", "good-2")]
    assert eng.submit([job("later")]).accepted  # nothing is wedged
    eng.close()


def test_inadmissible_submissions_are_refused_with_the_reason(tmp_path: Path) -> None:
    eng = open_engine(tmp_path)  # g1: 2 x A100-80GB, c1: 8 cpu
    cases = {
        "too-wide": (job("too-wide", gpu=4), "no node of the cluster can ever hold one replica"),
        "gang": (job("gang", gpu=2).model_copy(update={"replicas": 2}), "at most 1"),
        "late": (job("late", deadline=eng.now() - 10), "deadline"),
    }
    for wid, (spec, why) in cases.items():
        r = eng.submit([spec])
        assert not r.accepted and "inadmissible" in " ".join(r.reasons()), wid
        assert why in " ".join(r.reasons()), (wid, r.reasons())
    assert eng.repo.count_workloads() == 0
    assert eng.submit([job("fits", gpu=2)]).accepted
    eng.close()
