"""How the ``mlwe`` command prints what it reads (``-o table|wide|json|yaml|name``).

Conventions from kubectl: ``table`` is aligned plain-text columns with full
values (no truncation or wrapping, so it pipes into ``grep``, ``awk`` and
files), ``wide`` adds columns, ``json`` / ``yaml`` print what the server
answered, ``name`` prints one id per line. Times are shown as ages ("3m",
"2h5m"), durations likewise, ``None`` as "-", booleans as yes/no.

Imports nothing heavy (YAML only when asked for), so the CLI stays fast.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TextIO


class Format(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"
    name = "name"


@dataclass(frozen=True)
class Column:
    """A column: its header, how to get the cell from an item, and whether only ``wide`` shows it."""

    header: str
    get: Callable[[Mapping[str, Any]], Any]
    wide: bool = False


def duration(seconds: float | None) -> str:
    """A duration as kubectl prints ages: 45s, 3m20s, 2h5m, 3d4h; negative as "-3m" (overdue)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    sign = "-" if seconds < 0 else ""
    s = int(abs(seconds))
    if s < 60:
        return f"{sign}{s}s"
    m, s = divmod(s, 60)
    if m < 10:
        return f"{sign}{m}m{s}s" if s else f"{sign}{m}m"
    if m < 60:
        return f"{sign}{m}m"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{sign}{h}h{m}m" if m else f"{sign}{h}h"
    d, h = divmod(h, 24)
    return f"{sign}{d}d{h}h" if h else f"{sign}{d}d"


def age(t: float | None, now: float | None = None) -> str:
    """How long ago an engine-clock time was (``now``: the server's clock when known)."""
    if t is None:
        return "-"
    return duration((time.time() if now is None else now) - t)


def rfc3339(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def cell(v: Any) -> str:
    """A value as a table cell: never a Python repr."""
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list | tuple):
        return ",".join(cell(x) for x in v) or "-"
    if isinstance(v, dict):
        return ",".join(f"{k}={cell(x)}" for k, x in v.items()) or "-"
    return " ".join(str(v).split())  # one line per row, whatever the text holds


def table(rows: Sequence[Sequence[str]], headers: Sequence[str], file: TextIO | None = None) -> None:
    """Aligned columns separated by three spaces (the last one is not padded)."""
    f = file or sys.stdout
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    for r in [list(headers), *rows]:
        line = "   ".join(c.ljust(widths[i]) if i < len(r) - 1 else c for i, c in enumerate(r))
        f.write(line.rstrip() + "\n")


def dump(data: Any, fmt: Format, file: TextIO | None = None) -> None:
    f = file or sys.stdout
    if fmt is Format.yaml:
        import yaml

        f.write(yaml.safe_dump(data, sort_keys=True, allow_unicode=True, default_flow_style=False))
    else:
        f.write(json.dumps(data, sort_keys=True, indent=2 if fmt is Format.json else None) + "\n")


def render(
    items: Iterable[Mapping[str, Any]],
    columns: Sequence[Column],
    fmt: Format,
    *,
    name: Callable[[Mapping[str, Any]], str] = lambda x: str(x.get("id") or x.get("name")),
    raw: Any = None,
    file: TextIO | None = None,
    empty: str | None = None,
) -> None:
    """Print ``items`` in ``fmt``; ``raw`` is what json/yaml print (default: the items)."""
    f = file or sys.stdout
    items = list(items)
    if fmt in (Format.json, Format.yaml):
        dump(items if raw is None else raw, fmt, f)
        return
    if fmt is Format.name:
        for x in items:
            f.write(name(x) + "\n")
        return
    if not items and empty:
        sys.stderr.write(empty + "\n")
        return
    cols = [c for c in columns if fmt is Format.wide or not c.wide]
    table([[cell(c.get(x)) for c in cols] for x in items], [c.header for c in cols], f)


def fields(pairs: Sequence[tuple[str, Any]], file: TextIO | None = None) -> None:
    """``Key:   value`` lines for one object (kubectl describe style)."""
    f = file or sys.stdout
    width = max((len(k) for k, _ in pairs), default=0) + 1
    for k, v in pairs:
        f.write(f"{(k + ':').ljust(width)}  {cell(v)}\n")
