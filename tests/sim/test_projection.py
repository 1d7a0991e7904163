"""The head's projected start skips placement attempts that cannot succeed, and
answers exactly as if it had tried them.

:func:`mlwe.core.policies.deadline.project_start` releases holders at their
expected ends and, after a failed attempt, tries the target again only when a
node released since could hold one of its replicas (``_may_fit_now``). Every
projection of contended Philly replays (gangs of 2 x 8 GPUs among them, whose
attempts were once never skipped) is checked against the same projection with
every attempt made.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from mlwe.core.policies import deadline
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import load_trace


def test_skipped_attempts_change_no_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    original = deadline.project_start
    seen: Counter[str] = Counter()

    def checked(*args: Any, **kw: Any) -> deadline.Projection:
        got = original(*args, **kw)
        with monkeypatch.context() as m:
            m.setattr(deadline, "_may_fit_now", lambda *_: True)
            want = original(*args, **kw)
        assert got == want
        target = args[1]
        seen["gang" if target.spec.replicas > 1 else "one"] += 1
        return got

    monkeypatch.setattr(deadline, "project_start", checked)
    from mlwe.core import scheduler

    monkeypatch.setattr(scheduler, "project_start", checked, raising=False)
    trace = load_trace("philly", limit=1500, cluster="nodes:6x8")
    r = replay(trace, ReplayConfig(policy="mlwe"))
    assert r.metrics["completed"] == len(trace.jobs)
    assert seen["gang"] > 20 and seen["one"] > 100, seen
