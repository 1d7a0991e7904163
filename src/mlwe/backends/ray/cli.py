"""``mlwe ray``: make a Ray cluster serve an mlwe cluster, and check that it does.

- ``mlwe ray commands CLUSTER_FILE``: the ``ray start`` line for each mlwe node
  (its ``mlwe_node:<name>`` and ``gpu_model:<model>`` resources, its GPUs);
- ``mlwe ray check CLUSTER_FILE --address HOST:PORT``: connect to the Ray cluster
  and say, node by node, which Ray node serves it and what is missing (exit 1
  when anything is).

Registered in :mod:`mlwe.cli`; the engine side is ``mlwe serve --backend ray``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="Ray backend: how Ray nodes map to mlwe nodes.", no_args_is_help=True)

ClusterFile = Annotated[Path, typer.Argument(help="cluster spec (YAML or JSON)")]


def _cluster(path: Path) -> Any:
    from mlwe.specfile import SpecFileError, load_cluster

    try:
        return load_cluster(path)
    except (SpecFileError, OSError, ValueError) as exc:
        typer.echo(f"error: {path}: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("commands")
def commands_cmd(
    cluster_file: ClusterFile,
    head: Annotated[str, typer.Option(help="the Ray head's address")] = "HEAD_IP:PORT",
) -> None:
    """Print the `ray start` line that makes a machine serve each mlwe node."""
    from mlwe.backends.ray.cluster import ray_start_command

    for node in _cluster(cluster_file).all_nodes():
        typer.echo(f"# {node.name}")
        typer.echo(ray_start_command(node, head))


@app.command("check")
def check_cmd(
    cluster_file: ClusterFile,
    address: Annotated[str, typer.Option(help="Ray cluster address (HOST:PORT)")],
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
) -> None:
    """Check that a running Ray cluster serves every node of CLUSTER_FILE."""
    import ray

    from mlwe.backends.ray.cluster import (
        check_reachable,
        node_problems,
        node_resource,
        ray_node_table,
    )

    cluster = _cluster(cluster_file)
    try:
        check_reachable(address)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:
        typer.echo(f"error: cannot connect to Ray at {address}: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        table = ray_node_table()
    finally:
        ray.shutdown()
    rows = []
    for node in cluster.all_nodes():
        live = [(nid, res) for nid, alive, res in table.get(node.name, ()) if alive]
        if not live:
            problems = [f"no live Ray node advertises {node_resource(node.name)}"]
            ray_node = None
        else:
            ray_node, res = live[-1]
            problems = node_problems(node, res)
            if len(live) > 1:
                problems.append(f"{len(live)} live Ray nodes advertise {node_resource(node.name)}")
        rows.append({"node": node.name, "ray_node": ray_node, "problems": problems})
    ok = all(not r["problems"] for r in rows)
    if as_json:
        typer.echo(json.dumps({"ok": ok, "nodes": rows}, sort_keys=True))
    else:
        for r in rows:
            where = (r["ray_node"] or "-")[:12]
            status = "ok" if not r["problems"] else "; ".join(r["problems"])
            typer.echo(f"{r['node']:<24} {where:<13} {status}")
    if not ok:
        raise typer.Exit(1)
