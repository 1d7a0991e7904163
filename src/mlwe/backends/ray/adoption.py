"""The Ray backend's adoption: finding, after an engine restart, what still runs on Ray.

Actors and placement groups are detached and named
``<prefix>:<workload>:<attempt>[:<replica>]``; an earlier engine's attempts are
rebuilt from them, and placement groups with no actor are removed.
"""

from __future__ import annotations

from mlwe.backends.ray.pool import _WarmPool
from mlwe.backends.ray.state import POOL_TAG, _Attempt, _Phase, _ray, _Replica, log


class _Adoption(_WarmPool):
    """Adopting the attempts an earlier engine left running on Ray."""

    def _named_actors(self) -> dict[tuple[str, int], dict[int, str]]:
        """Actors of this prefix on Ray: (workload, attempt) -> {replica: name}.

        A warm actor's name does not say what it runs: it is asked (and one that
        runs nothing and is not in this backend's pool, an earlier engine's, is killed)."""
        ray = _ray()
        out: dict[tuple[str, int], dict[int, str]] = {}
        ns = ray.get_runtime_context().namespace
        mine = {w.name for w in self._pool_entries()} | {
            r.name for a in self._attempts.values() for r in a.replicas
        }
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"] if isinstance(entry, dict) else entry
            if isinstance(entry, dict) and entry.get("namespace") != ns:
                continue
            parts = name.split(":")
            if len(parts) != 4 or parts[0] != self.config.prefix:
                continue
            if parts[1] == POOL_TAG:
                if name in mine:
                    continue
                try:
                    actor = ray.get_actor(name)
                    info = ray.get(actor.info.remote(), timeout=30)
                except Exception as exc:
                    log.debug("warm actor %s: %s", name, exc)
                    continue
                if info.get("workload") is None:
                    self._kill_quietly(actor)  # idle, left by an earlier engine
                    continue
                out.setdefault((str(info["workload"]), int(info["attempt"])), {})[
                    int(info.get("replica", 0))] = name
                continue
            try:
                attempt, replica = int(parts[2]), int(parts[3])
            except ValueError:
                continue
            out.setdefault((parts[1], attempt), {})[replica] = name
        return out

    def _adopt(self) -> None:
        for key in self._named_actors():
            if key not in self._attempts and key not in self._reported:
                self._adopt_one(*key)
        self._remove_stray_groups()

    def _adopt_one(self, workload: str, attempt: int) -> _Attempt | None:
        """Rebuild the tracking of an attempt started by an earlier engine, from Ray."""
        ray = _ray()
        names = self._named_actors().get((workload, attempt))
        if not names:
            return None
        replicas: list[_Replica] = []
        nodes: list[str] = []
        for idx in sorted(names):
            try:
                actor = ray.get_actor(names[idx])
                info = ray.get(actor.info.remote(), timeout=30)
            except Exception as exc:
                self._error(f"cannot adopt {names[idx]}: {exc}")
                continue
            rep = _Replica(idx, str(info["node"]), names[idx], actor=actor, pid=info.get("pid"))
            if info.get("pid") is None:
                rep.died = info.get("start_error") or "never started"
            replicas.append(rep)
            nodes.append(rep.node)
        if not replicas:
            return None
        from ray.util.placement_group import get_placement_group

        pg_name = self._pg_name(workload, attempt)
        try:
            pg = get_placement_group(pg_name)
        except ValueError:
            pg = None
        att = _Attempt(workload, attempt, tuple(nodes), replicas, None, (), None,
                       phase=_Phase.RUNNING, pg=pg, pg_name=pg_name, adopted=True)
        att.progress_sent = 0.0
        for rep in replicas:
            if rep.died is None:
                rep.wait_ref = rep.actor.wait.remote()
        self._attempts[att.key] = att
        return att

    def _remove_stray_groups(self) -> None:
        """Placement groups of this prefix with no actor (a start cut short by a crash)."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table

        live_pgs = {a.pg_name for a in self._attempts.values()}
        for pg_id, entry in placement_group_table().items():
            name = entry.get("name") or ""
            if not name.startswith(f"{self.config.prefix}:") or entry.get("state") == "REMOVED":
                continue
            if name in live_pgs:
                continue
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            except Exception as exc:
                log.debug("could not remove stray placement group %s: %s", name, exc)
