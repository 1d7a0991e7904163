"""Instructions a replay executes, counted by valgrind: a speed figure this shared,
noisy machine cannot blur.

    .venv/bin/python benchmarks/replay_instructions.py [--input philly-1000]
        [--policy mlwe] [--src OTHER/src ...]

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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
trace = {load}
if {run!r}:
    r = replay(trace, ReplayConfig(policy={policy!r},
               checkpoint=parse_checkpoint_model({checkpoint!r})))
    print(json.dumps({{"avg_jct_s": r.metrics.get("avg_jct_s"), "jobs": len(trace.jobs)}}))
"""

#: inputs too large to be worth counting (hours under valgrind)
TOO_LARGE = {"philly-full"}

#: small inputs defined here for quick counts (policy_quality's are the targets')
EXTRA = {"philly-1000": ("philly", 1000, "nodes:8x8")}


def _count(src: Path, name: str, policy: str, checkpoint: str, run: bool) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        if name in EXTRA:
            trace, limit, cluster = EXTRA[name]
            load = f"load_trace({trace!r}, limit={limit}, cluster={cluster!r})"
        else:
            load = f"INPUTS[{name!r}][0]()"
        code = CHILD.format(here=str(HERE), load=load, run=run, policy=policy,
                            checkpoint=checkpoint)
        env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
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
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    if args.input in TOO_LARGE:
        raise SystemExit(f"{args.input} would take hours under valgrind; time it instead")
    name = args.input
    sys.path.insert(0, str(HERE))
    from policy_quality import INPUTS

    if name not in INPUTS and name not in EXTRA:
        raise SystemExit(f"unknown input {name!r}: {', '.join([*EXTRA, *INPUTS])}")
    first: float | None = None
    for src in [ROOT / "src", *map(Path, args.src)]:
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


if __name__ == "__main__":
    main()
