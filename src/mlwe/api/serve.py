"""``mlwe serve``: the whole engine with its API and dashboard, on embedded defaults.

Defaults: SQLite store in ``./.mlwe``, in-process bus, a simulated
heterogeneous cluster (A100, H100 and T4 GPU nodes, high-memory CPU nodes)
paced to wall time, a background workload generator, and the rules agent
when it is available. On first start (no active admin token) it creates an
admin token and prints it with the dashboard URL; only its hash is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlwe.api.app import create_app
from mlwe.api.auth import Role, TokenStore
from mlwe.api.context import ApiSettings
from mlwe.api.generator import WorkloadGenerator
from mlwe.backends.faults import FaultInjector
from mlwe.core.spec import ClusterSpec, NodePool, NodeSpec
from mlwe.runtime.backends import UnknownBackend, make_backend
from mlwe.runtime.clock import WallClock
from mlwe.runtime.engine import Engine, EngineConfig

if TYPE_CHECKING:
    from mlwe.backends.local.telemetry import GpuDevice

log = logging.getLogger("mlwe.serve")

#: The default simulated cluster: heterogeneous GPUs and high-memory CPU nodes.
DEFAULT_CLUSTER = ClusterSpec(
    pools=(
        NodePool(prefix="h100", count=2, gpu_model="H100-80GB", gpus=8, cpu=96, memory="1Ti"),
        NodePool(prefix="a100", count=3, gpu_model="A100-80GB", gpus=8, cpu=96, memory="1Ti"),
        NodePool(prefix="t4", count=3, gpu_model="T4", gpus=4, cpu=32, memory="256Gi"),
        NodePool(prefix="himem", count=2, cpu=128, memory="2Ti"),
    ),
    nodes=(NodeSpec(name="cpu-0", cpu=64, memory="512Gi"),),
)

#: ``--backend sim``: telemetry every 2 s, and 300 s for a workload that gives no estimate
SIM_TELEMETRY_S = 2.0
SIM_DEFAULT_DURATION_S = 300.0


class ServeError(RuntimeError):
    """The server cannot start as asked (the message says why and what to do)."""


def local_cluster(gpus: Sequence[GpuDevice] | None = None) -> ClusterSpec:
    """A cluster this machine can really host (``--backend local``, and the Ray cluster
    ``--backend ray`` starts here): CPU and memory a share of the machine's, and a GPU
    node over this machine's GPUs as NVML finds them (``gpus``: those devices instead),
    declared as the catalogue model they hold. Without GPUs the GPU node has two T4s as
    an allocation only, and its GPU figures are labelled declared."""
    import os

    import psutil

    from mlwe.backends.local.telemetry import Nvml, catalog_model

    if gpus is None:
        nv = Nvml.open()
        gpus = nv.devices if nv is not None else ()
        if nv is not None:
            nv.close()
    cores = max(2, os.cpu_count() or 2)
    mem_mib = int(psutil.virtual_memory().total / 2**20)
    per = max(1024, mem_mib // 8)
    share = {"cpu": f"{cores * 250}m", "memory": f"{per}Mi"}
    nodes = [NodeSpec(name="local-cpu-0", **share)]
    if not gpus:
        nodes.insert(0, NodeSpec(name="local-gpu-0", gpu_model="T4", gpus=2, **share))
    else:
        small = min(gpus, key=lambda d: d.memory_mib)
        model = catalog_model(small.memory_mib, small.name)
        if model is None:
            log.warning("no catalogue GPU model fits this machine's GPUs (%s): serving no GPU"
                        " node", ", ".join(f"{d.name} {d.memory_mib} MiB" for d in gpus))
        else:
            nodes.insert(0, NodeSpec(name="local-gpu-0", gpu_model=model, gpus=len(gpus),
                                     **share))
    return ClusterSpec(nodes=tuple(nodes))


def attach_agent(engine: Engine, mode: str = "autonomous") -> Any | None:
    """Run the rules agent on ``engine`` (:func:`mlwe.runtime.wiring.attach_agent`):
    telemetry in, one MAPE pass per engine tick, proposals through ``Engine.propose``;
    None if this build has no agent."""
    try:
        from mlwe.runtime.wiring import attach_agent as attach
    except ImportError:
        return None
    return attach(engine, mode=mode)


@dataclass
class Service:
    """A running engine with its API app and optional parts; ``close()`` stops them all."""

    engine: Engine
    app: Any
    tokens: TokenStore
    generator: WorkloadGenerator | None = None
    agent: Any | None = None
    bus: Any | None = None
    admin_token: str | None = None  # set only when this start created it
    extras: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        ingress = self.extras.get("ingress")
        if ingress is not None:
            ingress.stop()
        if self.generator is not None:
            self.generator.stop()
        relay = getattr(self.app.state, "relay", None)
        if relay is not None:
            relay.close()
        history = getattr(self.app.state, "history", None)
        if history is not None:
            history.close()
        self.app.state.ctx.submitter.close()
        close_agent = getattr(self.agent, "close", None)
        if callable(close_agent):
            close_agent()
        self.engine.close(stop_workloads=True)


def build_service(
    *,
    data_dir: str | Path | None = None,
    database_url: str | None = None,
    backend: str = "sim",
    cluster: ClusterSpec | None = None,
    speed: float = 1.0,
    generator: bool = True,
    agent: bool = True,
    agent_mode: str = "autonomous",
    bus_url: str | None = None,
    seed: int = 0,
    ray_address: str | None = None,
    slurm: Mapping[str, Any] | None = None,
    settings: ApiSettings | None = None,
    engine_config: EngineConfig | None = None,
    start_loop: bool = True,
    create_admin: bool = True,
) -> Service:
    clock = WallClock(speed=speed)
    cluster, inner = _start_backend(backend, clock, cluster, data_dir=data_dir, seed=seed,
                                    ray_address=ray_address, slurm=slurm)
    be = FaultInjector(inner, clock)
    engine = Engine.open(
        cluster,
        be,
        data_dir=data_dir,
        database_url=database_url,
        clock=clock,
        config=engine_config or EngineConfig(grace_s=10.0, retry_base_s=5.0),
    )
    try:
        settings = settings or ApiSettings()
        tokens = TokenStore(engine.repo.engine, cache_ttl_s=settings.token_cache_s)
        admin_token = None
        if create_admin and not any(
            t.role is Role.ADMIN and not t.revoked for t in tokens.list()
        ):
            admin_token, _ = tokens.create("admin", Role.ADMIN)
        bus = _check_bus(bus_url) if bus_url else None
        ingress = None
        if bus and start_loop:  # requests published on mlwe.requests.* reach the engine
            from mlwe.runtime.ingress import nats_ingress

            ingress = nats_ingress(engine, bus)
        ag = attach_agent(engine, agent_mode) if agent else None
        app = create_app(engine, tokens=tokens, settings=settings, agent=ag, bus=bus)
        gen = (
            WorkloadGenerator(engine, seed=seed, real_processes=backend != "sim")
            if generator
            else None
        )
        if start_loop:
            engine.start()
            if gen is not None:
                gen.start()
    except BaseException:
        engine.close(stop_workloads=True)
        raise
    svc = Service(engine, app, tokens, gen, ag, bus, admin_token)
    if ingress is not None:
        svc.extras["ingress"] = ingress
    return svc


def _start_backend(
    backend: str, clock: WallClock, cluster: ClusterSpec | None, *, data_dir: str | Path | None,
    seed: int, ray_address: str | None, slurm: Mapping[str, Any] | None,
) -> tuple[ClusterSpec, Any]:
    """The cluster (given, the default, or what Ray / Slurm say it is) and its backend, started."""
    if cluster is None:
        cluster = local_cluster() if backend == "local" else DEFAULT_CLUSTER
    if backend == "ray" and cluster is DEFAULT_CLUSTER:
        if ray_address != "local":
            raise ServeError("--backend ray needs --cluster FILE describing the Ray cluster's nodes")
        cluster = local_cluster()  # a Ray cluster started here, shaped like --backend local's
    if backend == "slurm" and cluster is DEFAULT_CLUSTER:
        # the cluster is what Slurm says it is (its node table, the partition's nodes)
        from mlwe.backends.slurm import SlurmCommands, SlurmError, discover_cluster

        opts = dict(slurm or {})
        try:
            cluster = discover_cluster(
                SlurmCommands(slurm_conf=opts.get("slurm_conf"), bin_dir=opts.get("bin_dir")),
                opts.get("partition"))
        except SlurmError as exc:
            raise ServeError(f"the slurm backend cannot read Slurm's nodes: {exc}") from exc
    if backend == "slurm":
        slurm = {k: v for k, v in dict(slurm or {}).items() if v is not None}
        # job scripts, reports and checkpoints must outlive the engine (a restart adopts
        # its jobs) and be seen by the nodes: under the data dir unless told otherwise
        slurm.setdefault("run_dir", str(Path(data_dir or ".mlwe") / "slurm"))
    try:
        inner = make_backend(backend, clock, cluster, seed=seed, telemetry_s=SIM_TELEMETRY_S,
                             default_duration_s=SIM_DEFAULT_DURATION_S, ray_address=ray_address,
                             slurm=slurm)
    except UnknownBackend as exc:
        raise ServeError(str(exc)) from None
    except (ImportError, OSError, RuntimeError, TimeoutError) as exc:
        raise ServeError(f"the {backend} backend did not start: {exc}") from exc
    return cluster, inner


def _check_bus(url: str) -> str:
    """Fail at start, not at the first replay, if the bus cannot be reached."""
    import asyncio

    if not url.startswith("nats://"):
        raise ServeError(f"unsupported bus {url!r}: use nats://HOST:PORT")
    from mlwe.bus.nats import NatsBus

    async def probe() -> None:
        bus = await NatsBus.connect(url)
        await bus.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        raise ServeError(f"cannot connect to the bus at {url}: {exc}") from None
    return url


def bind(host: str, port: int) -> Any:
    """A listening socket on host:port, or :class:`ServeError` saying why not (port in use,
    address not on this machine); bound before anything else starts or is printed."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = " (another server listens there: choose --port)" if exc.errno in (98, 48, 10048) else ""
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    sock.set_inheritable(True)
    return sock


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    log_level: str = "info",
    print_fn: Any = print,
    sock: Any = None,
    **kwargs: Any,
) -> None:
    """Build the service and run it under uvicorn until interrupted (on ``sock``, bound by
    :func:`bind`, so the port is known to be free before the token and URL are printed)."""
    import uvicorn

    sock = sock if sock is not None else bind(host, port)
    try:
        svc = build_service(**kwargs)
    except BaseException:
        sock.close()
        raise
    shown = "localhost" if host in ("0.0.0.0", "::", "127.0.0.1") else host
    url = f"http://{shown}:{port}/"
    print_fn(f"mlwe engine: backend {svc.engine.backend.name}, "
             f"{sum(1 for _ in svc.engine.reads.capacity.nodes())} nodes, "
             f"{len(svc.engine.reads.workloads)} workloads recovered")
    if svc.admin_token:
        print_fn("admin token (shown once; only its hash is stored):")
        print_fn(f"  {svc.admin_token}")
        print_fn(f"dashboard: {url}#token={svc.admin_token}")
        print_fn(f"more tokens: MLWE_URL={url.rstrip('/')} MLWE_TOKEN=<admin token> mlwe token create --role viewer")
    else:
        data_dir = kwargs.get("data_dir")
        from mlwe.store.db import redact_url

        where = (f" --database-url {redact_url(kwargs['database_url'])}" if kwargs.get("database_url")
                 else f" --data-dir {Path(data_dir or '.mlwe').resolve()}")
        print_fn(f"dashboard: {url}  (a token: mlwe token create --role viewer --url {url.rstrip('/')}"
                 f" --token <admin token>, or without a server: mlwe token create --role viewer{where})")
    config = uvicorn.Config(svc.app, host=host, port=port, log_level=log_level, access_log=False,
                            log_config=None, timeout_graceful_shutdown=5)
    try:
        # SSE streams never end by themselves: give them 5 s to go on shutdown
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        svc.close()
