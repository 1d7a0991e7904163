"""A real Slurm cluster on one machine: munged, slurmctld and one slurmd per node.

For tests, benchmarks and demos (``mlwe bench backend --backend slurm``). It uses
Debian's ``slurm-wlm`` (22.05) as packaged, started by hand (no systemd):

- a private ``munged`` on its own socket and key (``AuthInfo=socket=...``), so
  it neither needs nor disturbs a system munge;
- ``slurmctld`` and several ``slurmd`` on this host: every node is
  ``NodeName=nX NodeHostname=<this host> NodeAddr=127.0.0.1 Port=<free port>``
  and its daemon runs as ``slurmd -N nX`` (``SlurmdParameters=config_overrides``
  lets a node declare more CPUs and memory than the machine has);
- fake GPUs as GRES: ``gres.conf`` names character devices made with
  ``mknod DEV c 195 N`` (a GRES without ``File=`` drains the node);
- no cgroups: ``proctrack/linuxproc``, ``task/none``.

Each slurmd runs with ``MLWE_SLURM_NODE=<name>`` in its environment, which its
``slurmstepd`` children inherit, so :meth:`LocalSlurmCluster.kill_node` can end
a node's daemon, step daemons and job processes together (a machine lost),
and :meth:`start_node` brings it back. Needs root (slurmd runs jobs as their
user) and the packages; :func:`slurm_missing` says what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlwe.backends.slurm.commands import SlurmCommands, SlurmError

#: The daemons and commands this module needs.
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """One node of the local cluster: CPUs, memory (MiB) and fake GPUs ``{type: count}``."""

    name: str
    cpus: int = 4
    memory_mib: int = 4096
    gpus: Mapping[str, int] = field(default_factory=dict)


def slurm_missing() -> str | None:
    """Why a local Slurm cluster cannot start here (None if it can)."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"Slurm programs missing: {', '.join(missing)} (apt-get install slurm-wlm munge;"
                " `make slurm` does it when root)")
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    return None


_PR_SET_PDEATHSIG = 1
_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _end_with_parent() -> None:
    # between fork and exec: one libc call. A daemon of a test run that was killed
    # must not outlive it on a shared machine.
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalSlurmCluster:
    """munged + slurmctld + one slurmd per node, all on this machine (see the module doc)."""

    def __init__(
        self,
        nodes: Sequence[SlurmNode],
        base_dir: str | Path,
        *,
        partition: str = "mlwe",
        slurmd_timeout_s: int = 6,
        start_timeout_s: float = 90.0,
    ) -> None:
        why = slurm_missing()
        if why is not None:
            raise RuntimeError(why)
        if not nodes:
            raise ValueError("a Slurm cluster needs at least one node")
        self.nodes = {n.name: n for n in nodes}
        self.base = Path(base_dir).resolve()
        self.base.mkdir(parents=True, exist_ok=True)
        self.partition = partition
        self.slurmd_timeout_s = slurmd_timeout_s
        self.host = socket.gethostname()
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.socket"
        self.tag = f"mlwe-{os.getpid()}-{self.base.name}"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._ports = {n: _free_port() for n in self.nodes}
        try:
            self._start_munge()
            self._write_config()
            self._start_ctld()
            for name in self.nodes:
                self.start_node(name)
            self.wait_nodes(list(self.nodes), timeout=start_timeout_s) if start_timeout_s else None
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ setup
    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's commands need to talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start_munge(self) -> None:
        d = self.munge_socket.parent
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        key = d / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        log = open(self.base / "munged.out", "ab")  # noqa: SIM115 (kept by the process)
        self._procs["munged"] = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
             f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_end_with_parent,
        )
        self._wait(lambda: self.munge_socket.exists(), 20, "munged to open its socket",
                   "munged")

    def _gres_files(self, node: SlurmNode) -> list[tuple[str, Path]]:
        devdir = self.base / "dev"
        devdir.mkdir(exist_ok=True)
        out = []
        minor = 0
        for gtype, count in sorted(node.gpus.items()):
            for _ in range(count):
                path = devdir / f"{node.name}-gpu{minor}"
                if not path.exists():
                    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
                out.append((gtype, path))
                minor += 1
        return out

    def _write_config(self) -> None:
        b = self.base
        for sub in ("state", "spool", "log"):
            (b / sub).mkdir(exist_ok=True)
        lines = [
            "ClusterName=mlwe",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # a short credential lifetime: requeue and fast restarts need it
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={b / 'state'}",
            f"SlurmdSpoolDir={b / 'spool'}/%n",
            f"SlurmctldPidFile={b / 'slurmctld.pid'}",
            f"SlurmdPidFile={b / 'spool'}/slurmd.%n.pid",
            f"SlurmctldLogFile={b / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={b / 'log'}/slurmd.%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            f"PlugStackConfig={b / 'plugstack.conf'}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU_Memory",
            "GresTypes=gpu",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "SlurmctldTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=600",
            "MessageTimeout=20",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        gres = ["AutoDetect=off"]
        for n in self.nodes.values():
            files = self._gres_files(n)
            g = ",".join(f"gpu:{t}:{c}" for t, c in sorted(n.gpus.items()) if c > 0)
            lines.append(
                f"NodeName={n.name} NodeHostname={self.host} NodeAddr=127.0.0.1"
                f" Port={self._ports[n.name]} CPUs={n.cpus} RealMemory={n.memory_mib}"
                + (f" Gres={g}" if g else "") + " State=UNKNOWN"
            )
            for gtype, path in files:
                gres.append(f"NodeName={n.name} Name=gpu Type={gtype} File={path}")
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE"
                     " State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        (b / "gres.conf").write_text("\n".join(gres) + "\n")
        # an empty plugstack: the system one may name plugins this cluster lacks
        (b / "plugstack.conf").write_text("")

    def _start_ctld(self) -> None:
        log = open(self.base / "log" / "slurmctld.out", "ab")  # noqa: SIM115
        self._procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True, preexec_fn=_end_with_parent,
        )
        self._wait(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0
                   and b"UP" in self._run(["scontrol", "ping"], check=False).stdout,
                   60, "slurmctld to answer", "slurmctld")

    # ------------------------------------------------------------------ nodes
    def start_node(self, name: str) -> None:
        """Start (or restart) node ``name``'s slurmd."""
        old = self._procs.get(f"slurmd:{name}")
        if old is not None and old.poll() is None:
            return
        (self.base / "spool" / name).mkdir(parents=True, exist_ok=True)
        log = open(self.base / "log" / f"slurmd.{name}.out", "ab")  # noqa: SIM115
        env = {**self.env, "MLWE_SLURM_NODE": name, "MLWE_SLURM_TAG": self.tag}
        self._procs[f"slurmd:{name}"] = subprocess.Popen(
            ["slurmd", "-D", "-N", name, "-f", str(self.conf)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=_end_with_parent,
        )

    def kill_node(self, name: str) -> None:
        """The machine is lost: SIGKILL its slurmd, its step daemons and its jobs' processes
        (the tasks outlive a killed slurmstepd on one host; on a lost machine they die)."""
        p = self._procs.pop(f"slurmd:{name}", None)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        for pid in self._node_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _node_pids(self, name: str | None) -> list[int]:
        """Processes of this cluster on node ``name`` (any node if None): its slurmd and
        step daemons (``MLWE_SLURM_TAG``/``MLWE_SLURM_NODE``, inherited from slurmd) and
        its jobs' tasks and programs (``SLURM_CONF`` of this cluster, ``SLURMD_NODENAME``)."""
        out = []
        tag = f"MLWE_SLURM_TAG={self.tag}".encode()
        conf = f"SLURM_CONF={self.conf}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                env = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if tag in env:
                mine = name is None or f"MLWE_SLURM_NODE={name}".encode() in env
            elif conf in env and any(e.startswith(b"SLURMD_NODENAME=") for e in env):
                mine = name is None or f"SLURMD_NODENAME={name}".encode() in env
            else:
                continue
            if mine:
                out.append(int(entry))
        return out

    def commands(self) -> SlurmCommands:
        """Slurm's commands, pointed at this cluster."""
        return SlurmCommands(slurm_conf=str(self.conf))

    def wait_nodes(self, names: Iterable[str], timeout: float = 60.0) -> None:
        """Until every named node is up (idle or allocated) in slurmctld's view."""
        want = set(names)
        cmds = self.commands()

        def ready() -> bool:
            states = {n.name: n for n in cmds.nodes()}
            return all(w in states and not states[w].down
                       and not states[w].flags & {"DRAIN", "DRAINED", "DRAINING"} for w in want)

        self._wait(ready, timeout, f"nodes {', '.join(sorted(want))} to be up", None)

    # --------------------------------------------------------------- plumbing
    def _run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(args, env=self.env, capture_output=True, check=check, timeout=30)

    def _wait(self, pred: object, timeout: float, what: str, proc: str | None) -> None:
        assert callable(pred)
        end = time.monotonic() + timeout
        while True:
            try:
                if pred():
                    return
            except (subprocess.SubprocessError, OSError, ValueError, SlurmError):
                pass
            p = self._procs.get(proc) if proc else None
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{proc} exited with {p.returncode} while waiting for {what}"
                                   f"; see {self.base}")
            if time.monotonic() > end:
                raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}"
                                   f"; logs in {self.base / 'log'}")
            time.sleep(0.1)

    def shutdown(self) -> None:
        """Stop every daemon this cluster started and every job process they started."""
        for key in [k for k in self._procs if k.startswith("slurmd:")] + ["slurmctld", "munged"]:
            p = self._procs.pop(key, None)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self._node_pids(None):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
