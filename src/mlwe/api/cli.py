"""The service's CLI commands, registered on the ``mlwe`` app by ``mlwe.cli``.

``serve`` runs the engine with its API and dashboard; the other commands talk to
a running server: the URL and token come from ``--url`` / ``--token``, else
``$MLWE_URL`` / ``$MLWE_TOKEN``, else a client context (``mlwe config``, see
:mod:`mlwe.clientconfig`). ``token`` and ``audit`` also have a local mode
(``--local``, or ``--data-dir`` / ``--database-url``) that opens the engine's
database directly: how the first tokens are made, and how an audit is checked
with no server running. (``mlwe bench api``, which measures the API, is in
:mod:`mlwe.bench_cli`.)

Every read command takes ``-o table|wide|json|yaml|name`` (see
:mod:`mlwe.output`). This module imports only Typer and the standard library at
load time; the client, the server and YAML load inside the commands.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from mlwe.output import Column, Format, age, cell, duration, fields, render, rfc3339

Url = Annotated[
    str | None,
    typer.Option("--url", "-u", help="server URL; default $MLWE_URL, the current context, http://127.0.0.1:8080"),
]
Token = Annotated[
    str | None, typer.Option("--token", "-t", help="bearer token; default $MLWE_TOKEN or the current context")
]
CtxName = Annotated[str | None, typer.Option("--context", help="client context (mlwe config get-contexts)")]
AsJson = Annotated[bool, typer.Option("--json", help="same as -o json")]
Output = Annotated[Format, typer.Option("--output", "-o", help="table, wide, json, yaml or name")]
Watch = Annotated[bool, typer.Option("--watch", "-w", help="list, then print rows as they change")]
Interval = Annotated[float, typer.Option("--interval", min=0.2, help="--watch: seconds between looks")]
DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="local mode: data directory of the engine's SQLite store [$MLWE_DATA_DIR]"),
]
DatabaseUrl = Annotated[
    str | None, typer.Option("--database-url", help="local mode: SQLAlchemy URL of the engine's database")
]
Local = Annotated[bool, typer.Option("--local", help="open the engine's database instead of asking a server")]

token_app = typer.Typer(help="API tokens (stored hashed): through the server, or --local.", no_args_is_help=True)
audit_app = typer.Typer(help="The tamper-evident decision audit: through the server, or --local.",
                        no_args_is_help=True)
config_app = typer.Typer(help="Client contexts: named server URL + token pairs (like a kubeconfig).",
                         no_args_is_help=True)


def _echo(text: str = "", *, err: bool = False) -> None:
    (sys.stderr if err else sys.stdout).write(text + "\n")
    (sys.stderr if err else sys.stdout).flush()


def _fmt(output: Format, as_json: bool) -> Format:
    return Format.json if as_json else output


def _client(url: str | None, token: str | None, context: str | None = None) -> Any:
    from mlwe.client import Client
    from mlwe.clientconfig import ConfigError, resolve

    try:
        u, t = resolve(url, token, context)
    except ConfigError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return Client(u, t)


def _fail(exc: Exception) -> typer.Exit:
    _echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def _call(fn: Callable[[], Any]) -> Any:
    from mlwe.client import ClientError

    try:
        return fn()
    except ClientError as exc:
        raise _fail(exc) from None


# ====================================================================== serve
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
    from mlwe.api.serve import ServeError, bind, serve
    from mlwe.core.extras import MissingExtra
    from mlwe.runtime.logs import LogConfigError, configure_logging
    from mlwe.runtime.settings import ServeSettings, SettingsError
    from mlwe.store.db import SchemaError

    try:
        cfg = ServeSettings.load(
            config=config, host=host, port=port, backend=backend, cluster=cluster,
            ray_address=ray_address, slurm_partition=slurm_partition,
            slurm_run_dir=slurm_run_dir, slurm_prefix=slurm_prefix,
            database_url=database_url, data_dir=data_dir, bus=bus,
            generator=generator, agent=agent, agent_mode=agent_mode, speed=speed, seed=seed,
            cors_origins=tuple(cors_origin) if cors_origin else None, log_level=log_level,
        )
    except SettingsError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if show_config:
        print(json.dumps(cfg.describe(), indent=2, sort_keys=True))
        return
    try:
        sock = bind(cfg.host, cfg.port)
    except ServeError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        configure_logging(log_format, cfg.log_level)
    except LogConfigError as exc:
        sock.close()
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = ApiSettings(cors_origins=cfg.cors_origins, public_metrics=public_metrics)
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
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


# ============================================================ client commands
SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def _spec_sources(files: list[Path]) -> Iterator[tuple[str, str | None, bool]]:
    """(name, text or None when unreadable, is_yaml) for each file, ``-`` (stdin) and
    each spec file under a directory (sorted, recursively)."""
    for f in files:
        if str(f) == "-":
            yield "<stdin>", sys.stdin.read(), True
        elif f.is_dir():
            found = sorted(p for p in f.rglob("*") if p.is_file() and p.suffix.lower() in SPEC_SUFFIXES)
            if not found:
                _echo(f"warning: {f}: no .yaml, .yml or .json file in this directory", err=True)
            for p in found:
                yield from _read(p)
        else:
            yield from _read(f)


def _read(p: Path) -> Iterator[tuple[str, str | None, bool]]:
    try:
        yield str(p), p.read_text(encoding="utf-8"), p.suffix.lower() != ".json"
    except (OSError, UnicodeDecodeError) as exc:
        _echo(f"error: {p}: cannot read: {exc}", err=True)
        yield str(p), None, True


def submit_cmd(
    files: Annotated[list[Path], typer.Argument(help="spec files (YAML or JSON), directories of them, or - for stdin")],
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Submit workload specs to a running server; every file is tried, and the bad ones named."""
    from mlwe.client import ClientError, ServerUnreachable

    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    created: list[str] = []
    failed: list[str] = []
    for name, text, is_yaml in _spec_sources(files):
        if text is None:
            failed.append(name)
            continue
        try:
            ids = list(c.submit_text(text, yaml=is_yaml)["created"])
        except ServerUnreachable as exc:
            raise _fail(exc) from None
        except ClientError as exc:
            failed.append(name)
            _echo(f"error: {name}: {exc.status}: {exc.detail}", err=True)
            for e in exc.errors:
                where = e.get("path") or ""
                _echo(f"  {name}: {where + ': ' if where else ''}{e.get('message', '')}", err=True)
            continue
        created += ids
        if fmt is Format.name:
            for i in ids:
                _echo(i)
        elif fmt in (Format.table, Format.wide):
            _echo(f"{name}: submitted {', '.join(ids)}")
    if fmt in (Format.json, Format.yaml):
        from mlwe.output import dump

        dump({"created": created, "failed": failed}, fmt)
    if failed:
        _echo(f"{len(failed)} file(s) not submitted: {', '.join(failed)}", err=True)
        raise typer.Exit(1)


def _deadline(w: Mapping[str, Any]) -> str:
    left = w.get("deadline_left_s")
    if left is None:
        return "-"
    if w.get("state") in ("succeeded", "failed", "cancelled"):
        return "met" if left >= 0 else "missed"
    return duration(left) + (" at-risk" if w.get("deadline_at_risk") else "")


def _workload_columns(now: float | None) -> list[Column]:
    return [
        Column("ID", lambda w: w["id"]),
        Column("NAME", lambda w: w["name"], wide=True),
        Column("KIND", lambda w: w.get("kind"), wide=True),
        Column("QUEUE", lambda w: w["queue"]),
        Column("OWNER", lambda w: w.get("owner")),
        Column("STATE", lambda w: w["state"]),
        Column("PRIO", lambda w: w["priority"]),
        Column("GPUS", lambda w: w["gpus"]),
        Column("NODES", lambda w: w["nodes"]),
        Column("PROGRESS", lambda w: f"{w['progress'] * 100:.0f}%"),
        Column("ATTEMPT", lambda w: w.get("attempt"), wide=True),
        Column("PREEMPTED", lambda w: w.get("preemptions"), wide=True),
        Column("DEADLINE", _deadline),
        Column("AGE", lambda w: age(w.get("submit_time"), now)),
        Column("CORRELATION", lambda w: w.get("correlation_id"), wide=True),
        Column("WHY-WAITING", _why_waiting),
    ]


def _why_waiting(w: Mapping[str, Any]) -> str:
    if w.get("condition") == "inadmissible":
        return "inadmissible: " + "; ".join(w.get("inadmissible_reasons") or [w.get("pending_reason") or ""])
    return str(w.get("pending_reason") or "")


def _watch_rows(
    fetch: Callable[[], tuple[list[dict[str, Any]], float | None]],
    columns: Callable[[float | None], list[Column]],
    fmt: Format,
    interval: float,
    key: str,
) -> None:
    """``--watch``: the list, then each row again when what it shows changes (polling)."""
    from mlwe.client import ClientError

    items, now = _call(fetch)
    render(items, columns(now), fmt, raw=items)
    def shown(x: Mapping[str, Any]) -> tuple[str, ...]:  # what a change means: the cells, not the ages
        return tuple(cell(c.get(x)) for c in columns(now) if c.header != "AGE")

    last = {str(x[key]): shown(x) for x in items}
    cols = [c for c in columns(now) if fmt is Format.wide or not c.wide]
    while True:
        time.sleep(interval)
        try:
            items, now = fetch()
        except ClientError as exc:
            _echo(f"watch: {exc}; trying again", err=True)
            continue
        for x in items:
            k = str(x[key])
            s = shown(x)
            if last.get(k) != s:
                last[k] = s
                if fmt in (Format.json, Format.yaml):
                    print(json.dumps(x, sort_keys=True), flush=True)
                elif fmt is Format.name:
                    _echo(k)
                else:
                    _echo("   ".join(cell(c.get(x)) for c in cols))


def status_cmd(
    workload: Annotated[str | None, typer.Argument(help="a workload id: its detail")] = None,
    state: Annotated[str | None, typer.Option("--state", "-s", help="filter: comma-separated states")] = None,
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="filter: one queue")] = None,
    owner: Annotated[str | None, typer.Option("--owner", help="filter: who submitted (token name)")] = None,
    limit: Annotated[int, typer.Option("--limit", "-l", min=1, max=1000)] = 50,
    watch: Watch = False,
    interval: Interval = 2.0,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Workloads and their states (or one workload with its history)."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    if workload:
        w = _call(lambda: c.workload(workload))
        if fmt in (Format.json, Format.yaml, Format.name):
            render([w], [], fmt, raw=w)
            return
        now = w.get("now")
        fields([
            ("ID", w["id"]), ("Name", w["name"]), ("Kind", w["kind"]), ("State", w["state"]),
            ("Queue", w["queue"]), ("Owner", w.get("owner")), ("Priority", w["priority"]),
            ("Replicas", w["replicas"]), ("GPUs", w["gpus"]), ("Nodes", w["nodes"]),
            ("Progress", f"{w['progress'] * 100:.0f}%"), ("Attempt", w["attempt"]),
            ("Preemptions", w["preemptions"]), ("Preempted by", w.get("preempted_by")),
            ("Submitted", f"{rfc3339(w['submit_time'])} ({age(w['submit_time'], now)} ago)"),
            ("Deadline", "-" if w.get("deadline") is None else f"{rfc3339(w['deadline'])} ({_deadline(w)})"),
            ("Work done", duration(w.get("work_done_s"))),
            ("Remaining", duration(w.get("remaining_estimate_s"))),
            ("Why waiting", w.get("pending_reason")), ("Failure", w.get("failure_cause")),
            ("Correlation", w.get("correlation_id")),
        ])
        _echo("History:")
        render(
            w["history"],
            [Column("TIME", lambda t: rfc3339(t["time"])), Column("FROM", lambda t: t["source"]),
             Column("TO", lambda t: t["target"]), Column("REASON", lambda t: t["reason"])],
            Format.table,
        )
        return

    def fetch() -> tuple[list[dict[str, Any]], float | None]:
        page = c.workload_page(state=state, queue=queue, owner=owner, limit=limit)
        return page["items"], page.get("now")

    if watch:
        _watch_rows(fetch, _workload_columns, fmt, interval, "id")
        return
    items, now = _call(fetch)
    render(items, _workload_columns(now), fmt, raw=items, empty="no workloads")


def explain_cmd(
    workload: Annotated[str, typer.Argument(help="workload id")],
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Why is a workload where it is: not placed, preempted, failed?"""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    e = _call(lambda: c.explain(workload))
    if fmt in (Format.json, Format.yaml, Format.name):
        render([{"id": e["workload"]}], [], fmt, raw=e)
        return
    _echo(e["summary"])
    decisions = e["decisions"] if fmt is Format.wide else e["decisions"][-10:]
    for d in decisions:
        _echo(f"  [{d['kind']}] {rfc3339(d['time'])} {d['policy']}: {d['chosen']}")
        for r in d["reasons"]:
            _echo(f"      - {r}")


def cancel_cmd(
    workload: Annotated[str, typer.Argument(help="workload id")],
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Cancel a workload."""
    c = _client(url, token, context)
    r = _call(lambda: c.cancel(workload))
    _echo(r["message"])


NODE_VERBS = ("cordon", "uncordon", "drain")


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f}Gi"


def _node_columns(now: float | None = None) -> list[Column]:
    return [
        Column("NODE", lambda n: n["name"]),
        Column("STATUS", lambda n: n["status"]),
        Column("GPUS", lambda n: f"{n['gpus']}x{n['gpu_model']}" if n["gpus"] else "-"),
        Column("FREE-GPU", lambda n: f"{n['free']['gpu'] / 1000:g}"),
        Column("FREE-CPU", lambda n: f"{n['free']['cpu'] / 1000:g}"),
        Column("FREE-MEM", lambda n: _gib(n["free"]["ram"])),
        Column("CAP-CPU", lambda n: f"{n['capacity']['cpu'] / 1000:g}", wide=True),
        Column("CAP-MEM", lambda n: _gib(n["capacity"]["ram"]), wide=True),
        Column("VRAM/GPU", lambda n: _gib(n["vram_per_gpu"]) if n["gpus"] else "-", wide=True),
        Column("WORKLOADS", lambda n: len(n["workloads"])),
        Column("RUNNING", lambda n: n["workloads"], wide=True),
        Column("LABELS", lambda n: n.get("labels"), wide=True),
    ]


def nodes_cmd(
    action: Annotated[str | None, typer.Argument(help="a node name (its detail), or cordon, uncordon or drain")] = None,
    node: Annotated[str | None, typer.Argument(help="the node to cordon, uncordon or drain")] = None,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded in the audit log)")] = "",
    watch: Watch = False,
    interval: Interval = 2.0,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """List nodes, show one (mlwe nodes NODE), or cordon / uncordon / drain one."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    if action in NODE_VERBS:
        if node is None:
            _echo(f"usage: mlwe nodes {action} NODE [--reason TEXT]", err=True)
            raise typer.Exit(2)
        r = _call(lambda: c.node_action(node, action, reason))
        _echo(r["message"])
        return
    if action is not None:
        if node is not None:
            _echo(f"error: {action!r} is not an action (cordon, uncordon or drain)", err=True)
            _echo("usage: mlwe nodes [NODE | cordon|uncordon|drain NODE]", err=True)
            raise typer.Exit(2)
        n = _call(lambda: c.node(action))
        if fmt in (Format.json, Format.yaml, Format.name):
            render([n], [], fmt, raw=n, name=lambda x: str(x["name"]))
            return
        labels = {"NODE": "Node", "STATUS": "Status", "GPUS": "GPUs", "FREE-GPU": "Free GPUs", "FREE-CPU": "Free CPUs",
                  "FREE-MEM": "Free memory", "CAP-CPU": "CPUs", "CAP-MEM": "Memory", "VRAM/GPU": "VRAM per GPU",
                  "WORKLOADS": "Workloads", "RUNNING": "Holders", "LABELS": "Labels"}
        fields([(labels.get(col.header, col.header), col.get(n)) for col in _node_columns()])
        if n["devices"]:
            _echo("GPUs:")
            render(n["devices"], [
                Column("INDEX", lambda d: d["index"]),
                Column("FREE", lambda d: f"{d['free_milli'] / 1000:g}"),
                Column("HOLDERS", lambda d: [f"{h.get('id')}({h.get('milli', 0) / 1000:g})" for h in d["holders"]]),
            ], Format.table)
        return

    def fetch() -> tuple[list[dict[str, Any]], float | None]:
        return c.nodes(), None

    if watch:
        _watch_rows(fetch, _node_columns, fmt, interval, "name")
        return
    items = _call(c.nodes)
    render(items, _node_columns(), fmt, raw=items, name=lambda x: str(x["name"]), empty="no nodes")


def queues_cmd(
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Queues with their quotas, usage, pending and running counts."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    items = _call(c.queues)
    render(items, [
        Column("QUEUE", lambda q: q["name"]),
        Column("COHORT", lambda q: q.get("cohort")),
        Column("WEIGHT", lambda q: q["weight"]),
        Column("PENDING", lambda q: q["pending"]),
        Column("RUNNING", lambda q: q["running"]),
        Column("GPU-USED", lambda q: f"{q['usage']['gpu'] / 1000:g}"),
        Column("GPU-QUOTA", lambda q: "-" if q["nominal"].get("gpu") is None else f"{q['nominal']['gpu'] / 1000:g}"),
        Column("NOMINAL", lambda q: {k: v for k, v in q["nominal"].items() if v is not None}, wide=True),
        Column("BORROW-LIMIT", lambda q: {k: v for k, v in q["borrowing_limit"].items() if v is not None}, wide=True),
    ], fmt, raw=items, name=lambda q: str(q["name"]), empty="no queues")


# ====================================================================== watch
def _event_line(ev: Any) -> str:
    d = ev.data
    if ev.id is None:
        return f"-- {ev.topic}: {d.get('message') or cell(d)}"
    data = d.get("data", {})
    t = time.strftime("%H:%M:%S", time.localtime(d.get("time", 0)))
    if ev.topic == "state":
        if data.get("type") == "command":
            return f"{t} command  {data.get('command')} {data.get('workload')} attempt {data.get('attempt')}"
        return f"{t} state    {data.get('workload')}: {data.get('from')} -> {data.get('to')} ({cell(data.get('reason'))})"
    if ev.topic == "audit":
        p = data.get("payload", {})
        what = p.get("chosen") or p.get("action") or p.get("event") or ""
        return f"{t} audit    #{data.get('seq')} {data.get('kind')} by {data.get('actor')}: {d.get('workload') or '-'} {cell(what)}"
    if ev.topic == "reasoning":
        return (f"{t} reason   [{data.get('source', 'agent')}] {data.get('title') or data.get('summary') or ''}:"
                f" {cell(data.get('choice') or data.get('outcome'))}")
    if ev.topic == "telemetry":
        m = data.get("metrics") or {}
        shown = " ".join(f"{k}={cell(v)}" for k, v in sorted(m.items())[:6])
        return f"{t} telem    {data.get('node') or '-'} {data.get('workload') or '-'} {shown}"
    return f"{t} {ev.topic:<8} {d.get('workload') or '-'} {cell(data)}"


def watch_cmd(
    topics: Annotated[str, typer.Option("--topics", help="comma-separated: state, reasoning, audit, telemetry")] = "state,reasoning,audit",
    workload: Annotated[str | None, typer.Option("--workload", "-W", help="only this workload's events")] = None,
    correlation: Annotated[str | None, typer.Option("--correlation", "-c", help="only this correlation id")] = None,
    count: Annotated[int | None, typer.Option("--count", "-n", min=1, help="stop after this many events")] = None,
    retries: Annotated[int, typer.Option("--retries", min=0, help="reconnect attempts in a row before giving up")] = 8,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Follow the live streams: the current state first, then events (resumes after a drop)."""
    from mlwe.client import ClientError, ServerUnreachable

    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    structured = fmt in (Format.json, Format.yaml)
    wanted = [t.strip() for t in topics.split(",") if t.strip()]
    # the current state, so a quiet cluster is not a blank screen
    if workload:
        w = _call(lambda: c.workload(workload))
        if not structured:
            _echo(f"-- now: {w['id']} is {w['state']} (queue {w['queue']}, progress {w['progress'] * 100:.0f}%"
                  + (f", nodes {cell(w['nodes'])})" if w["nodes"] else ")"))
    else:
        page = _call(lambda: c.workload_page(limit=1000))
        if not structured:
            by: dict[str, int] = {}
            for x in page["items"]:
                by[x["state"]] = by.get(x["state"], 0) + 1
            states = ", ".join(f"{n} {s}" for s, n in sorted(by.items())) or "none"
            _echo(f"-- now: {page['total']} workloads ({states})")
    last: int | None = None
    seen = failures = 0
    while True:
        try:
            for ev in c.stream(wanted, last_event_id=last, workload=workload,
                               correlation_id=correlation, notices=True, reconnect=False):
                if ev.topic == "hello":
                    failures = 0
                    if not structured:
                        _echo(f"-- connected to {c.url} (topics {', '.join(wanted)}); waiting for events")
                    continue
                if ev.id is not None:
                    last = ev.id
                if structured:
                    print(json.dumps({"event": ev.topic, "id": ev.id, **ev.data}, sort_keys=True), flush=True)
                else:
                    _echo(_event_line(ev))
                if ev.id is not None:
                    seen += 1
                    if count is not None and seen >= count:
                        return
            raise ServerUnreachable(c.url, "the stream ended")
        except ServerUnreachable as exc:
            failures += 1
            if failures > retries:
                _echo(f"error: gave up after {retries} reconnect attempts: {exc}", err=True)
                raise typer.Exit(1) from None
            wait = min(30.0, 0.5 * 2 ** (failures - 1))
            _echo(f"-- stream interrupted ({exc}); reconnecting in {wait:g} s"
                  f" (attempt {failures}/{retries})", err=True)
            time.sleep(wait)
        except ClientError as exc:
            raise _fail(exc) from None


# ============================================================ tokens and audit
def _local_engine(data_dir: Path | None, database_url: str | None) -> Any:
    """The engine's database, opened directly; refuses (instead of creating an empty one) when
    there is none at the given place."""
    import os

    from mlwe.store.db import ENV_DATA_DIR, ENV_URL, SchemaError, check_schema, make_engine
    from mlwe.store.db import database_url as resolve

    if database_url is None and not os.environ.get(ENV_URL, "").strip():
        d = Path(data_dir or os.environ.get(ENV_DATA_DIR, "").strip() or ".mlwe")
        if not (d / "mlwe.db").exists():
            _echo(f"error: no engine database at {(d / 'mlwe.db').resolve()}: the schema is missing"
                  f" (give the server's --data-dir, or create one with mlwe db upgrade --data-dir {d})", err=True)
            raise typer.Exit(2)
    from mlwe.core.extras import MissingExtra

    try:
        engine = make_engine(resolve(data_dir=data_dir, url=database_url))
    except (MissingExtra, ValueError) as exc:  # e.g. a postgres URL without psycopg
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        check_schema(engine)
    except SchemaError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return engine


def _is_local(local: bool, data_dir: Path | None, database_url: str | None, url: str | None,
              context: str | None) -> bool:
    """Local mode (open the engine's database) or through a server?

    Local with ``--local``, ``--data-dir`` or ``--database-url``; through a server with
    ``--url``, ``$MLWE_URL``, ``--context``/``$MLWE_CONTEXT`` or a current context; else
    local when ``$MLWE_DATA_DIR`` or ``$MLWE_DATABASE_URL`` names the database (a shell
    in the server's container), and through the default server otherwise."""
    import os

    if local or data_dir is not None or database_url is not None:
        return True
    if url or os.environ.get("MLWE_URL") or context or os.environ.get("MLWE_CONTEXT"):
        return False
    # the names of mlwe.store.db.ENV_DATA_DIR / ENV_URL (not imported: that loads SQLAlchemy)
    if not (os.environ.get("MLWE_DATA_DIR", "").strip() or os.environ.get("MLWE_DATABASE_URL", "").strip()):
        return False
    from mlwe.clientconfig import ConfigError
    from mlwe.clientconfig import context as current

    try:
        return current() is None
    except ConfigError:
        return False


_TOKEN_COLUMNS = [
    Column("ID", lambda t: t["id"]),
    Column("NAME", lambda t: t["name"]),
    Column("ROLE", lambda t: t["role"]),
    Column("CREATED", lambda t: rfc3339(t.get("created"))),
    Column("REVOKED", lambda t: t.get("revoked")),
    Column("POLICY", lambda t: _policy_text(t.get("policy"))),
]


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option("--role", "-r", help="viewer, submitter, operator or admin")],
    name: Annotated[str | None, typer.Option("--name", help="a name for the token (who holds it)")] = None,
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", help="a queue the token may submit to (repeat; default: any queue)"),
    ] = None,
    max_priority: Annotated[
        str | None,
        typer.Option("--max-priority", help="the highest priority it may ask for: an integer or a class (e.g. high)"),
    ] = None,
    allow_protected: Annotated[
        bool, typer.Option("--allow-protected/--no-protected", help="whether it may submit protected workloads")
    ] = True,
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
) -> None:
    """Create a token (admin); prints it once (only its hash is stored)."""
    from mlwe.api.auth import Role, TokenPolicy, TokenStore
    from mlwe.store.audit import AuditLog

    label = name or f"{role}-{int(time.time())}"
    if not _is_local(local, data_dir, database_url, url, context):
        c = _client(url, token, context)
        prio: int | str | None = int(max_priority) if max_priority and max_priority.strip().isdigit() else max_priority
        r = _call(lambda: c.create_token(label, role, queues=queue or None, max_priority=prio,
                                         allow_protected=allow_protected))
        if output in (Format.json, Format.yaml):
            render([r], [], output, raw=r)
            return
        _echo(f"created {r['role']} token {r['id']} ({r['name']}; {_policy_text(r.get('policy'))});"
              " it is shown once:", err=True)
        _echo(r["token"])
        return

    try:
        parsed = Role.parse(role)
        policy = TokenPolicy.build(
            queues=queue or None, max_priority=max_priority, allow_protected=allow_protected
        )
    except ValueError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    engine = _local_engine(data_dir, database_url)
    try:
        secret, info = TokenStore(engine).create(name or f"{parsed.label}-{int(time.time())}", parsed, policy)
    except ValueError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    AuditLog(engine).append(
        "config", "cli",
        {"action": "token-create", "token_id": info.id, "name": info.name, "role": parsed.label,
         "policy": policy.to_dict()},
    )
    _echo(f"created {parsed.label} token {info.id} ({info.name}; {_policy_text(policy.to_dict())});"
          " it is shown once:")
    _echo(secret)


@token_app.command("list")
def token_list(
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Tokens (ids, names, roles; never the secrets)."""
    fmt = _fmt(output, as_json)
    if _is_local(local, data_dir, database_url, url, context):
        from mlwe.api.auth import TokenStore

        items = [{"id": t.id, "name": t.name, "role": t.role.label, "created": t.created, "revoked": t.revoked,
                  "subject": t.id, "policy": t.policy.to_dict()}
                 for t in TokenStore(_local_engine(data_dir, database_url)).list()]
    else:
        c = _client(url, token, context)
        items = _call(c.tokens)
    render(items, _TOKEN_COLUMNS, fmt, raw=items, empty="no tokens")


def _policy_text(d: dict[str, Any] | None) -> str:
    """A token's admission policy in words (``TokenPolicy.to_dict()`` or the API's)."""
    if not d:
        return "any queue, any priority, protected allowed"
    queues = ",".join(d["queues"]) if d.get("queues") is not None else "any"
    prio = d.get("max_priority_class") or "any"
    return f"queues {queues}; priority up to {prio}; protected {'yes' if d.get('allow_protected', True) else 'no'}"


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="token id (from mlwe token list)")],
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Revoke a token (a running server stops accepting it within seconds)."""
    if not _is_local(local, data_dir, database_url, url, context):
        c = _client(url, token, context)
        _echo(_call(lambda: c.revoke_token(token_id))["message"])
        return
    from mlwe.api.auth import TokenStore

    if not TokenStore(_local_engine(data_dir, database_url)).revoke(token_id):
        _echo(f"error: no token {token_id!r}", err=True)
        raise typer.Exit(1)
    _echo(f"revoked {token_id}")


@audit_app.command("verify")
def audit_verify(
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Check the hash chain; name the first record that does not fit."""
    if _is_local(local, data_dir, database_url, url, context):
        from mlwe.store.audit import AuditLog

        v = AuditLog(_local_engine(data_dir, database_url)).verify()
        r = {"ok": v.ok, "checked": v.checked, "first_bad_seq": v.first_bad_seq, "reason": v.reason,
             "head_hash": v.head_hash}
    else:
        c = _client(url, token, context)
        r = _call(c.verify_audit)
    if r["ok"]:
        _echo(f"audit chain ok: {r['checked']} records, head {str(r['head_hash'])[:16]}")
        return
    _echo(f"audit chain BROKEN at record {r['first_bad_seq']}: {r['reason']}"
          f" ({r['checked']} records verified before it)", err=True)
    raise typer.Exit(1)


_NOISE = frozenset({"seq", "time", "version", "inputs_digest", "cause_id", "kind", "workload", "policy",
                    "candidates", "extra", "hash", "prev_hash"})


def _what(p: Mapping[str, Any]) -> str:
    """An audit payload in one readable line: a decision's choice and first reason, else its
    action (or event, outcome) and its other plain facts."""
    reasons = p.get("reasons")
    if p.get("chosen"):
        first = reasons[0] if isinstance(reasons, list) and reasons else ""
        return f"{cell(p['chosen'])}" + (f" ({cell(first)})" if first else "")
    head = p.get("action") or p.get("outcome") or p.get("event") or p.get("type") or ""
    rest = {k: v for k, v in p.items() if k not in _NOISE and k not in ("action", "outcome", "event", "type")
            and v not in (None, "", [], {}) and not isinstance(v, dict)}
    return (f"{head} " if head else "") + " ".join(f"{k}={cell(v)}" for k, v in sorted(rest.items())[:8])


@audit_app.command("show")
def audit_show(
    workload: Annotated[str | None, typer.Option("--workload", "-W", help="records about this workload")] = None,
    correlation: Annotated[str | None, typer.Option("--correlation", "-c", help="records with this correlation id")] = None,
    kind: Annotated[str | None, typer.Option("--kind", "-k", help="records of this kind")] = None,
    limit: Annotated[int, typer.Option("--limit", "-l", min=1, max=2000)] = 50,
    local: Local = False,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
    output: Output = Format.table,
    as_json: AsJson = False,
) -> None:
    """Why: the audit records of a workload, of one correlation id, or the latest."""
    if as_json:
        output = Format.json
    if _is_local(local, data_dir, database_url, url, context):
        from mlwe.store.audit import AuditLog

        if workload is None and correlation is None and kind is None:
            _echo("give --workload ID, --correlation ID or --kind KIND", err=True)
            raise typer.Exit(2)
        entries = AuditLog(_local_engine(data_dir, database_url)).show(
            workload=workload, correlation_id=correlation, kind=kind, limit=limit
        )
        items = [{"seq": e.seq, "time": e.time, "kind": e.kind, "actor": e.actor, "workload": e.workload,
                  "correlation_id": e.correlation_id, "payload": e.data()} for e in entries]
    else:
        c = _client(url, token, context)
        items = _call(lambda: c.audit(workload=workload, correlation_id=correlation, kind=kind, limit=limit))
    if as_json:  # one record a line, as before
        for x in items:
            print(json.dumps(x, sort_keys=True))
        if not items:
            _echo("no audit records match", err=True)
        return
    render(items, [
        Column("SEQ", lambda e: e["seq"]),
        Column("TIME", lambda e: rfc3339(e["time"])),
        Column("KIND", lambda e: e["kind"]),
        Column("ACTOR", lambda e: e["actor"]),
        Column("WORKLOAD", lambda e: e.get("workload")),
        Column("CORRELATION", lambda e: e.get("correlation_id"), wide=True),
        Column("WHAT", lambda e: _what(e.get("payload") or {})),
    ], output, raw=items, name=lambda e: str(e["seq"]), empty="no audit records match")


# ==================================================================== contexts
@config_app.command("set-context")
def config_set_context(
    name: Annotated[str, typer.Argument(help="context name")],
    url: Annotated[str, typer.Option("--url", "-u", help="server URL")],
    token: Annotated[str | None, typer.Option("--token", "-t", help="bearer token (stored in the file, mode 0600)")] = None,
    use: Annotated[bool, typer.Option("--use", help="also make it the current context")] = False,
) -> None:
    """Add or change a context (URL and token of one server)."""
    from mlwe import clientconfig

    data = _config(clientconfig.load)
    data["contexts"][name] = {"url": url.rstrip("/"), **({"token": token} if token else {})}
    if use or not data.get("current-context"):
        data["current-context"] = name
    path = clientconfig.save(data)
    _echo(f"context {name} saved in {path}" + (" (current)" if data["current-context"] == name else ""))


@config_app.command("use-context")
def config_use_context(name: Annotated[str, typer.Argument(help="context name")]) -> None:
    """Make a context the current one."""
    from mlwe import clientconfig

    data = _config(clientconfig.load)
    if name not in data["contexts"]:
        _echo(f"error: no context {name!r} (known: {', '.join(sorted(data['contexts'])) or 'none'})", err=True)
        raise typer.Exit(1)
    data["current-context"] = name
    clientconfig.save(data)
    _echo(f"current context: {name}")


@config_app.command("get-contexts")
def config_get_contexts(output: Output = Format.table) -> None:
    """The contexts (tokens are not printed)."""
    from mlwe import clientconfig

    data = _config(clientconfig.load)
    items = [{"name": k, "url": v["url"], "token": "set" if v.get("token") else None,
              "current": k == data.get("current-context")} for k, v in sorted(data["contexts"].items())]
    render(items, [Column("CURRENT", lambda x: "*" if x["current"] else ""), Column("NAME", lambda x: x["name"]),
                   Column("URL", lambda x: x["url"]), Column("TOKEN", lambda x: x["token"])],
           output, raw=items, name=lambda x: str(x["name"]), empty=f"no contexts in {clientconfig.config_path()}")


@config_app.command("current-context")
def config_current_context() -> None:
    """The current context's name."""
    from mlwe import clientconfig

    current = _config(clientconfig.load).get("current-context")
    if not current:
        _echo("no current context", err=True)
        raise typer.Exit(1)
    _echo(str(current))


def _config(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    from mlwe.clientconfig import ConfigError

    try:
        return fn()
    except ConfigError as exc:
        _echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


# ------------------------------------------------------------ the agent, via the API
def agent_status_cmd(
    url: Url = None, token: Token = None, context: CtxName = None,
    output: Output = Format.table, as_json: AsJson = False,
) -> None:
    """The running agent's mode and status."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    r = _call(lambda: c.agent())
    if fmt in (Format.json, Format.yaml, Format.name):
        render([{"id": r.get("mode")}], [], fmt, raw=r)
        return
    if not r.get("present"):
        _echo("no agent runs in this engine")
        return
    d = r.get("detail") or {}
    fields([("Mode", r["mode"]), ("Reasoner", r["reasoner"]), ("Awaiting approval", r["pending_approvals"]),
            ("Ticks", d.get("ticks")), ("Analyses", d.get("analyses"))])
    outcomes = d.get("recent_outcomes") or []
    if outcomes:
        _echo("Recent outcomes:")
        render(outcomes, [Column("CORRELATION", lambda o: o.get("correlation_id")),
                          Column("FINDING", lambda o: o.get("finding")),
                          Column("OUTCOME", lambda o: o.get("outcome")),
                          Column("PLAN", lambda o: o.get("plan")),
                          Column("REASONS", lambda o: o.get("reasons"))], Format.table)


def agent_mode_cmd(
    mode: Annotated[str, typer.Argument(help="autonomous, approve or observe")],
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Set the agent's mode (audited as a configuration change)."""
    c = _client(url, token, context)
    r = _call(lambda: c.set_agent_mode(mode))
    _echo(f"agent mode: {r.get('mode')}")


def agent_pending_cmd(
    url: Url = None, token: Token = None, context: CtxName = None,
    output: Output = Format.table, as_json: AsJson = False,
) -> None:
    """Plans waiting for an operator's approval (approve mode)."""
    fmt = _fmt(output, as_json)
    c = _client(url, token, context)
    items = _call(lambda: c.approvals())
    render(items, [Column("ID", lambda a: a["id"]), Column("AGE", lambda a: age(a.get("time"))),
                   Column("CORRELATION", lambda a: a.get("correlation_id"), wide=True),
                   Column("SUMMARY", lambda a: a.get("summary"))],
           fmt, raw=items, empty="no plan waits for approval")


def agent_approve_cmd(
    approval_id: Annotated[str, typer.Argument(help="id from `mlwe agent pending`")],
    comment: Annotated[str, typer.Option("--comment", "-m", help="recorded in the audit log")] = "",
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Approve a pending plan: it is re-forecast and proposed to the control plane, which
    verifies it. Exits 1 when the plan was not committed (stale, no longer better, refused)."""
    c = _client(url, token, context)
    r = _call(lambda: c.decide(approval_id, True, comment))
    _echo(str(r.get("message", "")))
    for rej in r.get("rejections", []):
        _echo(f"  rejected: {rej}")
    if not r.get("accepted"):
        raise typer.Exit(1)


def agent_reject_cmd(
    approval_id: Annotated[str, typer.Argument(help="id from `mlwe agent pending`")],
    comment: Annotated[str, typer.Option("--comment", "-m", help="why (recorded in the audit log)")] = "",
    url: Url = None,
    token: Token = None,
    context: CtxName = None,
) -> None:
    """Reject a pending plan."""
    c = _client(url, token, context)
    r = _call(lambda: c.decide(approval_id, False, comment))
    _echo(str(r.get("message", "")))


def register_agent(agent_app: typer.Typer) -> None:
    """Add the agent commands that talk to a running server to ``mlwe agent``."""
    agent_app.command("status")(agent_status_cmd)
    agent_app.command("mode")(agent_mode_cmd)
    agent_app.command("pending")(agent_pending_cmd)
    agent_app.command("approve")(agent_approve_cmd)
    agent_app.command("reject")(agent_reject_cmd)


def register(app: typer.Typer) -> None:
    """Add the service commands to the ``mlwe`` app (called once by ``mlwe.cli``)."""
    app.command("serve")(serve_cmd)
    app.command("submit")(submit_cmd)
    app.command("status")(status_cmd)
    app.command("explain")(explain_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("nodes")(nodes_cmd)
    app.command("queues")(queues_cmd)
    app.command("watch")(watch_cmd)
    app.add_typer(token_app, name="token")
    app.add_typer(audit_app, name="audit")
    app.add_typer(config_app, name="config")
