"""Fixtures shared by the backend tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends.harness import LocalHarness


@pytest.fixture
def h(tmp_path: Path) -> Iterator[LocalHarness]:
    """A local harness: real daemons and processes, closed after the test."""
    harness = LocalHarness(tmp_path)
    try:
        yield harness
    finally:
        harness.close()
