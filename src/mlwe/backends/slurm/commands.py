"""Slurm's own commands, called and parsed: ``sbatch``, ``scancel``, ``squeue``, node state.

The backend talks to Slurm through its commands rather than ``slurmrestd``:
the commands come with every Slurm install (slurmrestd is an optional daemon,
often not run, with its own authentication set-up and API versions that
change per release), they need nothing but munge, and a failed call is one
process with a clear error on stderr. Where the version offers JSON, it is
parsed (``squeue --json``, and for nodes ``scontrol --json show nodes`` on
23.02 and later, ``sinfo --json`` on 22.05, whose scontrol has no ``--json``);
else the one-line text form ``scontrol -o show nodes`` is parsed.

:func:`node_record` normalises one node from any of those forms into
:class:`SlurmNodeInfo`; :func:`job_record` one job into :class:`SlurmJobInfo`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Job states after which a job holds nothing (COMPLETING still holds its nodes).
TERMINAL_JOB_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED",
})
#: Node states and flags under which a node runs nothing of ours.
DOWN_NODE_STATES = frozenset({
    "DOWN", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "POWER_DOWN", "POWERING_DOWN",
    "FUTURE", "INVALID_REG", "UNKNOWN",
})


class SlurmError(RuntimeError):
    """A Slurm command failed; the message has the command and its stderr."""


@dataclass(frozen=True, slots=True)
class SlurmNodeInfo:
    name: str
    flags: frozenset[str]  # base state and flags, upper case (IDLE, MIXED, DRAIN, ...)
    cpus: int
    memory_mib: int
    gpus: Mapping[str, int] = field(default_factory=dict)  # gres type ('' untyped) -> count
    alloc_cpus: int = 0
    alloc_memory_mib: int = 0
    free_memory_mib: int | None = None
    cpu_load: float | None = None  # load average (Slurm reports it x100 in JSON)
    reason: str = ""
    partitions: tuple[str, ...] = ()

    @property
    def down(self) -> bool:
        return bool(self.flags & DOWN_NODE_STATES)

    def describe(self) -> str:
        state = "+".join(sorted(self.flags)) or "?"
        return f"{state}" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True, slots=True)
class SlurmJobInfo:
    job_id: int
    het_job_id: int  # the leader's id for a heterogeneous job's components, else 0
    name: str
    state: str
    comment: str
    nodes: str
    exit_code: int | None
    reason: str

    @property
    def leader(self) -> int:
        return self.het_job_id or self.job_id

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES


def parse_gres(gres: str) -> dict[str, int]:
    """``gpu:t4:2(S:0),gpu:a100:1`` -> ``{"t4": 2, "a100": 1}``; an untyped ``gpu:2`` -> ``{"": 2}``."""
    out: dict[str, int] = {}
    for item in re.split(r",(?![^()]*\))", gres or ""):
        item = re.sub(r"\(.*?\)", "", item).strip()
        parts = item.split(":")
        if not parts or parts[0] != "gpu":
            continue
        if len(parts) == 2 and parts[1].isdigit():
            out[""] = out.get("", 0) + int(parts[1])
        elif len(parts) >= 3 and parts[2].isdigit():
            out[parts[1]] = out.get(parts[1], 0) + int(parts[2])
    return out


def _flags(raw: Mapping[str, Any]) -> frozenset[str]:
    out: set[str] = set()
    st = raw.get("state")
    if isinstance(st, str):
        out.update(x for x in re.split(r"[+|]", st.upper()) if x)
    elif isinstance(st, list):
        out.update(str(x).upper() for x in st)
    flags = raw.get("state_flags")
    if isinstance(flags, list):
        out.update(str(x).upper() for x in flags)
    return frozenset(out)


def _int(v: Any, default: int = 0) -> int:
    if isinstance(v, dict):  # 23.02+: {"set": true, "number": 5}
        v = v.get("number") if v.get("set", True) else None
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def node_record(raw: Mapping[str, Any]) -> SlurmNodeInfo:
    """One node from ``sinfo --json`` / ``scontrol --json show nodes``."""
    load = raw.get("cpu_load")
    free = raw.get("free_memory")
    parts = raw.get("partitions")
    return SlurmNodeInfo(
        name=str(raw.get("name", "")),
        flags=_flags(raw),
        cpus=_int(raw.get("cpus")),
        memory_mib=_int(raw.get("real_memory")),
        gpus=parse_gres(str(raw.get("gres") or "")),
        alloc_cpus=_int(raw.get("alloc_cpus")),
        alloc_memory_mib=_int(raw.get("alloc_memory")),
        free_memory_mib=_int(free) if free is not None else None,
        cpu_load=_int(load) / 100.0 if load is not None else None,
        reason=str(raw.get("reason") or ""),
        partitions=tuple(str(p) for p in parts) if isinstance(parts, list) else (),
    )


def node_record_text(line: str) -> SlurmNodeInfo:
    """One node from ``scontrol -o show nodes`` (``Key=Value`` pairs on one line)."""
    kv = dict(re.findall(r"(\w+)=(\S*)", line))
    reason = re.search(r"Reason=(.*?)(?: \[|$)", line)
    return SlurmNodeInfo(
        name=kv.get("NodeName", ""),
        flags=_flags({"state": kv.get("State", "")}),
        cpus=_int(kv.get("CPUTot")),
        memory_mib=_int(kv.get("RealMemory")),
        gpus=parse_gres(kv.get("Gres", "")),
        alloc_cpus=_int(kv.get("CPUAlloc")),
        alloc_memory_mib=_int(kv.get("AllocMem")),
        free_memory_mib=_int(kv["FreeMem"]) if kv.get("FreeMem", "N/A").isdigit() else None,
        cpu_load=float(kv["CPULoad"]) if re.fullmatch(r"[\d.]+", kv.get("CPULoad", "")) else None,
        reason=reason.group(1).strip() if reason else "",
        partitions=tuple(p for p in kv.get("Partitions", "").split(",") if p),
    )


def job_record(raw: Mapping[str, Any]) -> SlurmJobInfo:
    state = raw.get("job_state")
    if isinstance(state, list):  # 23.02+: a list of the state and its flags
        names = [str(s).upper() for s in state]
        state = "COMPLETING" if "COMPLETING" in names else (names[0] if names else "")
    code = raw.get("exit_code")
    if isinstance(code, dict):  # 23.02+: {"status": ..., "return_code": {...}}
        code = code.get("return_code")
    return SlurmJobInfo(
        job_id=_int(raw.get("job_id")),
        het_job_id=_int(raw.get("het_job_id")),
        name=str(raw.get("name") or ""),
        state=str(state or "").upper(),
        comment=str(raw.get("comment") or ""),
        nodes=str(raw.get("nodes") or ""),
        exit_code=_int(code) if code is not None else None,
        reason=str(raw.get("state_reason") or ""),
    )


class SlurmCommands:
    """Runs Slurm's commands with one environment (``SLURM_CONF``) and timeout."""

    def __init__(self, *, slurm_conf: str | None = None, bin_dir: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        self._node_source: str | None = None  # "scontrol-json", "sinfo-json" or "text"
        self.calls = 0

    def program(self, name: str) -> str:
        if self.bin_dir:
            return os.path.join(self.bin_dir, name)
        return shutil.which(name) or name

    def run(self, args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [self.program(args[0]), *args[1:]]
        self.calls += 1
        try:
            p = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                               timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"{args[0]}: not found (is Slurm installed? bin_dir="
                             f"{self.bin_dir or 'PATH'})") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(args[:3])}: no answer within {self.timeout_s:g}s"
                             " (is slurmctld up?)") from None
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(args[:3])} failed ({p.returncode}):"
                             f" {(p.stderr or p.stdout).strip()[:500]}")
        return p

    # ------------------------------------------------------------------ jobs
    def sbatch(self, args: Sequence[str]) -> int:
        out = self.run(["sbatch", "--parsable", *args]).stdout.strip()
        head = out.split(";")[0].split("+")[0]
        if not head.isdigit():
            raise SlurmError(f"sbatch printed no job id: {out[:200]!r}")
        return int(head)

    def scancel(self, job_id: int, *, signal: str | None = None, full: bool = False) -> None:
        args = ["scancel"]
        if signal:
            args.append(f"--signal={signal}")
        if full:
            args.append("--full")
        # a job that already ended is not an error worth raising: its state says it all
        self.run([*args, str(job_id)], check=False)

    def jobs(self) -> list[SlurmJobInfo]:
        """Every job slurmctld still knows (22.05's ``squeue --json`` ignores filters)."""
        data = json.loads(self.run(["squeue", "--json", "--states=all"]).stdout)
        return [job_record(j) for j in data.get("jobs", []) if isinstance(j, dict)]

    # ----------------------------------------------------------------- nodes
    def nodes(self) -> list[SlurmNodeInfo]:
        """Every node, from the best form this Slurm offers (see the module doc)."""
        order = ([self._node_source] if self._node_source
                 else ["scontrol-json", "sinfo-json", "text"])
        last: SlurmError | None = None
        for source in order:
            try:
                nodes = self._nodes_from(source)
            except (SlurmError, ValueError) as exc:
                last = exc if isinstance(exc, SlurmError) else SlurmError(str(exc))
                if self._node_source:
                    raise last from None
                continue
            self._node_source = source
            return nodes
        raise last or SlurmError("no way to read Slurm's nodes")

    @property
    def node_source(self) -> str | None:
        return self._node_source

    def _nodes_from(self, source: str) -> list[SlurmNodeInfo]:
        if source == "text":
            out = self.run(["scontrol", "-o", "show", "nodes"]).stdout
            return [node_record_text(line) for line in out.splitlines() if "NodeName=" in line]
        argv = (["scontrol", "--json", "show", "nodes"] if source == "scontrol-json"
                else ["sinfo", "--json"])
        data = json.loads(self.run(argv).stdout)
        seen: dict[str, SlurmNodeInfo] = {}
        for raw in data.get("nodes", []):
            if isinstance(raw, dict):
                rec = node_record(raw)
                seen.setdefault(rec.name, rec)  # sinfo lists a node once per partition
        return list(seen.values())
