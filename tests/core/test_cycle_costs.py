"""What keeps a cycle cheap changes nothing it decides: the capacity index's forks
and kept lists, the cycle's hold on the cyclic GC, the decision record's stamp.

A fork is what every policy decides on: what it changes must never reach the
index it came from, however cheaply it was made (status table shared until the
fork changes a status, node lists per tuple of models kept between searches).
"""

from __future__ import annotations

import gc

from mlwe.core import NodeStatus, Resources
from mlwe.core.capacity import CapacityIndex, NodeInfo, Shape
from mlwe.core.scheduler import no_cyclic_gc
from tests.core.builders import A100, T4


def node(name: str, model: str | None) -> NodeInfo:
    n = 8 if model else 0
    return NodeInfo(name, model, n, 80 * 1024 if model else 0,
                    Resources(n * 1000, n * 80 * 1024 if model else 0, 64_000, 512 * 1024), {})


def index() -> CapacityIndex:
    idx = CapacityIndex()
    for name, model in [("a-0", A100), ("t-0", T4), ("a-1", A100), ("cpu-0", None)]:
        idx.add_node(node(name, model))
    return idx


def test_a_status_changed_on_a_fork_stays_on_the_fork() -> None:
    idx = index()
    f = idx.fork()
    f.set_status("a-0", NodeStatus.CORDONED)
    assert (f.status("a-0"), idx.status("a-0")) == (NodeStatus.CORDONED, NodeStatus.READY)
    assert idx.fit_on("a-0", _whole_node_shape()) is not None
    assert f.fit_on("a-0", _whole_node_shape()) is None
    # a fork of that fork sees its parent's change, and its own stay its own
    g = f.fork()
    g.set_status("a-1", NodeStatus.DOWN)
    assert [g.status(n) for n in ("a-0", "a-1")] == [NodeStatus.CORDONED, NodeStatus.DOWN]
    assert [f.status(n) for n in ("a-0", "a-1")] == [NodeStatus.CORDONED, NodeStatus.READY]
    assert [idx.status(n) for n in ("a-0", "a-1")] == [NodeStatus.READY, NodeStatus.READY]


def test_nodes_of_several_models_are_kept_until_a_node_comes_or_goes() -> None:
    idx = index()
    both = (T4, A100)
    first = idx.nodes_of_models(both)
    assert first == ["t-0", "a-0", "a-1"]
    assert idx.nodes_of_models(both) is first  # kept, not rebuilt
    assert idx.fork().nodes_of_models(both) is first  # forks share it
    assert idx.nodes_of_models((A100,)) == ["a-0", "a-1"]
    idx.add_node(node("t-1", T4))
    assert idx.nodes_of_models(both) == ["t-0", "t-1", "a-0", "a-1"]
    idx.remove_node("a-0")
    assert idx.nodes_of_models(both) == ["t-0", "t-1", "a-1"]
    assert idx.nodes_of_models(("H100",)) == []


def test_a_cycle_holds_off_the_cyclic_gc_and_gives_back_what_it_found() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with no_cyclic_gc():
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # a caller that turned it off keeps it off
        with no_cyclic_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
        gc.enable()
        try:
            with no_cyclic_gc():
                raise KeyError("boom")
        except KeyError:
            pass
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def _whole_node_shape() -> Shape:
    return Shape(gpu=8000, cpu=8000, ram=1024, vram=None, models=(A100,))


def test_a_stamped_decision_record_is_replace_with_its_stamp_and_keeps_every_field() -> None:
    from dataclasses import fields, replace

    from mlwe.core.decisions import DecisionRecord

    # every field set to a value that differs from its default, so a field the
    # stamp forgot (or a new one it does not know) shows as a difference
    rec = DecisionRecord(
        kind="place", workload="w-1", policy="mlwe/best-fit", chosen="n1,n2",
        reasons=("placed", "rank 1/3"), candidates=("A100-80GB",), inputs_digest="ab12",
        cause_id="cause-9", time=1.5, version=4, seq=7, extra={"gain_gpu_s": 1.0},
    )
    assert {f.name for f in fields(DecisionRecord)} == {
        "kind", "workload", "policy", "chosen", "reasons", "candidates", "inputs_digest",
        "cause_id", "time", "version", "seq", "extra",
    }
    assert rec.stamped(9.25, 12, 40) == replace(rec, time=9.25, version=12, seq=40)
