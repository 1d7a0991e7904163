"""Process trees of workload replicas: finding every process, signalling, sampling.

Each replica's program is started in a session of its own (``setsid``), so its
session id and process group id are the root's pid. A replica's processes are:

- every live process in that session (cheap to find: one ``getsid`` per pid);
- every descendant (by parent pid) of those, found by the periodic sample,
  which catches a child that called ``setsid`` itself; once seen, such a
  process is remembered by (pid, start time) so it is still found after its
  parent exits and it is re-parented.

A process that escapes its session before the first sample can see it is
not tracked; real isolation (cgroups) is outside what an unprivileged daemon
can do. Zombies hold no memory and count as gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field

import psutil


@dataclass
class ProcessTree:
    root: int  # the root's pid, which is also its session and process group id
    known: dict[int, float] = field(default_factory=dict)  # pid -> create time
    # CPU accounting between samples: (pid, create time) -> cumulative CPU seconds
    _cpu: dict[tuple[int, float], float] = field(default_factory=dict)
    _last_t: float | None = None

    def remember(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                self.known[p.pid] = p.create_time()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def live_members(tree: ProcessTree) -> list[psutil.Process]:
    """The tree's processes that are still alive (not zombies)."""
    found: dict[int, psutil.Process] = {}
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == tree.root:
                found[pid] = psutil.Process(pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    for pid, ctime in list(tree.known.items()):
        if pid in found:
            continue
        try:
            p = psutil.Process(pid)
            if p.create_time() == ctime:
                found[pid] = p
            else:  # the pid was reused by an unrelated process
                del tree.known[pid]
        except psutil.Error:
            del tree.known[pid]
    return [p for p in found.values() if _alive(p)]


def signal_tree(tree: ProcessTree, sig: int, members: list[psutil.Process] | None = None) -> int:
    """Send ``sig`` to the whole process group and to every member outside it.

    Returns how many processes were signalled individually (outside the group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(tree.root, sig)
    n = 0
    for p in members if members is not None else live_members(tree):
        try:
            if os.getpgid(p.pid) != tree.root:
                p.send_signal(sig)
                n += 1
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return n


def kill_tree(tree: ProcessTree) -> list[psutil.Process]:
    """SIGKILL everything in the tree; returns what was still alive before the kill."""
    members = live_members(tree)
    signal_tree(tree, signal.SIGKILL, members)
    return members


@dataclass(frozen=True)
class TreeSample:
    pids: tuple[int, ...]
    cpu_pct: float  # percent of one core, summed over the tree
    rss_bytes: int


def sample_trees(trees: list[ProcessTree], now: float) -> dict[int, TreeSample]:
    """One scan of the process table: members (session and descendants), CPU and RSS.

    CPU is the CPU time used since the previous sample of the same tree,
    divided by the wall time between them; a process born since then counts
    from its birth. RSS is summed over the tree (pages shared between forked
    processes are counted once per process, as ``ps`` does)."""
    by_root = {t.root: t for t in trees}
    members: dict[int, dict[int, psutil.Process]] = {t.root: {} for t in trees}
    children: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["ppid", "status"]):
        info = p.info
        if info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        ppid = info.get("ppid")
        if ppid is not None:
            children.setdefault(ppid, []).append(p)
        try:
            sid = os.getsid(p.pid)
        except (ProcessLookupError, PermissionError):
            continue
        if sid in by_root:
            members[sid][p.pid] = p
    out: dict[int, TreeSample] = {}
    for root, tree in by_root.items():
        found = members[root]
        stack = list(found.values())
        while stack:  # descendants that left the session
            for c in children.get(stack.pop().pid, ()):
                if c.pid not in found:
                    found[c.pid] = c
                    stack.append(c)
        for pid, ctime in list(tree.known.items()):
            if pid not in found:
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == ctime and _alive(p):
                        found[pid] = p
                except psutil.Error:
                    tree.known.pop(pid, None)
        cpu_total = 0.0
        rss = 0
        seen: dict[tuple[int, float], float] = {}
        for p in found.values():
            try:
                with p.oneshot():
                    ctime = p.create_time()
                    t = p.cpu_times()
                    used = t.user + t.system
                    rss += p.memory_info().rss
            except psutil.Error:
                continue
            tree.known[p.pid] = ctime
            key = (p.pid, ctime)
            seen[key] = used
            prev = tree._cpu.get(key)
            if prev is not None:
                cpu_total += max(0.0, used - prev)
            elif tree._last_t is not None and ctime >= tree._last_t:
                cpu_total += used  # born since the last sample: all its CPU is new
        dt = None if tree._last_t is None else now - tree._last_t
        tree._cpu = seen
        tree._last_t = now
        pct = 0.0 if not dt or dt <= 0 else 100.0 * cpu_total / dt
        out[root] = TreeSample(tuple(found), pct, rss)
    return out
