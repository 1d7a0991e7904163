"""The dashboard: one static page (HTML, CSS, plain JavaScript) served by ``mlwe.api``.

No build step, no CDN, no third-party script: everything it needs ships in
``static/`` inside the package, so it works on a machine with no internet.
All data is written into the page with ``textContent`` (never as HTML), so a
workload named ``<script>`` shows as text.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"

__all__ = ["STATIC_DIR"]
