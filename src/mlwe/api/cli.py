"""The service's CLI commands, registered on the ``mlwe`` app by ``mlwe.cli``.

``serve`` runs the engine with its API and dashboard; ``submit``, ``status``,
``explain``, ``cancel``, ``nodes`` and ``watch`` talk to a running server
(``--url`` / ``$MLWE_URL``, ``--token`` / ``$MLWE_TOKEN``); ``token create``
writes a token straight into the engine's database (how the first tokens are
made); ``bench api`` measures the API.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

Url = Annotated[str | None, typer.Option("--url", help="server URL; default $MLWE_URL or http://127.0.0.1:8080")]
Token = Annotated[str | None, typer.Option("--token", help="bearer token; default $MLWE_TOKEN")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON")]
DataDir = Annotated[Path | None, typer.Option("--data-dir", help="data directory of the default SQLite store; default $MLWE_DATA_DIR or ./.mlwe")]
DatabaseUrl = Annotated[str | None, typer.Option("--database-url", help="SQLAlchemy URL; default $MLWE_DATABASE_URL or SQLite")]

token_app = typer.Typer(help="API tokens (stored hashed).", no_args_is_help=True)


def _client(url: str | None, token: str | None) -> Any:
    from mlwe.client import Client

    return Client(url, token)


def _fail(exc: Exception) -> typer.Exit:
    from mlwe.client import ClientError

    if isinstance(exc, ClientError):
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
    else:
        err.print(f"error: cannot reach the server: {exc}", markup=False, soft_wrap=True)
    return typer.Exit(1)


def _call(fn: Any) -> Any:
    import httpx

    from mlwe.client import ClientError

    try:
        return fn()
    except (ClientError, httpx.HTTPError) as exc:
        raise _fail(exc) from None


# ====================================================================== serve
def serve_cmd(
    config: Annotated[Path | None, typer.Option("--config", help="config file (YAML, TOML or JSON); default $MLWE_CONFIG")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on [$MLWE_HOST; 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="[$MLWE_PORT; 8080]")] = None,
    backend: Annotated[str | None, typer.Option(help="sim, local or ray [$MLWE_BACKEND; sim]")] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="cluster spec file (nodes, queues); --backend ray needs it unless --ray-address local [$MLWE_CLUSTER]")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Ray cluster HOST:PORT for --backend ray ('local': start one on this machine) [$MLWE_RAY_ADDRESS]")] = None,
    database_url: Annotated[str | None, typer.Option("--database-url", help="SQLAlchemy URL [$MLWE_DATABASE_URL; SQLite in the data dir]")] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="data directory of the default SQLite store [$MLWE_DATA_DIR; ./.mlwe]")] = None,
    bus: Annotated[str | None, typer.Option("--bus", help="event bus URL, e.g. nats://127.0.0.1:4222 [$MLWE_BUS]")] = None,
    generator: Annotated[bool | None, typer.Option("--generator/--no-generator", help="background workloads [$MLWE_GENERATOR; on]")] = None,
    agent: Annotated[bool | None, typer.Option("--agent/--no-agent", help="run the agent loop [$MLWE_AGENT; on]")] = None,
    agent_mode: Annotated[str | None, typer.Option(help="autonomous, approve or observe [$MLWE_AGENT_MODE]")] = None,
    speed: Annotated[float | None, typer.Option(min=0.01, max=1000, help="engine clock speed, sim demos [$MLWE_SPEED; 1]")] = None,
    seed: Annotated[int | None, typer.Option(help="[$MLWE_SEED; 0]")] = None,
    cors_origin: Annotated[list[str] | None, typer.Option("--cors-origin", help="allowed browser origin, repeat [$MLWE_CORS_ORIGINS, comma-separated]")] = None,
    log_level: Annotated[str | None, typer.Option(help="[$MLWE_LOG_LEVEL; info]")] = None,
    show_config: Annotated[bool, typer.Option("--show-config", help="print the effective configuration as JSON and exit")] = False,
) -> None:
    """Run the engine with its REST API and live dashboard.

    Each option may also come from its MLWE_* environment variable or the config
    file (flags win over the environment, the environment over the file)."""
    from mlwe.api.context import ApiSettings
    from mlwe.api.serve import ServeError, serve
    from mlwe.core.extras import MissingExtra
    from mlwe.runtime.settings import ServeSettings, SettingsError
    from mlwe.store.db import SchemaError

    try:
        cfg = ServeSettings.load(
            config=config, host=host, port=port, backend=backend, cluster=cluster,
            ray_address=ray_address, database_url=database_url, data_dir=data_dir, bus=bus,
            generator=generator, agent=agent, agent_mode=agent_mode, speed=speed, seed=seed,
            cors_origins=tuple(cors_origin) if cors_origin else None, log_level=log_level,
        )
    except SettingsError as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if show_config:
        print(json.dumps(cfg.describe(), indent=2, sort_keys=True))
        return
    settings = ApiSettings(cors_origins=cfg.cors_origins)
    try:
        from mlwe.specfile import load_cluster

        serve(
            host=cfg.host,
            port=cfg.port,
            log_level=cfg.log_level,
            backend=cfg.backend,
            cluster=load_cluster(cfg.cluster) if cfg.cluster is not None else None,
            ray_address=cfg.ray_address,
            database_url=cfg.database_url_value(),
            data_dir=cfg.data_dir,
            bus_url=cfg.bus,
            generator=cfg.generator,
            agent=cfg.agent,
            agent_mode=cfg.agent_mode,
            speed=cfg.speed,
            seed=cfg.seed,
            settings=settings,
            print_fn=lambda s: out.print(s, markup=False, soft_wrap=True),
        )
    except (ServeError, SchemaError, ValueError, MissingExtra) as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None


# ============================================================ client commands
def submit_cmd(
    files: Annotated[list[Path], typer.Argument(help="workload spec files (YAML or JSON)")],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Submit workload specs to a running server."""
    c = _client(url, token)
    created: list[str] = []
    for f in files:
        try:
            ids = _call(lambda f=f: c.submit_file(f))
        except OSError as exc:
            err.print(f"error: {f}: {exc}", markup=False)
            raise typer.Exit(1) from None
        created += ids
        if not as_json:
            out.print(f"{f}: submitted {', '.join(ids)}", markup=False)
    if as_json:
        print(json.dumps({"created": created}))


def status_cmd(
    workload: Annotated[str | None, typer.Argument(help="a workload id: its detail")] = None,
    state: Annotated[str | None, typer.Option(help="filter: comma-separated states")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Workloads and their states (or one workload with its history)."""
    c = _client(url, token)
    if workload:
        w = _call(lambda: c.workload(workload))
        if as_json:
            print(json.dumps(w, sort_keys=True))
            return
        out.print(f"{w['id']} ({w['name']}): {w['state']}, priority {w['priority']}, "
                  f"queue {w['queue']}, attempt {w['attempt']}", markup=False)
        for t in w["history"]:
            when = time.strftime("%H:%M:%S", time.localtime(t["time"]))
            out.print(f"  {when}  {t['source'] or '-':>10} -> {t['target']:<10} {t['reason']}", markup=False)
        return
    items = _call(lambda: c.workloads(state=state, limit=limit))
    if as_json:
        print(json.dumps(items, sort_keys=True))
        return
    t = Table(title=f"workloads ({len(items)})")
    for col in ("id", "name", "state", "prio", "gpus", "nodes", "progress", "deadline", "why waiting"):
        t.add_column(col)
    for w in items:
        left = w.get("deadline_left_s")
        t.add_row(
            w["id"], w["name"], w["state"], str(w["priority"]), f"{w['gpus']:g}", ",".join(w["nodes"]),
            f"{w['progress'] * 100:.0f}%", "-" if left is None else f"{left:.0f}s" + (" at risk" if w["deadline_at_risk"] else ""),
            w["pending_reason"][:60],
        )
    out.print(t)


def explain_cmd(
    workload: Annotated[str, typer.Argument(help="workload id")],
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Why is a workload where it is: not placed, preempted, failed?"""
    c = _client(url, token)
    e = _call(lambda: c.explain(workload))
    if as_json:
        print(json.dumps(e, sort_keys=True))
        return
    out.print(e["summary"], markup=False, soft_wrap=True)
    for d in e["decisions"][-10:]:
        out.print(f"  [{d['kind']}] {d['policy']}: {d['chosen']}", markup=False, soft_wrap=True)
        for r in d["reasons"]:
            out.print(f"      - {r}", markup=False, soft_wrap=True)


def cancel_cmd(
    workload: Annotated[str, typer.Argument(help="workload id")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Cancel a workload."""
    c = _client(url, token)
    r = _call(lambda: c.cancel(workload))
    out.print(r["message"], markup=False)


def nodes_cmd(
    action: Annotated[str | None, typer.Argument(help="cordon, uncordon or drain (with a node)")] = None,
    node: Annotated[str | None, typer.Argument(help="node name")] = None,
    reason: Annotated[str, typer.Option(help="why (recorded in the audit log)")] = "",
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """List nodes, or cordon / uncordon / drain one."""
    c = _client(url, token)
    if action is not None:
        if node is None or action not in ("cordon", "uncordon", "drain"):
            err.print("usage: mlwe nodes [cordon|uncordon|drain NODE]")
            raise typer.Exit(2)
        r = _call(lambda: c.node_action(node, action, reason))
        out.print(r["message"], markup=False)
        return
    items = _call(c.nodes)
    if as_json:
        print(json.dumps(items, sort_keys=True))
        return
    t = Table(title=f"nodes ({len(items)})")
    for col in ("node", "status", "gpus", "free gpus", "free cpu", "free ram", "workloads"):
        t.add_column(col)
    for n in items:
        gpus = f"{n['gpus']} x {n['gpu_model']}" if n["gpus"] else "-"
        t.add_row(n["name"], n["status"], gpus, f"{n['free']['gpu'] / 1000:g}", f"{n['free']['cpu'] / 1000:g}",
                  f"{n['free']['ram'] / 1024:.0f}Gi", str(len(n["workloads"])))
    out.print(t)


def watch_cmd(
    topics: Annotated[str, typer.Option(help="comma-separated topics")] = "state,reasoning,audit",
    workload: Annotated[str | None, typer.Option(help="only this workload's events")] = None,
    correlation: Annotated[str | None, typer.Option(help="only this correlation id")] = None,
    count: Annotated[int | None, typer.Option(min=1, help="stop after this many events")] = None,
    url: Url = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Follow the live streams (resumes after a dropped connection)."""
    import httpx

    c = _client(url, token)
    last: int | None = None
    seen = 0
    while True:
        try:
            for ev in c.stream(topics.split(","), last_event_id=last, workload=workload,
                               correlation_id=correlation, notices=True):
                if ev.id is not None:
                    last = ev.id
                if ev.topic in ("hello",):
                    continue
                if as_json:
                    print(json.dumps({"event": ev.topic, **ev.data}), flush=True)
                else:
                    out.print(_line(ev), markup=False, soft_wrap=True)
                if ev.id is not None:
                    seen += 1
                    if count is not None and seen >= count:
                        return
        except httpx.HTTPError as exc:
            err.print(f"stream interrupted ({exc}); reconnecting", markup=False)
            time.sleep(1.0)
        except Exception as exc:
            raise _fail(exc) from None


def _line(ev: Any) -> str:
    d = ev.data
    if ev.id is None:
        return f"-- {ev.topic}: {d.get('message') or d}"
    data = d.get("data", {})
    t = time.strftime("%H:%M:%S", time.localtime(d.get("time", 0)))
    if ev.topic == "state":
        if data.get("type") == "command":
            return f"{t} command  {data.get('command')} {data.get('workload')} attempt {data.get('attempt')}"
        return f"{t} state    {data.get('workload')}: {data.get('from')} -> {data.get('to')} ({data.get('reason')})"
    if ev.topic == "audit":
        p = data.get("payload", {})
        what = p.get("chosen") or p.get("action") or p.get("event") or ""
        return f"{t} audit    #{data.get('seq')} {data.get('kind')} by {data.get('actor')}: {d.get('workload') or ''} {what}"
    if ev.topic == "reasoning":
        return f"{t} reason   [{data.get('source', 'agent')}] {data.get('title') or data.get('summary') or ''}: {data.get('choice') or ''}"
    return f"{t} {ev.topic:<8} {d.get('workload') or ''} {data}"


# ===================================================================== tokens
@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="viewer, submitter, operator or admin")],
    name: Annotated[str | None, typer.Option(help="a name for the token (who holds it)")] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Create a token in the engine's database; prints it once (only its hash is stored)."""
    from mlwe.api.auth import Role, TokenStore
    from mlwe.store.audit import AuditLog
    from mlwe.store.db import SchemaError, check_schema, make_engine
    from mlwe.store.db import database_url as resolve

    try:
        r = Role.parse(role)
    except ValueError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    engine = make_engine(resolve(data_dir=data_dir, url=database_url))
    try:
        check_schema(engine)
    except SchemaError as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    try:
        token, info = TokenStore(engine).create(name or f"{r.label}-{int(time.time())}", r)
    except ValueError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    AuditLog(engine).append(
        "config", "cli", {"action": "token-create", "token_id": info.id, "name": info.name, "role": r.label}
    )
    out.print(f"created {r.label} token {info.id} ({info.name}); it is shown once:", markup=False)
    print(token)


@token_app.command("list")
def token_list(data_dir: DataDir = None, database_url: DatabaseUrl = None, as_json: AsJson = False) -> None:
    """Tokens in the engine's database (ids, names, roles; never the secrets)."""
    from mlwe.api.auth import TokenStore
    from mlwe.store.db import database_url as resolve
    from mlwe.store.db import make_engine

    items = TokenStore(make_engine(resolve(data_dir=data_dir, url=database_url))).list()
    if as_json:
        print(json.dumps([{"id": t.id, "name": t.name, "role": t.role.label, "created": t.created,
                           "revoked": t.revoked} for t in items]))
        return
    for t in items:
        out.print(f"{t.id}  {t.role.label:<9} {t.name}{'  (revoked)' if t.revoked else ''}", markup=False)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="token id (from mlwe token list)")],
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke a token (a running server stops accepting it within seconds)."""
    from mlwe.api.auth import TokenStore
    from mlwe.store.db import database_url as resolve
    from mlwe.store.db import make_engine

    if not TokenStore(make_engine(resolve(data_dir=data_dir, url=database_url))).revoke(token_id):
        err.print(f"error: no token {token_id!r}")
        raise typer.Exit(1)
    out.print(f"revoked {token_id}")


# ====================================================================== bench
def bench_api_cmd(
    submits: Annotated[int, typer.Option(min=10, help="submissions to time")] = 2000,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="concurrent HTTP clients")] = 32,
    clients: Annotated[int, typer.Option(min=1, max=2000, help="SSE clients")] = 200,
    rate: Annotated[float, typer.Option(min=1, help="events per second published")] = 20.0,
    seconds: Annotated[float, typer.Option(min=1, help="SSE measurement time")] = 10.0,
    as_json: AsJson = False,
) -> None:
    """HTTP submissions per second, and SSE delivery lag with many stream clients."""
    from mlwe.api.bench import bench_api

    result = bench_api(submits=submits, concurrency=concurrency, sse_clients=clients,
                       events_per_s=rate, sse_seconds=seconds, verbose=not as_json)
    print(json.dumps(result, sort_keys=True) if as_json else result)


# ------------------------------------------------------------ the agent, via the API
agent_remote = typer.Typer(help="(through a running server)")


def agent_status_cmd(url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """The running agent's mode and status."""
    c = _client(url, token)
    r = _call(lambda: c.agent())
    print(json.dumps(r, indent=2, sort_keys=True, default=str) if as_json else
          "  ".join(f"{k}: {v}" for k, v in r.items() if not isinstance(v, dict | list)))


def agent_mode_cmd(
    mode: Annotated[str, typer.Argument(help="autonomous, approve or observe")],
    url: Url = None,
    token: Token = None,
) -> None:
    """Set the agent's mode (audited as a configuration change)."""
    c = _client(url, token)
    r = _call(lambda: c.set_agent_mode(mode))
    out.print(f"agent mode: {r.get('mode')}", markup=False)


def agent_pending_cmd(url: Url = None, token: Token = None, as_json: AsJson = False) -> None:
    """Plans waiting for an operator's approval (approve mode)."""
    c = _client(url, token)
    items = _call(lambda: c.approvals())
    if as_json:
        print(json.dumps(items, indent=2, sort_keys=True, default=str))
        return
    if not items:
        out.print("no plan waits for approval")
    for a in items:
        out.print(f"{a['id']}  {a.get('summary', '')}", markup=False, soft_wrap=True)


def agent_approve_cmd(
    approval_id: Annotated[str, typer.Argument(help="id from `mlwe agent pending`")],
    comment: Annotated[str, typer.Option(help="recorded in the audit log")] = "",
    url: Url = None,
    token: Token = None,
) -> None:
    """Approve a pending plan: it is proposed to the control plane, which verifies it."""
    c = _client(url, token)
    r = _call(lambda: c.decide(approval_id, True, comment))
    out.print(r.get("message", r), markup=False, soft_wrap=True)
    for rej in r.get("rejections", []):
        out.print(f"  rejected: {rej}", markup=False, soft_wrap=True)


def agent_reject_cmd(
    approval_id: Annotated[str, typer.Argument(help="id from `mlwe agent pending`")],
    comment: Annotated[str, typer.Option(help="why (recorded in the audit log)")] = "",
    url: Url = None,
    token: Token = None,
) -> None:
    """Reject a pending plan."""
    c = _client(url, token)
    r = _call(lambda: c.decide(approval_id, False, comment))
    out.print(r.get("message", r), markup=False, soft_wrap=True)


def register_agent(agent_app: typer.Typer) -> None:
    """Add the agent commands that talk to a running server to ``mlwe agent``."""
    agent_app.command("status")(agent_status_cmd)
    agent_app.command("mode")(agent_mode_cmd)
    agent_app.command("pending")(agent_pending_cmd)
    agent_app.command("approve")(agent_approve_cmd)
    agent_app.command("reject")(agent_reject_cmd)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add the service commands to the ``mlwe`` app (called once by ``mlwe.cli``)."""
    app.command("serve")(serve_cmd)
    app.command("submit")(submit_cmd)
    app.command("status")(status_cmd)
    app.command("explain")(explain_cmd)
    app.command("cancel")(cancel_cmd)
    app.command("nodes")(nodes_cmd)
    app.command("watch")(watch_cmd)
    app.add_typer(token_app, name="token")
    bench_app.command("api")(bench_api_cmd)
