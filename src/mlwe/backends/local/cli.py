"""``mlwe daemon``: parse the command line, check the nodes against the machine, serve.

Registered in :mod:`mlwe.cli`; also runnable as ``python -m mlwe.backends.local``
(what ``LocalBackend.spawn_daemon`` does).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # imported where used: ``mlwe --help`` loads this module
    from mlwe.core.spec import NodeSpec


class NodeArgError(ValueError):
    pass


def parse_node(text: str) -> tuple[NodeSpec, tuple[int, ...] | None]:
    """A node from ``name=n0,cpu=2,memory=4Gi,gpus=1,gpu_model=A100-80GB,gpu_indices=0``
    or from a JSON object with the same keys."""
    from pydantic import ValidationError

    from mlwe.core.spec import NodeSpec

    data: dict[str, Any]
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise NodeArgError(f"--node {text!r}: not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise NodeArgError(f"--node {text!r}: a JSON node is an object")
    else:
        data = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise NodeArgError(f"--node {text!r}: {part!r} is not KEY=VALUE")
            data[key.strip()] = value.strip()
    raw_idx = data.pop("gpu_indices", None)
    indices: tuple[int, ...] | None = None
    if raw_idx is not None:
        try:
            items = raw_idx if isinstance(raw_idx, list) else str(raw_idx).replace(";", " ").split()
            indices = tuple(int(i) for i in items)
        except ValueError:
            raise NodeArgError(f"--node {text!r}: gpu_indices must be integers (0;1;2)") from None
    try:
        return NodeSpec.model_validate(data), indices
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'node'}: {e['msg']}" for e in exc.errors()
        )
        raise NodeArgError(f"--node {text!r}: {problems}") from None


def daemon_command(
    engine: Annotated[str, typer.Option(envvar="MLWE_ENGINE",
                                        help="the engine's LocalBackend address, HOST:PORT")],
    node: Annotated[list[str] | None, typer.Option(
        "--node", help="a node to serve: name=n0,cpu=4,memory=8Gi[,gpus=2,gpu_model=A100-80GB,"
        "gpu_indices=0;1] or a JSON object; repeat for several")] = None,
    cluster: Annotated[Path | None, typer.Option(
        help="serve nodes of this cluster file (YAML/JSON), with --serve")] = None,
    serve: Annotated[str | None, typer.Option(
        help="comma-separated node names of --cluster to serve (default: all)")] = None,
    state_dir: Annotated[Path, typer.Option(
        help="logs (and checkpoints, unless --checkpoint-root)")] = Path("~/.mlwe/daemon"),
    checkpoint_root: Annotated[Path | None, typer.Option(
        help="where workloads' checkpoint directories go (shared storage for multi-machine)")] = None,
    declared_gpus: Annotated[bool, typer.Option(
        "--declared-gpus", help="serve GPU nodes on a machine without GPUs (allocation only;"
        " GPU figures are labelled declared)")] = False,
    token: Annotated[str | None, typer.Option(
        envvar="MLWE_DAEMON_TOKEN", help="shared secret the engine expects")] = None,
    shutdown_grace: Annotated[float, typer.Option(
        min=0, help="seconds workloads get to checkpoint when the daemon is stopped")] = 10.0,
    parent_pid: Annotated[int | None, typer.Option(hidden=True)] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
) -> None:
    """Run the workload daemon: serve nodes of the cluster on this machine for the engine."""
    from mlwe.backends.local.daemon import Daemon, DaemonConfig, DaemonConfigError, check_nodes
    from mlwe.backends.local.telemetry import Nvml

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    err = typer.echo
    try:
        from mlwe.backends.local.protocol import parse_address

        address = parse_address(engine)
    except ValueError as exc:
        err(f"error: --engine: {exc}", err=True)
        raise typer.Exit(2) from None
    specs, indices = _declared_nodes(node or [], cluster, serve)
    nvml = Nvml.open()
    try:
        configs, source = check_nodes(specs, indices, nvml=nvml, declared_gpus=declared_gpus)
    except DaemonConfigError as exc:
        err(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    config = DaemonConfig(
        engine=address, nodes=configs, state_dir=state_dir.expanduser(),
        checkpoint_root=checkpoint_root.expanduser() if checkpoint_root else None,
        token=token, parent_pid=parent_pid, shutdown_grace_s=shutdown_grace, gpu_source=source,
    )
    code = Daemon(config, nvml).run()
    if code:
        raise typer.Exit(code)


def _declared_nodes(
    node: list[str], cluster: Path | None, serve: str | None
) -> tuple[list[NodeSpec], dict[str, tuple[int, ...]]]:
    """The nodes to serve (``--node``, then ``--serve`` of ``--cluster``) and their given
    GPU indices; an error is printed and exits with 2."""
    err = typer.echo
    specs: list[NodeSpec] = []
    indices: dict[str, tuple[int, ...]] = {}
    try:
        for text in node:
            spec, idx = parse_node(text)
            specs.append(spec)
            if idx is not None:
                indices[spec.name] = idx
    except NodeArgError as exc:
        err(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if cluster is not None:
        from mlwe.specfile import SpecFileError, load_cluster

        try:
            cspec = load_cluster(cluster)
        except SpecFileError as exc:
            err(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        all_nodes = {n.name: n for n in cspec.all_nodes()}
        names = [s.strip() for s in serve.split(",")] if serve else list(all_nodes)
        missing = [n for n in names if n not in all_nodes]
        if missing:
            err(f"error: --serve: no node {', '.join(missing)} in {cluster}", err=True)
            raise typer.Exit(2)
        specs += [all_nodes[n] for n in names]
    elif serve:
        err("error: --serve needs --cluster", err=True)
        raise typer.Exit(2)
    return specs, indices


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False)
    app.command()(daemon_command)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="mlwe daemon")


if __name__ == "__main__":  # pragma: no cover
    main()
