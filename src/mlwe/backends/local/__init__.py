"""The local backend: workload daemons running real processes, and the engine's side.

- :class:`LocalBackend` (engine side, :mod:`.backend`, with :mod:`.engine_state`,
  :mod:`.link`, :mod:`.attempts`, :mod:`.messages` and :mod:`.registry`): the
  core Backend protocol over daemon connections;
- the daemon (:mod:`.daemon`, ``mlwe daemon``, with :mod:`.daemon_config`,
  :mod:`.replica` and :mod:`.daemon_telemetry`): runs workloads as process
  trees, evicts them gracefully, measures them with psutil and NVML;
- :class:`LocalNodes <mlwe.backends.local.nodes.LocalNodes>` (:mod:`.nodes`): a
  LocalBackend with one daemon per node, so that a node can fail on its own
  (the pipelines' case studies).
"""


from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy sees; at run time each name loads on first use
    from mlwe.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]



def __getattr__(name: str) -> Any:
    # loaded on first use: ``mlwe --help`` imports the daemon's CLI, not the backend
    if name == "LocalBackend":
        return import_module("mlwe.backends.local.backend").LocalBackend
    raise AttributeError(f"module 'mlwe.backends.local' has no attribute {name!r}")
