"""_Lifecycle._actors_outlived_their_programs without a cluster: a program a signal
killed is blamed on the signal only once its actor answers a probe, and the wait for
that answer is bounded by ``confirm_timeout_s`` however Ray answers meanwhile (the
probe outstanding, or answered "unavailable for now" again and again).

The racy order on a real cluster is in tests/backends/test_ray.py
(test_a_program_killed_just_before_its_actor_died_fails_as_the_actor_death)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import ray.exceptions as ray_exceptions

from mlwe.backends.ray.lifecycle import _Lifecycle
from mlwe.backends.ray.state import _Replica


class _Stub:
    """What the check reads of the backend: its probe's answers, its bound, its log."""

    def __init__(self, answers: list[tuple[bool, Any] | None]) -> None:
        self.answers = answers
        self.config = SimpleNamespace(confirm_timeout_s=5.0)
        self.errors: list[str] = []

    def _probe(self, rep: _Replica, ready: set[Any]) -> tuple[bool, Any] | None:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def _error(self, msg: str) -> None:
        self.errors.append(msg)


def _check(stub: _Stub, rep: _Replica) -> bool:
    att = SimpleNamespace(workload="w", attempt=1)
    return _Lifecycle._actors_outlived_their_programs(stub, att, [rep], set())  # type: ignore[arg-type]


def _killed(seen_s_ago: float) -> _Replica:
    return _Replica(index=0, node="n0", name="w-0", actor=object(), killed_by="SIGKILL",
                    died_at=time.monotonic() - seen_s_ago)


def test_an_actor_unavailable_again_and_again_is_waited_for_only_within_the_bound() -> None:
    unavailable = (False, ray_exceptions.ActorUnavailableError("restarting", None))
    stub = _Stub([unavailable])
    rep = _killed(seen_s_ago=0.0)
    for _ in range(3):  # within the bound: asked again, not settled, nothing blamed
        assert _check(stub, rep) is False
    assert not rep.actor_answered and rep.died is None and not stub.errors
    rep.died_at = time.monotonic() - 6.0  # past confirm_timeout_s: the signal is blamed
    assert _check(stub, rep) is True
    assert rep.actor_answered and rep.died is None
    assert len(stub.errors) == 1 and "did not answer in 5s" in stub.errors[0], stub.errors


def test_an_outstanding_probe_is_waited_for_only_within_the_bound() -> None:
    stub = _Stub([None])
    rep = _killed(seen_s_ago=0.0)
    assert _check(stub, rep) is False and not stub.errors
    rep.died_at = time.monotonic() - 6.0
    assert _check(stub, rep) is True and rep.actor_answered and len(stub.errors) == 1


def test_an_answer_settles_it_and_a_death_is_left_to_the_actor_death_path() -> None:
    rep = _killed(seen_s_ago=0.0)
    assert _check(_Stub([(False, {"pid": 1})]), rep) is True and rep.actor_answered
    rep = _killed(seen_s_ago=0.0)
    dead = (True, ray_exceptions.RayActorError())
    assert _check(_Stub([dead]), rep) is False
    assert rep.died is not None and not rep.actor_answered
