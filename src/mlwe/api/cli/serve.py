"""``mlwe serve``: the engine with its REST API and live dashboard, configured from flags,
the environment and a config file (see :mod:`mlwe.runtime.settings`). The server's
modules load inside the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlwe.api.cli.common import _echo, _fail

if TYPE_CHECKING:
    import socket

    from mlwe.api.context import ApiSettings
    from mlwe.runtime.settings import ServeSettings


def serve_cmd(
    config: Annotated[Path | None, typer.Option("--config", help="config file (YAML, TOML or JSON); default $MLWE_CLIENT_CONFIG")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on [$MLWE_HOST; 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option("--port", "-p", min=1, max=65535, help="[$MLWE_PORT; 8080]")] = None,
    backend: Annotated[str | None, typer.Option(help="sim, local, ray or slurm [$MLWE_BACKEND; sim]")] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="cluster spec file (nodes, queues); --backend ray needs it unless --ray-address local [$MLWE_CLUSTER]")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Ray cluster HOST:PORT for --backend ray ('local': start one on this machine) [$MLWE_RAY_ADDRESS]")] = None,
    slurm_partition: Annotated[str | None, typer.Option("--slurm-partition", help="--backend slurm: the partition whose nodes mlwe schedules (default: every node; SLURM_CONF names the cluster) [$MLWE_SLURM_PARTITION]")] = None,
    slurm_run_dir: Annotated[Path | None, typer.Option("--slurm-run-dir", help="--backend slurm: a directory the nodes share with this engine (job scripts, reports, checkpoints) [$MLWE_SLURM_RUN_DIR; <data dir>/slurm]")] = None,
    slurm_prefix: Annotated[str | None, typer.Option("--slurm-prefix", help="--backend slurm: marks this engine's jobs, adopted again after a restart [$MLWE_SLURM_PREFIX; mlwe]")] = None,
    database_url: Annotated[str | None, typer.Option("--database-url", help="SQLAlchemy URL [$MLWE_DATABASE_URL; SQLite in the data dir]")] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="data directory of the default SQLite store [$MLWE_DATA_DIR; ./.mlwe]")] = None,
    bus: Annotated[str | None, typer.Option("--bus", help="event bus URL, e.g. nats://127.0.0.1:4222 [$MLWE_BUS]")] = None,
    generator: Annotated[bool | None, typer.Option("--generator/--no-generator", help="background workloads [$MLWE_GENERATOR; on]")] = None,
    agent: Annotated[bool | None, typer.Option("--agent/--no-agent", help="run the agent loop [$MLWE_AGENT; on]")] = None,
    agent_mode: Annotated[str | None, typer.Option(help="autonomous, approve or observe [$MLWE_AGENT_MODE]")] = None,
    speed: Annotated[float | None, typer.Option(min=0.01, max=1000, help="engine clock speed, sim demos [$MLWE_SPEED; 1]")] = None,
    seed: Annotated[int | None, typer.Option(help="[$MLWE_SEED; 0]")] = None,
    cors_origin: Annotated[list[str] | None, typer.Option("--cors-origin", help="allowed browser origin, repeat [$MLWE_CORS_ORIGINS, comma-separated]")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error [$MLWE_LOG_LEVEL; info]")] = None,
    log_format: Annotated[str, typer.Option("--log-format", envvar="MLWE_LOG_FORMAT", help="text, or json: one JSON object per line [$MLWE_LOG_FORMAT; text]")] = "text",
    public_metrics: Annotated[bool, typer.Option("--public-metrics", envvar="MLWE_PUBLIC_METRICS", help="serve /metrics without a token, for a scraper that has none [$MLWE_PUBLIC_METRICS]")] = False,
    show_config: Annotated[bool, typer.Option("--show-config", help="print the effective configuration as JSON and exit")] = False,
) -> None:
    """Run the engine with its REST API and live dashboard.

    Each option may also come from its MLWE_* environment variable or the config
    file (flags win over the environment, the environment over the file). The port
    is bound first: nothing is built, and no token printed, for a server that
    cannot listen."""
    from mlwe.api.context import ApiSettings
    from mlwe.api.serve import ServeError, bind
    from mlwe.runtime.logs import LogConfigError, configure_logging

    cfg = _load_settings(
        config=config, host=host, port=port, backend=backend, cluster=cluster,
        ray_address=ray_address, slurm_partition=slurm_partition,
        slurm_run_dir=slurm_run_dir, slurm_prefix=slurm_prefix,
        database_url=database_url, data_dir=data_dir, bus=bus,
        generator=generator, agent=agent, agent_mode=agent_mode, speed=speed, seed=seed,
        cors_origins=tuple(cors_origin) if cors_origin else None, log_level=log_level,
    )
    if show_config:
        print(json.dumps(cfg.describe(), indent=2, sort_keys=True))
        return
    try:
        sock = bind(cfg.host, cfg.port)
    except ServeError as exc:
        raise _fail(exc, 2) from None
    try:
        configure_logging(log_format, cfg.log_level)
    except LogConfigError as exc:
        sock.close()
        raise _fail(exc, 2) from None
    _run(cfg, sock, ApiSettings(cors_origins=cfg.cors_origins, public_metrics=public_metrics))


def _load_settings(**options: Any) -> ServeSettings:
    """The effective configuration (flags, environment, config file); exit 2 when it is bad."""
    from mlwe.runtime.settings import ServeSettings, SettingsError

    try:
        return ServeSettings.load(**options)
    except SettingsError as exc:
        raise _fail(exc, 2) from None


def _run(cfg: ServeSettings, sock: socket.socket, settings: ApiSettings) -> None:
    """Build the engine, its API and the server on the bound socket, and serve; exit 2 (the
    socket closed) when it cannot be built."""
    from mlwe.api.serve import ServeError, serve
    from mlwe.core.extras import MissingExtra
    from mlwe.store.db import SchemaError

    try:
        from mlwe.specfile import load_cluster

        serve(
            host=cfg.host,
            port=cfg.port,
            sock=sock,
            log_level=cfg.log_level,
            backend=cfg.backend,
            cluster=load_cluster(cfg.cluster) if cfg.cluster is not None else None,
            ray_address=cfg.ray_address,
            slurm={"partition": cfg.slurm_partition, "prefix": cfg.slurm_prefix,
                   "run_dir": str(cfg.slurm_run_dir) if cfg.slurm_run_dir else None},
            database_url=cfg.database_url_value(),
            data_dir=cfg.data_dir,
            bus_url=cfg.bus,
            generator=cfg.generator,
            agent=cfg.agent,
            agent_mode=cfg.agent_mode,
            speed=cfg.speed,
            seed=cfg.seed,
            settings=settings,
            print_fn=_echo,
        )
    except (ServeError, SchemaError, ValueError, MissingExtra) as exc:
        sock.close()
        raise _fail(exc, 2) from None
