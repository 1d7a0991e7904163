"""Which backend benchmark ``mlwe bench backend --backend NAME`` runs, and with what.

Each backend with a benchmark has a ``mlwe.backends.<name>.bench`` module exposing
``run_bench(**options) -> dict`` (eviction latency and overhead, measured on real
processes); :func:`run_backend_bench` imports it when called and leaves out the
options that backend does not take. The command itself is in :mod:`mlwe.bench_cli`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

BACKENDS = ("local", "ray", "slurm")


class NoBenchmark(Exception):
    """The backend's benchmark module cannot be imported (none, or a missing extra)."""


def run_backend_bench(backend: str, **options: Any) -> dict[str, Any]:
    """Run ``mlwe.backends.<backend>.bench.run_bench`` with the ``options`` it accepts."""
    try:
        module = importlib.import_module(f"mlwe.backends.{backend}.bench")
    except ModuleNotFoundError as exc:
        raise NoBenchmark(f"backend {backend!r} has no benchmark ({exc})") from None
    run = module.run_bench
    accepted = inspect.signature(run).parameters
    result: dict[str, Any] = run(**{k: v for k, v in options.items() if k in accepted})
    return result
