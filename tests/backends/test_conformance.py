"""One scenario suite, every backend: the proof that the control plane needs no change.

Parametrised over the harnesses in ``tests/backends/harness.py`` (the
simulator and the local daemon; a backend adds itself to ``HARNESSES``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.backends.harness import HARNESSES, Harness
from tests.backends.scenarios import SCENARIOS


@pytest.fixture(params=sorted(HARNESSES))
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    h = HARNESSES[request.param](tmp_path)
    try:
        yield h
    finally:
        h.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_scenario(harness: Harness, scenario: Callable[[Harness], None]) -> None:
    scenario(harness)
    assert harness.checks > 0  # the invariants were checked along the way
