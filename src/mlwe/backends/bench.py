"""``mlwe bench backend``: dispatch to a backend's own benchmark (``mlwe.backends.<name>.bench``).

Each backend module that has a benchmark exposes ``run_bench(**options) -> dict``;
the options a backend does not take are left out for it.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Annotated, Any

import typer

BACKENDS = ("local", "ray", "slurm")


def bench_backend_command(
    backend: Annotated[str, typer.Option(help=f"which backend: {', '.join(BACKENDS)}")] = "local",
    trials: Annotated[int, typer.Option(min=1, help="preemptions to time")] = 20,
    workloads: Annotated[int, typer.Option(min=1, help="running workloads for the CPU figure")] = 50,
    measure_s: Annotated[float, typer.Option(min=1, help="seconds to measure CPU over")] = 10.0,
    grace_s: Annotated[float, typer.Option(min=0, help="stop grace period")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Eviction latency and daemon overhead of a real backend (real processes)."""
    if backend not in BACKENDS:
        typer.echo(f"error: --backend must be one of {', '.join(BACKENDS)}", err=True)
        raise typer.Exit(2)
    try:
        module = importlib.import_module(f"mlwe.backends.{backend}.bench")
    except ModuleNotFoundError as exc:
        typer.echo(f"error: backend {backend!r} has no benchmark ({exc})", err=True)
        raise typer.Exit(2) from None
    run = module.run_bench
    options: dict[str, Any] = {"trials": trials, "workloads": workloads,
                               "measure_s": measure_s, "grace_s": grace_s}
    accepted = inspect.signature(run).parameters
    result = run(**{k: v for k, v in options.items() if k in accepted})
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
