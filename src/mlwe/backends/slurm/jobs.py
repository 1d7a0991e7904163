"""An attempt as a Slurm job: its comment, its components, its files, sbatch's arguments.

Jobs carry a ``--comment`` naming the engine's prefix, the workload, the attempt
and its directory (:func:`comment_of`, :func:`parse_comment`); a placement
becomes one job component per group of alike nodes (:func:`job_components`);
the batch script runs one ``srun`` step of :mod:`mlwe.backends.slurm.task`
wrappers (:func:`write_job_script`), submitted with :func:`sbatch_args`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlwe.backends.slurm.config import SlurmBackendConfig

COMMENT_KEY = "mlwe"


def comment_of(prefix: str, workload: str, attempt: int, adir: Path) -> str:
    return json.dumps({COMMENT_KEY: prefix, "w": workload, "a": attempt, "d": str(adir)},
                      separators=(",", ":"))


def parse_comment(text: str, prefix: str) -> tuple[str, int, Path] | None:
    """(workload, attempt, attempt dir) from one of this engine's job comments, else None."""
    try:
        data = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict) or data.get(COMMENT_KEY) != prefix:
        return None
    try:
        return str(data["w"]), int(data["a"]), Path(str(data["d"]))
    except (KeyError, TypeError, ValueError):
        return None


def job_components(placement: Sequence[tuple[str, int]], gpus_per_replica: int,
                   cpus_per_replica: int, memory_mib_per_replica: int,
                   gres_type: Callable[[str], str]) -> list[list[str]]:
    """The ``sbatch`` options of each job component for a placement (node per replica).

    Nodes alike (as many replicas, the same GRES type) share one component; one
    component is a plain job, several a heterogeneous one."""
    per_node: dict[str, int] = {}
    for node, _ in placement:
        per_node[node] = per_node.get(node, 0) + 1
    groups: dict[tuple[int, str], list[str]] = {}
    for node, count in per_node.items():
        gtype = gres_type(node) if gpus_per_replica else ""
        groups.setdefault((count, gtype), []).append(node)
    out = []
    for (count, gtype), nodes in groups.items():
        opts = [f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}",
                f"--ntasks-per-node={count}", f"--cpus-per-task={cpus_per_replica}",
                f"--mem={max(1, count * memory_mib_per_replica)}M"]
        if gpus_per_replica:
            n = count * gpus_per_replica
            opts.append(f"--gres=gpu:{gtype}:{n}" if gtype else f"--gres=gpu:{n}")
        out.append(opts)
    return out


def write_job_script(adir: Path, python: str, components: int) -> Path:
    """Write the attempt's batch script (``job.sh``): one srun step, one task per replica."""
    het = f" --het-group=0-{components - 1}" if components > 1 else ""
    task = f"{_sh(python)} -m mlwe.backends.slurm.task {_sh(str(adir))}"
    script = adir / "job.sh"
    stop_file = _sh(str(adir / "stop.json"))
    script.write_text(
        "#!/bin/sh\n"
        "# written by mlwe: one srun step, one task per replica\n"
        f"srun --kill-on-bad-exit=1 --unbuffered{het} {task}\n"
        "rc=$?\n"
        "# a stop mlwe asked for ends the job cleanly, whatever srun says of its signal\n"
        f"[ -f {stop_file} ] && exit 0\n"
        "exit $rc\n"
    )
    return script


def sbatch_args(cfg: SlurmBackendConfig, workload: str, attempt: int, adir: Path,
                comps: list[list[str]], script: Path) -> list[str]:
    """``sbatch``'s arguments for the job (several components: a heterogeneous job)."""
    common = [f"--job-name={cfg.prefix}:{workload}:{attempt}",
              f"--comment={comment_of(cfg.prefix, workload, attempt, adir)}",
              f"--output={adir / 'job.out'}", f"--chdir={adir}", "--no-requeue",
              "--export=ALL"]
    if cfg.partition:
        common.append(f"--partition={cfg.partition}")
    if cfg.account:
        common.append(f"--account={cfg.account}")
    args: list[str] = []
    for k, opts in enumerate(comps):
        if k:
            args.append(":")
        args += [*common, *cfg.extra_sbatch, *opts] if k == 0 else [*opts]
        if k and cfg.partition:
            args.append(f"--partition={cfg.partition}")
    args.append(str(script))
    return args


def _sh(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
