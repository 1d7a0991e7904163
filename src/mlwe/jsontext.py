"""Strict JSON for what clients send (specs, bus messages, proposals).

Python's ``json`` accepts ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON at
all) and fails with a bare ``ValueError`` on an integer past the interpreter's
digit limit; either would reach the engine as a number no field can hold, or
escape as a server error. :func:`loads_json` refuses both with a
:class:`DocumentError` that says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any


class DocumentError(ValueError):
    """A JSON or YAML document that specs may not be read from (the message says why)."""


def _no_constant(name: str) -> Any:
    raise DocumentError(f"{name} is not a number a spec may hold (numbers must be finite)")


def loads_json(text: str | bytes) -> Any:
    """JSON as a spec, a bus message or a proposal may hold it: numbers finite and of a
    sane size (no ``NaN``/``Infinity``, no integers of thousands of digits)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except DocumentError:
        raise
    except RecursionError:
        raise DocumentError("invalid JSON: nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise DocumentError(f"invalid JSON: {exc}") from None
    except ValueError:  # an integer past Python's digit limit
        raise DocumentError("invalid JSON: a number has too many digits") from None
