"""A shaped gang that could never fit is refused at submission (``inadmissible``).

The bound per node counts whole groups of ``tasks_per_node``, or at most
``max_replicas_per_node``: a gang the cluster could hold unshaped may still
never fit in its shape, and then it must not wait forever.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlwe.runtime.requests import inadmissible
from tests.core.builders import cluster, cpu_node, job

NODES = [cpu_node(f"c{i}", cpu=c, memory="64Gi") for i, c in enumerate((3, 3, 8))]


@pytest.mark.parametrize(("gang", "replicas", "refused"), [
    (None, 12, False),  # unshaped: 12 x 1 core fits in 3 + 3 + 8
    ({"tasks_per_node": 4}, 8, False),  # the 8-core node holds two groups of four
    ({"tasks_per_node": 4}, 12, True),  # the 3-core nodes hold no group: 8 at most
    ({"max_replicas_per_node": 1}, 3, False),
    ({"max_replicas_per_node": 1}, 4, True),  # three nodes, one replica each at most
    ({"placement": "spread"}, 12, False),  # a preference changes no bound
], ids=["unshaped", "tpn-fits", "tpn-never", "max-fits", "max-never", "spread"])
def test_a_shaped_gang_that_can_never_fit_is_inadmissible(
    gang: dict[str, Any] | None, replicas: int, refused: bool
) -> None:
    cp, _ = cluster(*NODES)
    why = inadmissible(cp, job("g", cpu=1, memory="1Gi", replicas=replicas, gang=gang), 0.0)
    assert bool(why) is refused, why
    if refused:
        assert "every compatible node together could hold at most 8" in why[0] or \
            "could hold at most 3" in why[0], why
