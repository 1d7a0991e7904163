"""The Ray backend's ending of attempts: stop, drain, teardown, confirmation, final facts.

A stop asks every replica to stop (SIGTERM, ``grace_s``, SIGKILL); an actor that
does not answer within the grace plus ``stop_margin_s`` is killed. Before the
teardown each live actor is asked for a last sample; then the actors are
killed (a task on their node SIGKILLs process groups left behind), the
placement group removed, and ``Released`` or ``Exited`` is reported only once
Ray confirms it all gone.
"""

from __future__ import annotations

import time
from typing import Any

from mlwe.backends.ray.cluster import node_resource
from mlwe.backends.ray.runner import kill_groups
from mlwe.backends.ray.state import _Attempt, _exit_of, _Outcome, _Phase, _ray, log
from mlwe.backends.ray.telemetry import _Sampling
from mlwe.core.actions import Exited, Released
from mlwe.core.backend import StopCommand


class _Teardown(_Sampling):
    """Stopping attempts, tearing them down and reporting their end once Ray confirms it."""

    def _stop(self, c: StopCommand) -> None:
        key = (c.workload, c.attempt)
        att = self._attempts.get(key)
        if att is None:
            if key in self._reported:
                return  # its end was already reported
            att = self._adopt_one(c.workload, c.attempt)
            if att is None:
                # nothing of it runs on Ray (never started here, or long gone)
                self._reported.add(key)
                self._emit(Released(c.workload, c.attempt), c.correlation_id)
                return
        if att.phase is _Phase.DONE or att.outcome is not None:
            return  # already ending (exit, node loss or an earlier stop)
        att.correlation_id = att.correlation_id or c.correlation_id
        self._begin_stop(att, c.grace_s, _Outcome.RELEASED)

    def _begin_stop(self, att: _Attempt, grace_s: float, outcome: _Outcome) -> None:
        att.outcome = outcome
        att.stop_requested = True
        att.stop_grace = max(0.0, grace_s)
        att.t_stop = time.monotonic()
        if att.phase is _Phase.PLACING:
            self._begin_teardown(att, force=True)
        elif att.phase in (_Phase.SPAWNING, _Phase.RUNNING):
            # while spawning, the programs may be starting right now: the actor serialises
            # start and stop, and a start after a stop is refused, so nothing is left behind
            self._ask_stop(att)

    def _ask_stop(self, att: _Attempt) -> None:
        for rep in att.replicas:
            if rep.actor is not None and rep.stop_ref is None and rep.died is None:
                rep.stop_ref = rep.actor.stop.remote(att.stop_grace)
        att.phase = _Phase.STOPPING
        att.since = time.monotonic()

    def _begin_teardown(self, att: _Attempt, *, force: bool, drain: bool = True) -> None:
        """Kill the actors and remove the placement group; confirmation follows in poll.

        With ``drain``, each live actor is first asked for a last sample, so the final
        reports (last progress, loss, checkpoint) are not lost with it."""
        if att.phase in (_Phase.DONE, _Phase.CONFIRMING):
            return
        if drain and att.phase in (_Phase.RUNNING, _Phase.STOPPING):
            live = [r for r in att.replicas if r.actor is not None and r.died is None]
            if live:
                for r in live:
                    # a periodic sample still pending may predate the exit: ask once more
                    r.drain_refs = [x for x in (r.sample_ref, r.actor.sample.remote()) if x]
                    r.sample_ref = None
                att.teardown_force = force
                att.phase = _Phase.DRAINING
                att.since = time.monotonic()
                return
        if force and att.phase in (
            _Phase.SPAWNING, _Phase.RUNNING, _Phase.STOPPING, _Phase.DRAINING
        ):
            att.forced = True
            # programs still running are killed with their actors (parent-death signal), and
            # a task on their node SIGKILLs their process groups in case a child escaped it
            self._reap_programs(att)
        self._kill(att)

    def _reap_programs(self, att: _Attempt) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        by_node: dict[str, list[int]] = {}
        for rep in att.replicas:
            if rep.pid and rep.node not in self._down and rep.reap_ref is None:
                done = rep.stop_result is not None and not rep.stop_result.get("survivors")
                if not done:
                    by_node.setdefault(rep.node, []).append(rep.pid)
        for node, pids in by_node.items():
            ray_node = self._ray_node.get(node)
            if ray_node is None:
                continue
            ref = self._reaper.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, soft=False),
                resources={node_resource(node): 0.001},
            ).remote(pids)
            for rep in att.replicas:
                if rep.node == node and rep.pid in pids:
                    rep.reap_ref = ref

    def _kill(self, att: _Attempt) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for rep in att.replicas:
            if rep.actor is not None:
                try:
                    ray.kill(rep.actor, no_restart=True)
                except Exception as exc:  # already gone
                    log.debug("ray.kill %s: %s", rep.name, exc)
                rep.probe_ref = None
        if att.pg is not None:
            try:
                remove_placement_group(att.pg)
            except Exception as exc:
                log.debug("remove_placement_group %s: %s", att.pg_name, exc)
        att.pg_ready_ref = None
        for rep in att.replicas:
            rep.start_ref = rep.wait_ref = rep.stop_ref = None
        att.phase = _Phase.CONFIRMING
        att.since = time.monotonic()

    def _advance_draining(self, att: _Attempt, ready: set[Any], now: float) -> None:
        # a replica whose node died will never answer: its last sample is not waited for
        pending = [ref for r in att.replicas if r.node not in self._down for ref in r.drain_refs]
        if any(ref not in ready for ref in pending) and now - att.since < self.config.drain_timeout_s:
            return
        for r in att.replicas:
            for ref in r.drain_refs:  # in the order asked: the last one saw the end
                if ref in ready:
                    ok, value = self._get(ref)
                    if ok:
                        self._take_sample(att, r, value, self.clock.now())
                    else:
                        log.warning("%s#%s replica %s: last sample failed: %s",
                                    att.workload, att.attempt, r.index, value)
                elif r.node in self._down:
                    log.warning("%s#%s replica %s: its node died before its last sample",
                                att.workload, att.attempt, r.index)
                else:
                    log.warning("%s#%s replica %s: no last sample within %gs; its final"
                                " reports are lost", att.workload, att.attempt, r.index,
                                self.config.drain_timeout_s)
            r.drain_refs = []
        self._begin_teardown(att, force=att.teardown_force, drain=False)

    def _advance_stopping(self, att: _Attempt, ready: set[Any], now: float) -> None:
        for rep in att.replicas:
            if rep.start_ref is not None and rep.start_ref in ready:
                ok, value = self._get(rep.start_ref)
                rep.start_ref = None
                if ok and value.get("ok"):
                    rep.pid = int(value["pid"])
            if rep.stop_ref is not None and rep.stop_ref in ready:
                ok, value = self._get(rep.stop_ref)
                rep.stop_ref = None
                if ok:
                    rep.stop_result = value
                    if rep.index == 0 and value.get("checkpoint_progress") is not None:
                        att.checkpoint_progress = float(value["checkpoint_progress"])
                    if value.get("forced"):
                        att.forced = True
                    if value.get("survivors"):
                        self._error(f"{att.workload}#{att.attempt} replica {rep.index}: processes"
                                    f" {value['survivors']} survived SIGKILL")
                else:
                    rep.died = str(value)
            # a program that ended by itself while we waited is fine: it is gone either way
            if rep.wait_ref is not None and rep.wait_ref in ready:
                ok, value = self._get(rep.wait_ref)
                rep.wait_ref = None
                if ok:
                    rep.exit_code, rep.killed_by = _exit_of(value)
        pending = [r for r in att.replicas if r.stop_ref is not None]
        if not pending:
            survivors = any((r.stop_result or {}).get("survivors") for r in att.replicas)
            self._begin_teardown(att, force=survivors)
            return
        if now - att.since > att.stop_grace + self.config.stop_margin_s:
            self._error(f"{att.workload}#{att.attempt}: actors did not answer the stop within"
                        f" {att.stop_grace + self.config.stop_margin_s:g}s: killing them")
            for r in pending:
                r.stop_ref = None
            self._begin_teardown(att, force=True, drain=False)

    def _advance_confirming(self, att: _Attempt, ready: set[Any], now: float) -> None:
        _ray()  # (a clear error without the mlwe[ray] extra, before the import below)
        from ray.util.placement_group import placement_group_table

        all_dead = True
        for rep in att.replicas:
            if rep.reap_ref is not None:
                if rep.reap_ref in ready:
                    ok, value = self._get(rep.reap_ref)
                    if ok and value:
                        self._error(f"{att.workload}#{att.attempt}: pids {value} survived the reaper")
                    rep.reap_ref = None
                elif rep.node in self._down:
                    rep.reap_ref = None  # the node is gone, and its processes with it
                else:
                    all_dead = False
            if rep.actor is None or rep.dead:
                continue
            probed = self._probe(rep, ready)
            if probed is None:
                all_dead = False
                continue
            if probed[0]:
                rep.dead = True
            else:
                all_dead = False  # the kill has not landed yet: probe again next poll
        if all_dead and att.pg is not None:
            state = (placement_group_table(att.pg) or {}).get("state")
            if state != "REMOVED":
                all_dead = False
        if all_dead and self._use_state_api():
            all_dead = self._state_api_confirms_dead(att)
        if not all_dead:
            if now - att.since > self.config.confirm_timeout_s:
                self._error(f"{att.workload}#{att.attempt}: Ray did not confirm its actors gone in"
                            f" {self.config.confirm_timeout_s:g}s; reporting it anyway")
            else:
                return
        self._finish(att)

    def _state_api_confirms_dead(self, att: _Attempt) -> bool:
        try:
            from ray.util.state import get_actor

            for rep in att.replicas:
                if rep.actor is None:
                    continue
                info = get_actor(rep.actor._actor_id.hex(), address=self._api_url, timeout=5)
                if info is not None and info.state != "DEAD":
                    return False
            return True
        except Exception as exc:
            log.debug("state API unavailable: %s", exc)
            self._state_api = False
            return True  # the refs already confirmed it; the state API is a second witness

    def _finish(self, att: _Attempt) -> None:
        att.phase = _Phase.DONE
        self._attempts.pop(att.key, None)
        self._reported.add(att.key)
        self._finished[att.key] = self._summary(att)
        while len(self._finished) > 1000:
            self._finished.popitem(last=False)
        if att.outcome is _Outcome.RELEASED:
            frac = att.checkpoint_progress
            self._emit(Released(att.workload, att.attempt, checkpointed_progress=frac),
                       att.correlation_id)
            if att.t_stop is not None:
                self.stop_figures.append({
                    "signal_to_released_s": time.monotonic() - att.t_stop,
                    "grace_s": att.stop_grace,
                    "forced": float(att.forced),
                })
                del self.stop_figures[:-1000]
        elif att.outcome is _Outcome.EXITED:
            cause = att.cause
            if cause == "start-failed" and att.error:
                cause = f"start-failed: {att.error}"
            self._emit(Exited(att.workload, att.attempt, att.exit_code, cause), att.correlation_id)

    def _finish_now(
        self, att: _Attempt, outcome: _Outcome, code: int, cause: str, error: str | None
    ) -> None:
        """End an attempt that never reached Ray (nothing to tear down)."""
        att.outcome, att.exit_code, att.cause, att.error = outcome, code, cause, error
        if error:
            self._error(f"{att.workload}#{att.attempt}: {error}")
        self._finish(att)


def _reap_groups(pids: list[int]) -> list[int]:
    """Runs as a Ray task on the node: SIGKILL the programs' process groups, wait until gone."""
    return kill_groups(pids)
