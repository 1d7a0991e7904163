"""Replay reports: ``metrics.json``, ``report.md`` and PNG plots, and the console table.

``metrics.json`` is canonical and reproducible: ``json.dumps(sort_keys=True,
indent=2)`` of ``{policy: metrics}`` plus a final newline (exactly
:func:`metrics_json`), byte-identical for the same trace, policies and seed.
It therefore leaves out what the wall clock measures (:data:`WALL_CLOCK_KEYS`:
``wall_s``, ``events_per_s``); those are printed in ``report.md`` under "Run
timing", which is not reproducible byte for byte. Plots are drawn with
matplotlib's object API on the Agg canvas (no display, no global pyplot state).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlwe.core.extras import missing_extra
from mlwe.core.spec import DEFAULT_PRIORITY_CLASSES
from mlwe.sim.baselines import POLICY_SEMANTICS
from mlwe.sim.metrics import Sample

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mlwe.sim.replay import ReplayResult

#: Metrics measured on the wall clock: never in metrics.json (they differ run to run).
WALL_CLOCK_KEYS: frozenset[str] = frozenset({"wall_s", "events_per_s", "jobs_per_s"})

METRICS_FILE = "metrics.json"
REPORT_FILE = "report.md"
PLOT_FILES = ("jct_cdf.png", "gpu_util.png", "queue_length.png", "fragmentation.png",
              "deadlines.png")

_PRIORITY_NAMES = {v: k for k, v in DEFAULT_PRIORITY_CLASSES.items()}


# ------------------------------------------------------------------ formatting
def _dur(x: Any) -> str:
    if x is None:
        return "-"
    s = float(x)
    if abs(s) < 120:
        return f"{s:.1f} s"
    if abs(s) < 7200:
        return f"{s / 60:.1f} min"
    if abs(s) < 2 * 86400:
        return f"{s / 3600:.2f} h"
    return f"{s / 86400:.2f} d"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}%"


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.3f}".rstrip("0").rstrip(".")
    return f"{x:,}" if isinstance(x, int) else str(x)


def _completed(m: dict[str, Any]) -> str:
    return f"{m.get('completed', 0):,}/{m.get('jobs', 0):,}"


def _deadlines(m: dict[str, Any]) -> str:
    n = m.get("deadline_jobs") or 0
    if not n:
        return "-"
    met = m.get("deadline_met")
    ratio = _pct(m.get("deadline_met_ratio"))
    return ratio if met is None else f"{ratio} ({met}/{n})"


def _invariants(m: dict[str, Any]) -> str:
    return "on" if m.get("invariants") == "on" else "OFF"


#: The comparison table: (row label, how to show it from one policy's metrics).
TABLE_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("completed / jobs", _completed),
    ("avg JCT", lambda m: _dur(m.get("avg_jct_s"))),
    ("median JCT", lambda m: _dur(m.get("median_jct_s"))),
    ("p99 JCT", lambda m: _dur(m.get("p99_jct_s"))),
    ("bounded slowdown avg / p99 / max", lambda m: "-" if m.get("avg_bounded_slowdown") is None
     else f"{_num(m.get('avg_bounded_slowdown'))} / {_num(m.get('p99_bounded_slowdown'))}"
     f" / {_num(m.get('max_bounded_slowdown'))}"),
    ("avg queueing delay", lambda m: _dur(m.get("avg_queue_delay_s"))),
    ("p99 queueing delay", lambda m: _dur(m.get("p99_queue_delay_s"))),
    ("makespan", lambda m: _dur(m.get("makespan_s"))),
    ("GPU utilisation", lambda m: _pct(m.get("gpu_util"))),
    ("free GPUs unusable (avg)", lambda m: _pct(m.get("fragmentation_avg"))),
    ("free GPUs too few on node", lambda m: _pct(m.get("fragmentation_by_size_avg"))),
    ("deadlines met", _deadlines),
    ("preemptions", lambda m: _num(m.get("preemptions"))),
    ("GPU-hours lost to preemption", lambda m: _num(m.get("gpu_hours_lost_to_preemption"))),
    ("max queueing delay", lambda m: _dur(m.get("max_queue_delay_s"))),
    ("estimate error p50 / p90", lambda m: "-" if m.get("estimate_p50_rel_error") is None
     else f"{_pct(m.get('estimate_p50_rel_error'))} / {_pct(m.get('estimate_p90_rel_error'))}"),
    ("estimate coverage", lambda m: _pct(m.get("estimate_coverage"))),
    ("checkpoint model", lambda m: str(m.get("checkpoint_model") or "-")),
    ("queue fairness (Jain)", lambda m: _num(m.get("queue_fairness_jain"))),
    ("invariant checks", _invariants),
)


def _cells(results: Sequence[ReplayResult]) -> list[list[str]]:
    rows = [["metric", *[r.policy for r in results]]]
    for label, show in TABLE_ROWS:
        rows.append([label, *[show(r.metrics) for r in results]])
    return rows


def format_table(results: Sequence[ReplayResult]) -> str:
    """The key metrics of each policy as a plain-text table (metrics down, policies across)."""
    if not results:
        return "(no results)"
    rows = _cells(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    out = [f"trace: {results[0].trace}", line(rows[0]), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows[1:]]
    return "\n".join(out)


def _markdown_table(rows: list[list[str]], right_from: int = 1) -> list[str]:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    head = "| " + " | ".join(esc(c) for c in rows[0]) + " |"
    rule = "|" + "|".join(
        "---:" if i >= right_from else "---" for i in range(len(rows[0]))
    ) + "|"
    return [head, rule, *["| " + " | ".join(esc(c) for c in row) + " |" for row in rows[1:]]]


# ------------------------------------------------------------------ metrics.json
def _check(results: Sequence[ReplayResult]) -> None:
    if not results:
        raise ValueError("no replay results to report")
    traces = sorted({r.trace for r in results})
    if len(traces) > 1:
        raise ValueError(f"one report covers one trace; got {', '.join(traces)}")
    seen: set[str] = set()
    for r in results:
        if r.policy in seen:
            raise ValueError(f"policy {r.policy!r} appears twice; metrics.json is keyed by policy")
        seen.add(r.policy)


def metrics_json(results: Sequence[ReplayResult]) -> str:
    """The exact text of ``metrics.json``: reproducible metrics only (no wall clock)."""
    _check(results)
    payload = {
        r.policy: {k: v for k, v in r.metrics.items() if k not in WALL_CLOCK_KEYS}
        for r in results
    }
    return json.dumps(payload, sort_keys=True, indent=2) + "\n"


# ---------------------------------------------------------------------- samples
def samples_of(result: ReplayResult) -> list[Sample]:
    """The periodic samples of a replay (rich ones when its metrics kept them)."""
    rich = getattr(result.series, "samples", None)
    if rich is not None:
        return list(rich)
    total = _total_gpus(result)
    return [
        Sample(t, a, a / total if total else 0.0, q, 0, 0.0, 0.0, 0, 0, None, 0)
        for t, a, q in result.series
    ]


def _total_gpus(result: ReplayResult) -> float:
    return sum(i.gpu_count for i in result.cp.capacity.nodes())


def _cluster_lines(result: ReplayResult) -> list[str]:
    groups: dict[tuple[str, int], int] = {}
    cpu_only = 0
    for info in result.cp.capacity.nodes():
        if info.gpu_model is None:
            cpu_only += 1
        else:
            key = (info.gpu_model, info.gpu_count)
            groups[key] = groups.get(key, 0) + 1
    nodes = sum(groups.values()) + cpu_only
    gpus = sum(n * g for (_, g), n in groups.items())
    parts = [f"{n} x {g} {m}" for (m, g), n in sorted(groups.items())]
    if cpu_only:
        parts.append(f"{cpu_only} CPU-only")
    return [f"- Cluster: {nodes:,} nodes, {gpus:,} GPUs ({', '.join(parts) or 'empty'})"]


def _priority_label(p: str) -> str:
    try:
        name = _PRIORITY_NAMES.get(int(p))
    except ValueError:
        name = None
    return f"{name} ({p})" if name else p


# ------------------------------------------------------------------------ plots
def require_plotting() -> None:
    """Raise :class:`~mlwe.core.extras.MissingExtra` naming ``mlwe[reports]`` when
    matplotlib is not installed (the CLI calls it before a long replay, not after)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise missing_extra("reports", exc) from exc


def _new_figure(height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(9, height), dpi=100, layout="constrained")


def _save(fig: Figure, path: Path) -> Path:
    # no Software tag: the same matplotlib draws the same bytes on every run
    fig.savefig(path, format="png", metadata={"Software": None})
    return path


def _color(i: int) -> str:
    return f"C{i % 10}"


def _hours_axis(results: Sequence[ReplayResult]) -> tuple[list[list[Sample]], float]:
    per = [samples_of(r) for r in results]
    t0 = min((s[0].t for s in per if s), default=0.0)
    return per, t0


def _plot_jct_cdf(results: Sequence[ReplayResult], path: Path) -> Path:
    fig = _new_figure()
    ax = fig.add_subplot()
    for i, r in enumerate(results):
        xs = sorted(j / 3600 for j in r.jcts if j > 0)
        if not xs:
            continue
        n = len(xs)
        ax.step(xs, [(k + 1) / n for k in range(n)], where="post", color=_color(i),
                label=f"{r.policy} ({n:,} jobs)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of completed jobs")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"JCT CDF: {results[0].trace}")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")


def _plot_over_time(
    results: Sequence[ReplayResult],
    path: Path,
    panels: Sequence[tuple[str, Callable[[Sample], float | None]]],
    title: str,
) -> Path:
    per, t0 = _hours_axis(results)
    fig = _new_figure(3.2 * len(panels) + 0.6)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, value) in zip(axes, panels):
        for i, (r, samples) in enumerate(zip(results, per)):
            xs = [(s.t - t0) / 3600 for s in samples]
            ys = [math.nan if (v := value(s)) is None else v for s in samples]
            ax.plot(xs, ys, color=_color(i), linewidth=0.9, label=r.policy)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("simulated time since the first submission (hours)")
    axes[0].set_title(title)
    _legend(axes[0])
    return _save(fig, path)


def _plot_deadlines(results: Sequence[ReplayResult], path: Path) -> Path:
    fig = _new_figure()
    ax = fig.add_subplot()
    names = [r.policy for r in results]
    met: list[int] = []
    late: list[int] = []
    unfinished: list[int] = []
    for r in results:
        totals = {"met": 0, "late": 0, "unfinished": 0}
        for o in (r.metrics.get("deadline_outcomes_by_priority") or {}).values():
            for k in totals:
                totals[k] += int(o.get(k, 0))
        met.append(totals["met"])
        late.append(totals["late"])
        unfinished.append(totals["unfinished"])
    xs = list(range(len(names)))
    ax.bar(xs, met, color="tab:green", label="met")
    ax.bar(xs, late, bottom=met, color="tab:orange", label="missed: finished late")
    ax.bar(xs, unfinished, bottom=[a + b for a, b in zip(met, late)], color="tab:red",
           label="missed: not finished")
    ax.set_xticks(xs, names)
    top = max((a + b + c for a, b, c in zip(met, late, unfinished)), default=0)
    ax.set_ylim(0, max(1, top) * 1.3)  # room for the legend above the bars
    ax.set_ylabel("jobs with a deadline")
    ax.set_title(f"Deadline outcomes: {results[0].trace}")
    ax.grid(True, axis="y", alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def _has_deadlines(results: Sequence[ReplayResult]) -> bool:
    return any((r.metrics.get("deadline_jobs") or 0) > 0 for r in results)


def _has_fragmentation(results: Sequence[ReplayResult]) -> bool:
    return any(s.fragmentation is not None for r in results for s in samples_of(r))


def write_plots(results: Sequence[ReplayResult], out_dir: Path) -> list[Path]:
    """The PNG plots (deadline outcomes only when the trace has deadlines)."""
    _check(results)
    require_plotting()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _plot_jct_cdf(results, out_dir / "jct_cdf.png"),
        _plot_over_time(
            results, out_dir / "gpu_util.png",
            [("GPU utilisation (%)", lambda s: 100 * s.gpu_util)],
            f"GPU utilisation over time (mean per sample window): {results[0].trace}",
        ),
        _plot_over_time(
            results, out_dir / "queue_length.png",
            [("waiting workloads", lambda s: s.queued),
             ("mean wait of waiting\nworkloads (hours)", lambda s: s.queue_delay_avg_s / 3600)],
            f"Queue over time: {results[0].trace}",
        ),
    ]
    if _has_fragmentation(results):
        paths.append(_plot_over_time(
            results, out_dir / "fragmentation.png",
            [("free GPUs unusable (%)",
              lambda s: None if s.fragmentation is None else 100 * s.fragmentation),
             ("free GPUs unusable\n(count)", lambda s: s.unusable_gpus if s.queued_gpu else None),
             ("of which too few\non node (count)",
              lambda s: s.unusable_by_size_gpus if s.queued_gpu else None)],
            f"GPU fragmentation while GPU work waited: {results[0].trace}",
        ))
    if _has_deadlines(results):
        paths.append(_plot_deadlines(results, out_dir / "deadlines.png"))
    return paths


def _policy_lines(results: Sequence[ReplayResult]) -> list[str]:
    """Each policy: what it does, its placement, checkpoint model and runtime estimates."""
    lines: list[str] = []
    for r in results:
        sem = r.metrics.get("policy_semantics") or POLICY_SEMANTICS.get(r.policy, "")
        lines += [f"### {r.policy}", "", " ".join(sem.split()) or "(no description)", ""]
        extra = []
        if r.metrics.get("placement"):
            extra.append(f"- Placement: {r.metrics['placement']}")
        if r.metrics.get("checkpoint_semantics"):
            extra.append(
                f"- Checkpoint model `{r.metrics.get('checkpoint_model')}`:"
                f" {r.metrics['checkpoint_semantics']}"
            )
        est = r.metrics.get("estimator")
        if est:
            extra.append(f"- Runtime estimates: {est}")
        if extra:
            lines += [*extra, ""]
    return lines


def _deadline_lines(results: Sequence[ReplayResult]) -> list[str]:
    """Deadlines met, late and unfinished per policy and priority class (or that there are none)."""
    lines: list[str] = []
    if _has_deadlines(results):
        rows = [["policy", "priority class", "jobs", "met", "late", "unfinished", "met %"]]
        for r in results:
            outcomes = r.metrics.get("deadline_outcomes_by_priority") or {}
            for p, o in sorted(outcomes.items(), key=lambda kv: int(kv[0])):
                n = o["met"] + o["late"] + o["unfinished"]
                rows.append([r.policy, _priority_label(p), str(n), str(o["met"]), str(o["late"]),
                             str(o["unfinished"]), _pct(o["met"] / n if n else None)])
        lines += [
            *_markdown_table(rows, right_from=2), "",
            "late: succeeded after its deadline; unfinished: had not succeeded when the replay "
            "ended (still waiting or running, failed or cancelled).", "",
        ]
    else:
        lines += ["The trace has no deadlines.", ""]
    return lines


# ---------------------------------------------------------------------- report.md
def _report_md(results: Sequence[ReplayResult], plots: Sequence[Path]) -> str:
    first = results[0]
    m0 = first.metrics
    lines = [f"# Replay report: {first.trace}", ""]
    off = [r.policy for r in results if r.metrics.get("invariants") != "on"]
    if off:
        lines += [
            f"> **WARNING: INVARIANT CHECKS WERE OFF for {', '.join(off)}.** Those runs were "
            "for profiling only: the control plane did not verify its state after each batch, "
            "so their numbers are not checked results.",
            "",
        ]
    seeds = sorted({str(r.metrics.get("seed")) for r in results})
    lines += [
        "## Trace and cluster",
        "",
        f"- Trace: `{first.trace}`, {m0.get('jobs', 0):,} jobs replayed, "
        f"{m0.get('skipped_rows', 0):,} rows skipped; replay seed {', '.join(seeds)}",
        *_cluster_lines(first),
        f"- Samples every {_dur(m0.get('sample_every_s'))} of simulated time",
        "",
    ]
    notes = list(m0.get("trace_notes") or [])
    lines += ["### Trace notes and assumptions", ""]
    lines += [f"- {n}" for n in notes] or ["- (none)"]
    lines += ["", "## Policies", ""]
    lines += _policy_lines(results)
    lines += ["## Comparison", "", *_markdown_table(_cells(results)), ""]
    lines += [
        "Definitions: JCT = finish - submit of jobs that succeeded; queueing delay = first "
        "start - submit; GPU utilisation = allocated GPU-seconds / (cluster GPUs x span); "
        "free GPUs unusable (GPU fragmentation) = at each sample where GPU work waited, the "
        "share of wholly free GPUs (ready nodes) on nodes with fewer free GPUs than the "
        "smallest waiting request (whole GPUs per replica) among the waiting workloads that "
        "accept the node's GPU model (none accepting it: all its free GPUs are unusable), "
        "averaged over those samples; \"free GPUs too few on node\" counts only nodes whose "
        "model some waiting workload accepts (the packing share); fairness = Jain's index of "
        "mean slowdown per queue; bounded slowdown = max(1, JCT / max(run time, 10 s)) of "
        "each job that succeeded, run time being the work the trace gives it (its tail "
        "shows short jobs left waiting, which a JCT percentile hides among long ones).",
        "",
    ]
    lines += ["## Deadline outcomes by priority class", ""]
    lines += _deadline_lines(results)
    lines += ["## Plots", ""]
    for p in plots:
        lines += [f"![{p.stem}]({p.name})", ""]
    lines += ["## Invariants", ""]
    for r in results:
        state = "on" if r.metrics.get("invariants") == "on" else "**OFF (profiling only)**"
        lines.append(
            f"- {r.policy}: {state}; {r.metrics.get('invariant_checks', 0):,} checks, "
            f"{r.metrics.get('rejected_batches', 0):,} rejected batches"
        )
    lines += [
        "",
        "## Run timing (wall clock: not reproducible, not in metrics.json)",
        "",
        *_markdown_table([["policy", "wall s", "events", "events/s"]] + [
            [r.policy, _num(r.metrics.get("wall_s")), _num(r.metrics.get("events")),
             _num(r.metrics.get("events_per_s"))]
            for r in results
        ]),
        "",
        f"`{METRICS_FILE}` holds every metric above except {', '.join(sorted(WALL_CLOCK_KEYS))}; "
        "it is byte-identical for the same trace, policies and seed.",
        "",
    ]
    return "\n".join(lines)


def write_report(results: list[ReplayResult], out_dir: Path) -> list[Path]:
    """Write ``metrics.json``, ``report.md`` and the plots into ``out_dir``; return their paths.

    Plots this module owns that do not apply to these results (no deadlines, no
    fragmentation samples) are removed, so a reused directory holds no stale ones.
    Without matplotlib (``mlwe[reports]``) it writes nothing and raises ``MissingExtra``.
    """
    _check(results)
    require_plotting()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = out_dir / METRICS_FILE
    metrics_path.write_text(metrics_json(results), encoding="utf-8")
    plots = write_plots(results, out_dir)
    made = {p.name for p in plots}
    for name in PLOT_FILES:
        stale = out_dir / name
        if name not in made and stale.exists():
            stale.unlink()
    report_path = out_dir / REPORT_FILE
    report_path.write_text(_report_md(results, plots), encoding="utf-8")
    return [metrics_path, report_path, *plots]
