"""A synthetic workload that really uses the machine: ``python -m mlwe.programs.synthetic``.

It does ``--work`` seconds of work (wall seconds while running, kept across
attempts through checkpoints), holds ``--memory`` of resident RAM (a touched
bytearray), burns CPU in phases (``--phases 0.9:2,0.2:1`` = 90 % of a core for
2 s, then 20 % for 1 s, repeating), and reports a loss curve. Modes:

- ``normal``: the loss falls, the program finishes with exit code 0;
- ``diverge``: from ``--at`` (a progress fraction) the loss grows exponentially;
- ``nan``: from ``--at`` the loss is NaN;
- ``plateau``: from ``--at`` the loss stops improving;
- ``leak``: resident memory grows by ``--leak`` per second;
- ``crash``: at ``--at`` it exits with ``--exit-code``;
- ``ignore-sigterm``: SIGTERM is ignored, so only a force-stop ends it.

On SIGTERM (other modes) it waits ``--checkpoint-delay`` seconds (the time a
real checkpoint takes), saves its state and exits 0; the next attempt resumes
from that state. ``--children N`` starts N child processes holding
``--child-memory`` each (with ``--children-ignore-sigterm`` they ignore
SIGTERM), to exercise the whole-tree eviction. ``--hold-at F --hold-file PATH``
makes it wait at fraction F of its work until PATH exists (a barrier, so that a
test can act on a program known to be running): while it waits it uses the
machine as it does when it works (CPU phases, memory, reports) but its work does
not advance, and SIGTERM still checkpoints and stops it.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

from mlwe import workload as mw

MODES = ("normal", "diverge", "nan", "plateau", "leak", "crash", "ignore-sigterm")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
    "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'64Mi' -> 67108864; plain numbers are bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512Mi, 2Gi)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_phases(text: str) -> list[tuple[float, float]]:
    """'0.9:2,0.2:1' -> [(0.9, 2.0), (0.2, 1.0)] (duty cycle of one core, seconds)."""
    out = []
    for part in text.split(","):
        try:
            duty_s, secs_s = part.split(":")
            duty, secs = float(duty_s), float(secs_s)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"phase {part!r} is not DUTY:SECONDS (e.g. 0.9:2)"
            ) from None
        if not 0.0 <= duty <= 1.0 or secs <= 0:
            raise argparse.ArgumentTypeError(f"phase {part!r}: duty in [0, 1], seconds > 0")
        out.append((duty, secs))
    return out


def touch(n: int) -> bytearray:
    """n bytes that are really resident: every page written."""
    buf = bytearray(n)
    if n:
        pages = (n + 4095) // 4096
        buf[::4096] = b"\x01" * pages
    return buf


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlwe.programs.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=float, default=10.0, help="seconds of work to do")
    p.add_argument("--memory", type=parse_bytes, default=parse_bytes("32Mi"),
                   help="resident RAM to hold")
    p.add_argument("--phases", type=parse_phases, default=parse_phases("0.9:2,0.2:1"),
                   help="CPU duty cycle phases DUTY:SECONDS,...")
    p.add_argument("--mode", choices=MODES, default="normal")
    p.add_argument("--at", type=float, default=0.5, help="progress at which a mode starts")
    p.add_argument("--exit-code", type=int, default=3, help="exit code of mode crash")
    p.add_argument("--leak", type=parse_bytes, default=parse_bytes("16Mi"),
                   help="bytes per second leaked in mode leak")
    p.add_argument("--report-every", type=float, default=0.5, help="seconds between reports")
    p.add_argument("--checkpoint-every", type=float, default=0.0,
                   help="seconds of work between periodic checkpoints (0: only on SIGTERM)")
    p.add_argument("--checkpoint-delay", type=float, default=0.0,
                   help="seconds a checkpoint takes")
    p.add_argument("--children", type=int, default=0, help="child processes to start")
    p.add_argument("--child-memory", type=parse_bytes, default=parse_bytes("16Mi"))
    p.add_argument("--children-ignore-sigterm", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slice", type=float, default=0.05, help="seconds per scheduling slice")
    p.add_argument("--hold-at", type=float, default=None,
                   help="progress fraction at which to wait for --hold-file to exist")
    p.add_argument("--hold-file", default=None, help="the file that releases --hold-at")
    return p


CHILD = (
    "import signal, sys, time\n"
    "if sys.argv[2] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "n = int(sys.argv[1]); b = bytearray(n)\n"
    "if n: b[::4096] = b'\\x01' * ((n + 4095) // 4096)\n"
    "while True: time.sleep(3600)\n"
)


def held(args: argparse.Namespace, work_done: float) -> bool:
    """At the --hold-at barrier, and --hold-file not there yet."""
    return (args.hold_file is not None and work_done >= args.hold_at * args.work
            and not os.path.exists(args.hold_file))


def loss_at(mode: str, p: float, at: float, rng: random.Random) -> float:
    noise = 0.02 * rng.random()
    base = 2.5 * math.exp(-3.0 * p) + 0.1 + noise
    if mode == "diverge" and p >= at:
        return base * math.exp(8.0 * (p - at))
    if mode == "nan" and p >= at:
        return math.nan
    if mode == "plateau" and p >= at:
        return 2.5 * math.exp(-3.0 * at) + 0.1 + noise
    return base


def _args_ok(args: argparse.Namespace) -> bool:
    """Whether the arguments go together; else say why on stderr."""
    if args.work <= 0:
        print("--work must be positive", file=sys.stderr)
        return False
    if (args.hold_at is None) != (args.hold_file is None) or not 0 <= (args.hold_at or 0) <= 1:
        print("--hold-at (a fraction in [0, 1]) and --hold-file go together", file=sys.stderr)
        return False
    return True


def _spawn_children(args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    """The ``--children`` child processes, each holding ``--child-memory``."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(args.child_memory),
             "1" if args.children_ignore_sigterm else "0"]
        )
        for _ in range(args.children)
    ]


def _duty(phases: list[tuple[float, float]], pos: float) -> float:
    """The duty cycle of the phase ``pos`` seconds into the cycle of phases."""
    duty = phases[-1][0]
    for d, s in phases:
        if pos < s:
            duty = d
            break
        pos -= s
    return duty


def _burn(x: float, duty: float, slice_s: float) -> float:
    """One time slice: busy (real CPU work) for ``duty`` of it, asleep for the rest."""
    busy_until = time.perf_counter() + duty * slice_s
    while time.perf_counter() < busy_until:
        x = x * 1.000001 + 1e-9  # real CPU work
    rest = (1.0 - duty) * slice_s
    if rest > 0:
        time.sleep(rest)
    return x


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not _args_ok(args):
        return 2
    if args.mode == "ignore-sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        mw.should_stop()  # install the SIGTERM hook before anything slow
    saved = mw.resume_state()
    work_done = float(saved["work_s"]) if isinstance(saved, dict) else 0.0
    step = int(saved["step"]) if isinstance(saved, dict) else 0
    resumed_from = min(1.0, work_done / args.work)
    if saved is not None:
        print(f"resumed from a checkpoint at {resumed_from:.3f} ({work_done:.2f}s of work)",
              flush=True)
    rng = random.Random(f"{args.seed}:{mw.workload_id()}:{mw.replica()}")
    hold = touch(args.memory)
    leaked: list[bytearray] = []
    children = _spawn_children(args)
    mw.report(step=step, progress=resumed_from, resumed_from=resumed_from,
              memory_mib=len(hold) / 2**20)

    def checkpoint() -> None:
        mw.save_state({"work_s": work_done, "step": step},
                      progress=min(1.0, work_done / args.work), step=step)

    phases = args.phases
    cycle = sum(s for _, s in phases)
    t0 = time.monotonic()
    last = t0
    next_report = t0 + args.report_every
    next_ckpt = work_done + args.checkpoint_every if args.checkpoint_every > 0 else math.inf
    x = 1.0
    while work_done < args.work:
        waiting = held(args, work_done)
        duty = _duty(phases, (time.monotonic() - t0) % cycle)
        x = _burn(x, duty, args.slice)
        now = time.monotonic()
        dt = now - last
        last = now
        if not waiting:  # held, it uses the machine as when it works, but does no work
            work_done = min(args.work, work_done + dt)
            step += 1
        p = work_done / args.work
        if args.mode == "leak":
            leaked.append(touch(int(args.leak * dt)))
        if args.mode == "crash" and p >= args.at:
            print(f"synthetic: crashing on purpose with exit code {args.exit_code}",
                  file=sys.stderr, flush=True)
            return int(args.exit_code)
        if args.mode != "ignore-sigterm" and mw.should_stop():
            if args.checkpoint_delay:
                time.sleep(args.checkpoint_delay)
            checkpoint()
            print(f"stopped by SIGTERM{' while held' if waiting else ''}; checkpoint saved"
                  f" at {p:.3f}", flush=True)
            return 0
        if work_done >= next_ckpt:
            checkpoint()
            next_ckpt = work_done + args.checkpoint_every
        if now >= next_report:
            next_report = now + args.report_every
            mw.report(step=step, loss=loss_at(args.mode, p, args.at, rng), progress=p,
                      memory_mib=(len(hold) + sum(map(len, leaked))) / 2**20)
    mw.report(step=step, loss=loss_at(args.mode, 1.0, args.at, rng), progress=1.0)
    for c in children:
        c.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
