"""Instructions a replay executes, counted by valgrind: a speed figure this shared,
noisy machine cannot blur.

    .venv/bin/python benchmarks/replay_instructions.py [--input philly-1000]
        [--policy mlwe] [--src OTHER/src ...] [--wall N]

Wall time here moves by up to 2x between sittings and by 20% between two runs
of the same code, so a change that saves 3% cannot be timed. The instructions
the interpreter executes (valgrind's callgrind ``Ir``) hardly move between
runs of the same code (hash randomisation is off: ``PYTHONHASHSEED=0``). For
each source tree (this checkout's ``src`` first, then every ``--src``), it runs
one input of ``policy_quality.py`` (same trace, cluster and checkpoint model)
twice under callgrind: once only loading the trace, once loading and replaying;
the difference is the replay's. It prints one JSON line per tree: the
instructions in millions, the ratio to the first tree's, and the replay's
average JCT (equal JCTs: the same decisions, as far as this says; the
decision digest says it word for word). Instructions are not time (a cache
miss costs more than an add), so quote both where you can.

Needs valgrind (``apt-get install valgrind``); each run is ~50x slower than a
plain replay: philly-1000 (a small contended input, ~3 s plainly) takes ~3
minutes a tree, philly-5000 ~10.

``--wall N`` times the replays instead (no valgrind): N rounds, each running
every tree once in turn, so that a slow minute of the machine falls on all of
them alike; one line per tree with the median seconds and its ratio to the
first tree's median. That is the figure for inputs too large to count, such
as ``philly-full-20k``: jobs 10,000-30,000 of the whole trace on the whole
trace's cluster (``policy_quality.py``'s philly-full): a backlog like the
whole trace's, where the gain test takes the largest share of a cycle and the
head projection the next (27% and 13% by py-spy, against 23% and 18% on the
whole trace), in ~30 s instead of ~160.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: what each child runs: load the input (and replay it unless told not to)
CHILD = """
import json, sys
sys.path.insert(0, {here!r})
from policy_quality import INPUTS
from mlwe.sim.checkpoint import parse_checkpoint_model
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import load_trace
import dataclasses, time
def window(trace, first, end):
    return dataclasses.replace(trace, jobs=trace.jobs[first:end])
trace = {load}
if {run!r}:
    t0 = time.perf_counter()
    r = replay(trace, ReplayConfig(policy={policy!r},
               checkpoint=parse_checkpoint_model({checkpoint!r})))
    wall = time.perf_counter() - t0
    print(json.dumps({{"avg_jct_s": r.metrics.get("avg_jct_s"), "jobs": len(trace.jobs),
                      "wall_s": round(wall, 3)}}))
"""

#: inputs too large to be worth counting (half an hour to hours under valgrind)
TOO_LARGE = {"philly-full", "philly-full-20k"}

#: inputs defined here for quick measures (policy_quality's are the targets'), as
#: what the child evaluates to load them
EXTRA = {
    "philly-1000": "load_trace('philly', limit=1000, cluster='nodes:8x8')",
    "philly-full-20k": "window(INPUTS['philly-full'][0](), 10_000, 30_000)",
}


def _child(
    src: Path, name: str, policy: str, checkpoint: str, run: bool
) -> tuple[str, dict[str, str]]:
    """The child's code and environment for ``name`` on ``src``."""
    load = EXTRA.get(name, f"INPUTS[{name!r}][0]()")
    code = CHILD.format(here=str(HERE), load=load, run=run, policy=policy, checkpoint=checkpoint)
    return code, {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}


def _time(src: Path, name: str, policy: str, checkpoint: str) -> dict[str, Any]:
    """One plain replay of ``name`` on ``src``: what the child printed (its wall_s included)."""
    code, env = _child(src, name, policy, checkpoint, run=True)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the child failed:\n{proc.stderr[-2000:]}")
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def _count(src: Path, name: str, policy: str, checkpoint: str, run: bool) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        code, env = _child(src, name, policy, checkpoint, run)
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             sys.executable, "-c", code],
            env=env, capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the child under valgrind failed:\n{proc.stderr[-2000:]}")
        m = re.search(r"Collected : (\d+)", proc.stderr)
        if m is None:
            raise SystemExit(f"valgrind printed no instruction count:\n{proc.stderr[-2000:]}")
        return int(m.group(1)), proc.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", default="philly-1000",
                    help="philly-1000, or an input of policy_quality.py")
    ap.add_argument("--policy", default="mlwe")
    ap.add_argument("--checkpoint", default="periodic:1800,cost=0,restart=60")
    ap.add_argument("--src", action="append", default=[],
                    help="another tree's src folder to count as well (e.g. a git worktree's)")
    ap.add_argument("--wall", type=int, default=0, metavar="N",
                    help="time N rounds of plain replays instead of counting instructions")
    args = ap.parse_args()
    name = args.input
    sys.path.insert(0, str(HERE))
    from policy_quality import INPUTS

    if name not in INPUTS and name not in EXTRA:
        raise SystemExit(f"unknown input {name!r}: {', '.join([*EXTRA, *INPUTS])}")
    trees = [ROOT / "src", *map(Path, args.src)]
    if args.wall:
        _wall(trees, name, args.policy, args.checkpoint, args.wall)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    if name in TOO_LARGE:
        raise SystemExit(f"{name} would take too long under valgrind; time it (--wall N)")
    first: float | None = None
    for src in trees:
        loading, _ = _count(src, name, args.policy, args.checkpoint, run=False)
        total, said = _count(src, name, args.policy, args.checkpoint, run=True)
        replay_ir = total - loading
        first = first or replay_ir
        line: dict[str, Any] = {
            "input": name, "policy": args.policy, "src": str(src),
            "replay_minstr": round(replay_ir / 1e6, 1), "load_minstr": round(loading / 1e6, 1),
            "ratio_to_first": round(replay_ir / first, 4),
            **json.loads(said.splitlines()[-1]),
        }
        print(json.dumps(line), flush=True)


def _wall(trees: list[Path], name: str, policy: str, checkpoint: str, rounds: int) -> None:
    """``rounds`` rounds of one plain replay per tree, in turn; one JSON line per tree."""
    if rounds < 1:
        raise SystemExit(f"--wall needs at least one round, got {rounds}")
    runs: list[list[dict[str, Any]]] = [[] for _ in trees]
    for _ in range(rounds):
        for i, src in enumerate(trees):
            runs[i].append(_time(src, name, policy, checkpoint))
    first: float | None = None
    for src, got in zip(trees, runs):
        walls = [g["wall_s"] for g in got]
        median = statistics.median(walls)
        first = first or median
        print(json.dumps({
            "input": name, "policy": policy, "src": str(src), "rounds": rounds,
            "median_wall_s": round(median, 3), "walls_s": walls,
            "ratio_to_first": round(median / first, 4),
            "avg_jct_s": got[-1]["avg_jct_s"], "jobs": got[-1]["jobs"],
        }), flush=True)


if __name__ == "__main__":
    main()
