"""The engine's logs: levels, text or JSON lines, and the correlation id of the request.

``configure_logging("json", "info")`` makes every record one JSON object per
line on stderr (``time`` in RFC 3339 UTC, ``level``, ``logger``, ``message``,
and the record's structured fields: ``correlation_id``, ``workload``,
``decision``...), the form log shippers (Loki, Elasticsearch, CloudWatch)
read without parsing rules. ``"text"`` is the same on one readable line.

The correlation id of the HTTP request being served lives in a context
variable (:data:`correlation_id`), set by the API's access-log middleware, so
any log line written while serving it carries the id without passing it down.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any, TextIO

#: the correlation id of the request (or event) being handled, if any
correlation_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("mlwe_correlation_id", default=None)

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
# what a LogRecord holds of its own; everything else was passed in ``extra=``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName",
    "color_message",  # uvicorn's terminal-coloured copy of the message
}


class LogConfigError(ValueError):
    pass


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of a record: its ``extra=`` values and the request's correlation id."""
    out = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
    cid = correlation_id.get()
    if cid is not None:
        out.setdefault("correlation_id", cid)
    return out


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(fields_of(record))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, sort_keys=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in fields_of(record).items())
        line = f"{_rfc3339(record.created)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a test runner or a
    daemoniser may swap it), as :data:`logging.lastResort` does."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr


def configure_logging(fmt: str = "text", level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """One handler on the root logger (replacing any earlier one of ours); uvicorn's loggers
    propagate to it, so its lines have the same form."""
    if fmt not in FORMATS:
        raise LogConfigError(f"log format {fmt!r}: use {' or '.join(FORMATS)}")
    if level.lower() not in LEVELS:
        raise LogConfigError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    handler: logging.Handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler._mlwe = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_mlwe", False):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # mlwe.access writes the access log
    if level.lower() != "debug":  # schema-migration chatter at every start
        logging.getLogger("alembic").setLevel(logging.WARNING)
    return handler
