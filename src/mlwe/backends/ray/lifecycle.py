"""The Ray backend's starting and running of attempts, and the poll step that advances them.

Every attempt gets a named, detached placement group with one bundle per
replica; once Ray reserves it, one :class:`~mlwe.backends.ray.runner.ReplicaRunner`
actor per bundle starts the workload's program. ``Started`` is reported when
every replica's program runs; exits, actor deaths and node loss of running
replicas are settled here, and each phase is advanced on ready refs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlwe.backends.ray.cluster import node_resource
from mlwe.backends.ray.nodes import _NodeWatch
from mlwe.backends.ray.state import _Attempt, _exit_of, _Outcome, _Phase, _ray, _Replica
from mlwe.core.actions import Started
from mlwe.core.backend import StartCommand
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.spec import WorkloadSpec

NODE_DEATH_SETTLE_S = 60.0  # how long an actor death blamed on its node waits for the node


class _Lifecycle(_NodeWatch):
    """Starting attempts (placement group, actors, programs) and advancing every phase."""

    def _start(self, c: StartCommand) -> None:
        key = (c.workload, c.attempt)
        if key in self._attempts or key in self._reported:
            return  # already running (or done): a start is idempotent
        nodes = tuple(a.node for a in c.placement)
        att = _Attempt(
            c.workload, c.attempt, nodes,
            [_Replica(i, a.node, self._actor_name(c.workload, c.attempt, i))
             for i, a in enumerate(c.placement)],
            c.spec, c.placement, c.correlation_id, resume_work_s=c.resume_work_s,
        )
        self._attempts[key] = att
        unknown = [n for n in nodes if n not in self.node_specs]
        if not c.placement or unknown:
            why = "no placement" if not c.placement else f"unknown node(s) {', '.join(unknown)}"
            self._finish_now(att, _Outcome.EXITED, -1, "start-failed", why)
            return
        if any(n in self._down for n in nodes):
            self._finish_now(att, _Outcome.EXITED, -1, "node-lost", None)
            return
        if not c.spec.command:
            self._finish_now(
                att, _Outcome.EXITED, 127, "start-failed",
                "the workload has no command to run (spec.command is empty)",
            )
            return
        from ray.util.placement_group import placement_group

        bundles = [self._bundle(a, c.spec) for a in c.placement]
        ray_nodes = [self._ray_node.get(n) for n in nodes]
        strategy = "STRICT_SPREAD" if len(set(ray_nodes)) == len(ray_nodes) > 1 else "PACK"
        att.pg_name = self._pg_name(c.workload, c.attempt)
        try:
            att.pg = placement_group(bundles, strategy=strategy, name=att.pg_name, lifetime="detached")
        except Exception as exc:
            self._finish_now(att, _Outcome.EXITED, -1, "start-failed",
                             f"placement group refused by Ray: {exc}")
            return
        att.pg_ready_ref = att.pg.ready()
        att.since = time.monotonic()

    @staticmethod
    def _bundle(a: ReplicaAlloc, spec: WorkloadSpec) -> dict[str, float]:
        bundle: dict[str, float] = {node_resource(a.node): 1.0}
        gpus = a.gpu_per_device * len(a.devices) / 1000 if a.devices else spec.resources.gpu / 1000
        if gpus:
            bundle["GPU"] = gpus
        return bundle

    def _spawn(self, att: _Attempt) -> None:
        """The placement group is ready: one actor per bundle, each starting its program."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = att.spec
        assert spec is not None
        ckpt = self.checkpoint_root / att.workload
        for rep, alloc in zip(att.replicas, att.placement, strict=True):
            gpus = self._bundle(alloc, spec).get("GPU", 0.0)
            meta = {
                "workload": att.workload,
                "attempt": att.attempt,
                "replica": rep.index,
                "replicas": len(att.replicas),
                "node": rep.node,
                "devices": list(alloc.devices),
                "gpu_milli": alloc.gpu_per_device * len(alloc.devices),
                "vram_mib": alloc.res.vram,
                "cpu_milli": alloc.res.cpu,
                "memory_mib": alloc.res.ram,
                "pg": att.pg_name,
            }
            warm = self._take_warm(rep.node)
            if warm is not None:
                # a warm actor pinned to the node: the bundle holds the resources on Ray,
                # the actor only runs the program
                rep.actor, rep.name = warm.actor, warm.name
            else:
                rep.actor = self._runner.options(
                    name=rep.name,
                    lifetime="detached",
                    num_cpus=0,
                    num_gpus=gpus,
                    resources={node_resource(rep.node): 1.0},
                    max_restarts=0,
                    max_concurrency=self.config.runner_concurrency,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=att.pg, placement_group_bundle_index=rep.index
                    ),
                ).remote(meta)
            env = self._env(att, rep, alloc, spec, ckpt)
            log_path = str(self.log_root / att.workload / f"a{att.attempt}-r{rep.index}.log")
            rep.start_ref = rep.actor.start.remote(list(spec.command), env, None, log_path, meta)
        att.phase = _Phase.SPAWNING

    def _env(
        self, att: _Attempt, rep: _Replica, alloc: ReplicaAlloc, spec: WorkloadSpec, ckpt: Path
    ) -> dict[str, str]:
        env = dict(spec.env)
        if alloc.res.cpu and "OMP_NUM_THREADS" not in spec.env:
            env["OMP_NUM_THREADS"] = str(max(1, -(-alloc.res.cpu // 1000)))
        env.update({
            "MLWE_WORKLOAD_ID": att.workload,
            "MLWE_ATTEMPT": str(att.attempt),
            "MLWE_REPLICA": str(rep.index),
            "MLWE_REPLICAS": str(len(att.replicas)),
            "MLWE_NODE": rep.node,
            "MLWE_CHECKPOINT_DIR": str(ckpt),
            "MLWE_RESUME_WORK_S": str(float(att.resume_work_s)),
            # the devices the control plane chose on that node, not Ray's own pick
            "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in alloc.devices),
        })
        return env

    def _pending_refs(self) -> list[Any]:
        """Every ref whose completion moves an attempt (or the warm pool) forward."""
        refs: list[Any] = []
        for att in self._attempts.values():
            if att.phase is _Phase.DONE:
                continue
            if att.pg_ready_ref is not None:
                refs.append(att.pg_ready_ref)
            for rep in att.replicas:
                for r in (rep.start_ref, rep.wait_ref, rep.stop_ref, rep.probe_ref, rep.reap_ref):
                    if r is not None:
                        refs.append(r)
                refs.extend(rep.drain_refs)
        for warm in self._pool_entries():
            if warm.ready_ref is not None:
                refs.append(warm.ready_ref)
        return refs

    def _advance(self) -> None:
        ray = _ray()
        refs = self._pending_refs()
        ready: set[Any] = set()
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            ready = set(done)
        self._advance_pool(ready)
        for att in list(self._attempts.values()):
            try:
                self._advance_one(att, ready)
            except Exception as exc:  # one attempt's surprise must not stall the others
                self._error(f"{att.workload}#{att.attempt}: {type(exc).__name__}: {exc}")
                if att.phase is not _Phase.CONFIRMING and att.phase is not _Phase.DONE:
                    if att.outcome is None:
                        att.outcome, att.exit_code, att.cause = _Outcome.EXITED, -1, "error"
                    self._begin_teardown(att, force=True, drain=False)


    def _advance_one(self, att: _Attempt, ready: set[Any]) -> None:
        now = time.monotonic()
        if att.phase is _Phase.PLACING:
            if att.pg_ready_ref in ready:
                att.pg_ready_ref = None
                self._spawn(att)
            elif now - att.since > self.config.start_timeout_s:
                att.outcome, att.exit_code, att.cause = _Outcome.EXITED, -1, "start-failed"
                self._error(
                    f"{att.workload}#{att.attempt}: Ray did not reserve its placement group"
                    f" in {self.config.start_timeout_s:g}s (is something else holding the GPUs?)"
                )
                self._begin_teardown(att, force=True)
            return
        if att.phase is _Phase.SPAWNING:
            self._advance_spawning(att, ready, now)
            return
        if att.phase is _Phase.RUNNING:
            self._advance_running(att, ready)
            return
        if att.phase is _Phase.STOPPING:
            self._advance_stopping(att, ready, now)
            return
        if att.phase is _Phase.DRAINING:
            self._advance_draining(att, ready, now)
            return
        if att.phase is _Phase.CONFIRMING:
            self._advance_confirming(att, ready, now)

    def _advance_spawning(self, att: _Attempt, ready: set[Any], now: float) -> None:
        for rep in att.replicas:
            if rep.start_ref is not None and rep.start_ref in ready:
                ok, value = self._get(rep.start_ref)
                rep.start_ref = None
                if not ok:
                    rep.died = str(value)
                    if att.outcome is None:
                        att.outcome, att.exit_code = _Outcome.EXITED, -1
                        att.cause = "start-failed"
                        self._error(f"{att.workload}#{att.attempt} replica {rep.index}: {value}")
                elif not value.get("ok"):
                    if att.outcome is None:
                        att.outcome = _Outcome.EXITED
                        att.exit_code = int(value.get("exit_code", 127))
                        att.cause = "start-failed"
                        att.error = str(value.get("error"))
                        self._error(f"{att.workload}#{att.attempt}: {att.error}")
                else:
                    rep.pid = int(value["pid"])
                    rep.ray_node_id = value.get("ray_node_id")
                    rep.actor_pid = value.get("actor_pid")
                    expected = self._ray_node.get(rep.node)
                    if rep.ray_node_id and expected and rep.ray_node_id != expected:
                        self._error(f"{att.workload}#{att.attempt} replica {rep.index} runs on Ray"
                                    f" node {rep.ray_node_id[:12]}, not {rep.node}'s {expected[:12]}")
        if any(rep.start_ref is not None for rep in att.replicas):
            if now - att.since > self.config.start_timeout_s and att.outcome is None:
                att.outcome, att.exit_code, att.cause = _Outcome.EXITED, -1, "start-failed"
                self._error(f"{att.workload}#{att.attempt}: actors did not start in"
                            f" {self.config.start_timeout_s:g}s")
                self._begin_teardown(att, force=True)
            return
        if att.outcome is _Outcome.EXITED:  # a replica could not start: the gang does not run
            self._begin_teardown(att, force=True)
            return
        for rep in att.replicas:
            rep.wait_ref = rep.actor.wait.remote()
        att.phase = _Phase.RUNNING
        att.since = time.monotonic()
        att.started_s = att.since - att.t_start
        self._emit(Started(att.workload, att.attempt), att.correlation_id)

    def _advance_running(self, att: _Attempt, ready: set[Any]) -> None:
        for rep in att.replicas:
            if rep.wait_ref is not None and rep.wait_ref in ready:
                ok, value = self._get(rep.wait_ref)
                rep.wait_ref = None
                if ok:
                    rep.exit_code, rep.killed_by = _exit_of(value)
                else:
                    rep.died = str(value)
        # Settle node loss before blaming the workload. When a node dies its actors are
        # reported dead, and its programs killed (their parent-death signal), at once;
        # the GCS says the node died seconds later (more on a loaded machine). An actor
        # death, or a program killed by a signal, on a node not yet known dead is the
        # workload's only once the node is shown alive (its raylet answers) or a settle
        # time has passed without the node dying.
        died = [r for r in att.replicas if r.died is not None]
        killed = [r for r in att.replicas if r.exit_code not in (None, 0) and r.killed_by]
        for rep in (*died, *killed):
            if rep.node in self._down or not self._node_alive(rep.node):
                return  # the node watcher turns this into NodeDown and tears the attempt down
            if not rep.raylet_answered:
                gone = self._raylet_gone(rep.node, rep.ray_node_id)
                if gone:
                    return  # its node died, the GCS has not noticed yet: node-lost, not an error
                rep.raylet_answered = gone is False
            if rep.died_at is None:
                rep.died_at = time.monotonic()
        if died:
            rep = died[0]
            # an actor on a dying node can be reported dead before its node is: give the node
            # watcher time to tell (longer when Ray's message itself blames the node)
            text = (rep.died or "").lower()
            blames_node = "node" in text and ("died" in text or "dead" in text)
            settle = NODE_DEATH_SETTLE_S if blames_node else self.config.actor_death_settle_s
            assert rep.died_at is not None
            if time.monotonic() - rep.died_at < settle:
                return
            att.outcome, att.exit_code = _Outcome.EXITED, -1
            att.cause = "oom" if "memory" in (rep.died or "").lower() else "error"
            self._error(f"{att.workload}#{att.attempt} replica {rep.index}: actor died: {rep.died}")
            self._begin_teardown(att, force=True)
            return
        if any(not r.raylet_answered and r.died_at is not None
               and time.monotonic() - r.died_at < self.config.actor_death_settle_s for r in killed):
            return  # killed by a signal, node not yet shown alive: wait for the node watcher
        if not self._actors_outlived_their_programs(att, killed, ready):
            return
        failed = [r for r in att.replicas if r.exit_code not in (None, 0)]
        if failed:
            first = failed[0]
            att.outcome, att.exit_code = _Outcome.EXITED, first.exit_code or 1
            att.cause = f"killed by {first.killed_by}" if first.killed_by else "error"
            # a gang with a failed member is broken: the rest are stopped at once
            self._begin_teardown(att, force=True)
            return
        if all(r.exit_code == 0 for r in att.replicas):
            att.outcome, att.exit_code, att.cause = _Outcome.EXITED, 0, ""
            self._begin_teardown(att, force=False)

    def _actors_outlived_their_programs(
        self, att: _Attempt, killed: list[_Replica], ready: set[Any],
    ) -> bool:
        """Whether every replica whose program a signal killed still has a live actor.

        A signal is the program's own end only if its actor lives on. When the actor
        is killed (``ray.kill`` from outside mlwe, the worker process dying), the Ray
        worker kills its child programs before it exits, so the actor's ``wait`` can
        report "killed by SIGKILL" before the actor is seen dead. Each such replica's
        actor is probed until it answers (again while Ray says it is unavailable for
        now, at most ``confirm_timeout_s`` after the kill was seen); an actor that
        died is marked so, and the caller's actor-death path decides on its next
        pass. False while a probe is outstanding or a death was just found.
        """
        settled = True
        for rep in killed:
            if rep.actor_answered or rep.actor is None:
                continue
            probed = self._probe(rep, ready)
            if probed is not None:
                dead, value = probed
                if dead:
                    rep.died = str(value)  # the actor died with its program: not its signal
                    settled = False
                    continue
                if not isinstance(value, _ray().exceptions.ActorUnavailableError):
                    rep.actor_answered = True  # it ran the probe (even one that raised): it lives
                    continue
                # unavailable for now (its worker restarting, a network blip): ask again
            # no answer yet: wait for one, within the bound
            assert rep.died_at is not None
            if time.monotonic() - rep.died_at < self.config.confirm_timeout_s:
                settled = False
                continue
            self._error(f"{att.workload}#{att.attempt} replica {rep.index}: its actor did not"
                        f" answer in {self.config.confirm_timeout_s:g}s after its program was"
                        f" killed by {rep.killed_by}; blaming the signal")
            rep.probe_ref, rep.actor_answered = None, True
        return settled
