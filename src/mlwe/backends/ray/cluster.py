"""How mlwe nodes map onto Ray nodes, and a real multi-node Ray cluster on one machine.

The control plane decides placement; Ray executes it. Each mlwe node is one
Ray node that advertises two custom resources:

- ``mlwe_node:<name>`` (:data:`NODE_TOKENS` units): the node's identity. Every
  replica's placement-group bundle asks one unit of it, which pins the replica
  to exactly the node the control plane chose;
- ``gpu_model:<model>`` (one unit per GPU): the GPU model, so Ray itself also
  refuses a replica on a card the spec did not accept.

plus Ray's own ``GPU`` count (the node's ``gpus``). :func:`ray_node_args`
gives these for ``ray start`` on a real machine (:func:`ray_start_command`).

:class:`LocalRayCluster` starts a real Ray cluster on this machine
(``ray.cluster_utils.Cluster``): a head that runs nothing (num_cpus=0, no mlwe
resources) and one Ray node per mlwe node, each advertising fake GPU counts
and model resources, all on free ports (Redis holds 6379 on the project's
machines, so no Ray default port is used), with small CPU and object-store
figures so a two-core machine copes. Nodes can be killed (node loss) and
added back (node up) by mlwe name.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from mlwe.core.spec import ClusterSpec, NodeSpec

log = logging.getLogger(__name__)

NODE_RESOURCE = "mlwe_node:"
GPU_MODEL_RESOURCE = "gpu_model:"
#: Units of ``mlwe_node:<name>`` a Ray node advertises; each replica takes one.
NODE_TOKENS = 1000

#: Faster node-death detection than Ray's defaults (for the local cluster):
#: a killed raylet is declared dead after about 1.5 s instead of ~30 s.
FAST_HEALTH_CHECK: Mapping[str, int] = {
    "health_check_initial_delay_ms": 500,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


def node_resource(name: str) -> str:
    return f"{NODE_RESOURCE}{name}"


def gpu_model_resource(model: str) -> str:
    return f"{GPU_MODEL_RESOURCE}{model}"


def ray_node_args(node: NodeSpec) -> dict[str, Any]:
    """What a Ray node serving mlwe node ``node`` advertises: ``num_gpus`` and ``resources``."""
    resources: dict[str, float] = {node_resource(node.name): float(NODE_TOKENS)}
    if node.gpus and node.gpu_model:
        resources[gpu_model_resource(node.gpu_model)] = float(node.gpus)
    return {"num_gpus": node.gpus, "resources": resources}


def node_problems(node: NodeSpec, resources: Mapping[str, float]) -> list[str]:
    """What a Ray node advertising ``resources`` lacks to serve mlwe node ``node``."""
    out = []
    have_gpus = resources.get("GPU", 0.0)
    if node.gpus and have_gpus < node.gpus:
        out.append(f"node {node.name}: declares {node.gpus} GPUs but its Ray node has {have_gpus:g}")
    if node.gpu_model and resources.get(gpu_model_resource(node.gpu_model), 0.0) < node.gpus:
        out.append(
            f"node {node.name}: declares GPU model {node.gpu_model} but its Ray node does not"
            f" advertise {gpu_model_resource(node.gpu_model)}={node.gpus}"
        )
    return out


def ray_node_table() -> dict[str, list[tuple[str, bool, dict[str, float]]]]:
    """mlwe node name -> [(Ray node id, alive, resources)] for every Ray node advertising it
    (the connected cluster's node table)."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    out: dict[str, list[tuple[str, bool, dict[str, float]]]] = {}
    for n in nodes:
        res: dict[str, float] = dict(n.get("Resources") or {})
        for key in res:
            if key.startswith(NODE_RESOURCE):
                out.setdefault(key[len(NODE_RESOURCE):], []).append(
                    (str(n["NodeID"]), bool(n.get("Alive")), res)
                )
    return out


def ray_start_command(node: NodeSpec, head_address: str = "HEAD_IP:PORT") -> str:
    """The ``ray start`` line that makes a machine serve mlwe node ``node``."""
    args = ray_node_args(node)
    res = json.dumps(args["resources"], separators=(",", ":"))
    return (
        f"ray start --address={head_address} --num-gpus={args['num_gpus']}"
        f" --resources='{res}'"
    )


def _serves(have: NodeSpec, want: NodeSpec) -> bool:
    """Whether a Ray node started for ``have`` can stand for mlwe node ``want``."""
    return want.gpus <= have.gpus and (not want.gpus or want.gpu_model == have.gpu_model)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with the reason, when nothing answers at a Ray ``HOST:PORT`` address
    (``ray.init`` itself retries an unreachable GCS for minutes). ``auto`` and
    ``ray://`` addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6380)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(f"nothing answers at Ray address {address}: {exc}") from None


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick; never a Ray default)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalRayCluster:
    """A real multi-node Ray cluster on this machine, one Ray node per mlwe node.

    ``connect=True`` also connects this process to it (``ray.init``) in
    ``namespace``. Use :meth:`shutdown` (or the context manager) to stop every
    Ray process it started."""

    def __init__(
        self,
        nodes: ClusterSpec | Iterable[NodeSpec] = (),
        *,
        cpus_per_node: int = 1,
        object_store_mib: int = 80,
        dashboard: bool = True,
        fast_health_check: bool = True,
        connect: bool = True,
        namespace: str = "mlwe",
    ) -> None:
        try:
            import ray
            from ray.cluster_utils import Cluster
        except ImportError as exc:  # pragma: no cover - ray is a declared dependency
            raise RuntimeError(
                "the Ray backend needs ray[default]: pip install 'ray[default]'"
            ) from exc
        self._ray = ray
        # no usage reports to the internet from a cluster started for tests and demos
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.cpus_per_node = cpus_per_node
        self.object_store_bytes = object_store_mib * 2**20
        self.namespace = namespace
        self.nodes: dict[str, Any] = {}  # mlwe node name -> ray._private.node.Node
        self.specs: dict[str, NodeSpec] = {}
        head: dict[str, Any] = {
            "num_cpus": 0,  # the head runs no workload: nothing pins to it
            "num_gpus": 0,
            "object_store_memory": self.object_store_bytes,
            "gcs_server_port": free_port(),
            "ray_client_server_port": None,  # no Ray Client server: the engine connects natively
            "no_monitor": True,  # no autoscaler: the nodes are the ones started here
            "include_log_monitor": False,  # programs log to files; nothing streams to the driver
            "dashboard_agent_listen_port": free_port(),
            "metrics_export_port": free_port(),
            "include_dashboard": dashboard,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port() if dashboard else None,
        }
        if fast_health_check:
            head["_system_config"] = dict(FAST_HEALTH_CHECK)
        t0 = time.monotonic()
        cluster: Any = Cluster(initialize_head=True, head_node_args=head)
        self.cluster: Any = cluster
        try:
            self.dashboard = dashboard
            specs = nodes.all_nodes() if isinstance(nodes, ClusterSpec) else list(nodes)
            for spec in specs:
                self.add_node(spec, wait=False)
            self.cluster.wait_for_nodes()
            self.connected = False
            if connect:
                ray.init(
                    address=self.address,
                    namespace=namespace,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
                self.connected = True
        except BaseException:
            cluster.shutdown()
            raise
        self.start_s = time.monotonic() - t0

    @property
    def address(self) -> str:
        addr: str = self.cluster.address
        return addr

    def add_node(self, spec: NodeSpec, *, wait: bool = True) -> None:
        """Start a Ray node serving mlwe node ``spec`` (again, after :meth:`kill_node`)."""
        if spec.name in self.nodes:
            raise ValueError(f"Ray node for mlwe node {spec.name!r} is already running")
        args = ray_node_args(spec)
        node = self.cluster.add_node(
            wait=wait,
            num_cpus=self.cpus_per_node,
            num_gpus=args["num_gpus"],
            resources=args["resources"],
            object_store_memory=self.object_store_bytes,
            metrics_export_port=free_port(),
            dashboard_agent_listen_port=free_port() if self.dashboard else None,
        )
        self.nodes[spec.name] = node
        self.specs[spec.name] = spec

    def ensure_nodes(self, nodes: ClusterSpec | Iterable[NodeSpec]) -> None:
        """Have a live Ray node for each of ``nodes``.

        A Ray node already started for that name serves it when it advertises at
        least what the spec needs (as many GPUs or more, of the same model); one
        killed earlier is started again as it was first declared."""
        specs = nodes.all_nodes() if isinstance(nodes, ClusterSpec) else list(nodes)
        added = False
        for spec in specs:
            have = self.specs.get(spec.name)
            if have is not None and not _serves(have, spec):
                raise ValueError(
                    f"Ray node for mlwe node {spec.name!r} advertises {ray_node_args(have)},"
                    f" which does not serve {ray_node_args(spec)}"
                )
            if spec.name in self.nodes:
                continue
            self.add_node(have or spec, wait=False)
            added = True
        if added:
            self.cluster.wait_for_nodes()

    def kill_node(self, name: str, *, graceful: bool = False) -> None:
        """Kill the Ray node of mlwe node ``name`` (its raylet and every worker on it).

        Not graceful, the node dies whole, as a machine that loses power does: its
        raylet, its workers and every program they started are SIGKILLed together.
        (Ray's own ``remove_node`` kills the raylet only; its workers notice later,
        seconds later on a loaded machine, and a program could meanwhile run to its
        end on a node already declared lost.)"""
        node = self.nodes.pop(name, None)
        if node is None:
            raise KeyError(f"no running Ray node for mlwe node {name!r}")
        if not graceful:
            _kill_whole(node)
        self.cluster.remove_node(node, allow_graceful=graceful)

    def shutdown(self) -> None:
        if self.connected:
            self._ray.shutdown()
            self.connected = False
        self.cluster.shutdown()
        self.nodes.clear()

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _kill_whole(node: Any) -> None:
    """SIGKILL every process of a local Ray node and all their descendants at once."""
    import psutil

    procs: list[psutil.Process] = []
    for infos in node.all_processes.values():
        for info in infos:
            try:
                p = psutil.Process(info.process.pid)
                procs += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=10)

