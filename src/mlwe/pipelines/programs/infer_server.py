"""An HTTP inference server for the digits model: ``python -m mlwe.pipelines.programs.infer_server``.

One replica of an online inference service. It loads the model (the
logistic regression ``digits train-linear`` exports: NumPy only, so a replica
starts fast), binds a free
local port, writes its address to the endpoint file the engine gave it (so
the router finds it), and serves:

- ``POST /predict`` with ``{"pixels": [64 numbers]}`` -> ``{"digit": d}``;
- ``GET /healthz`` -> ``{"ok": true}``.

Requests are served one at a time per replica, each holding the replica's
accelerator for ``--service-ms`` (this machine has no GPU: the hold is a
sleep, so the queueing, the latency under load and the gain from more
replicas are real while the CPUs stay free for everything else) plus the real
model call. The time each request held the accelerator is returned in the
``X-Service-Ms`` header, which is how the scaling agent learns a replica's
capacity. SIGTERM stops it gracefully.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

try:
    import numpy as np
except ImportError as exc:  # the core install has no NumPy: name the extra that brings it
    from mlwe.core.extras import missing_extra

    raise missing_extra("pipelines", exc) from exc


class LinearModel:
    """The exported logistic regression (``digits train-linear``): NumPy only."""

    def __init__(self, W: Any, b: Any, classes: Any, scale: float) -> None:
        self.W, self.b, self.classes, self.scale = W, b, classes, scale

    @classmethod
    def load(cls, path: str) -> LinearModel:
        with np.load(path) as z:
            return cls(z["W"], z["b"], z["classes"], float(z["scale"]))

    def predict(self, x: Any) -> int:
        return int(self.classes[int(np.argmax((x / self.scale) @ self.W.T + self.b))])


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    model: LinearModel
    service_s: float
    accelerator: threading.Lock
    served: int


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the router reuses connections
    disable_nagle_algorithm = True  # headers and body go out at once: no 40 ms delayed-ACK stall
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no line per request
        return

    def _reply(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"ok": True, "served": self.server.served})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/predict":
            self._reply(404, {"error": f"no route {self.path}"})
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(n))
            x = np.asarray(body["pixels"], dtype=np.float64).reshape(1, 64)
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": f"bad request: {exc}"})
            return
        srv = self.server
        with srv.accelerator:  # one request at a time holds this replica's accelerator
            t0 = time.perf_counter()
            digit = srv.model.predict(x)
            rest = srv.service_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
            held = (time.perf_counter() - t0) * 1000
            srv.served += 1
        self._reply(200, {"digit": digit}, {"X-Service-Ms": f"{held:.3f}"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlwe.pipelines.programs.infer_server")
    ap.add_argument("--model", required=True)
    ap.add_argument("--endpoint", required=True, help="file to write {'url': ...} to")
    ap.add_argument("--service-ms", type=float, default=20.0)
    ap.add_argument("--host", default="127.0.0.1")
    a = ap.parse_args(argv)
    try:
        model = LinearModel.load(a.model)
    except (OSError, ValueError, KeyError) as exc:
        print(f"cannot load model {a.model}: {exc}", file=sys.stderr)
        return 2
    srv = _Server((a.host, 0), _Handler)
    srv.model = model
    srv.service_s = a.service_ms / 1000
    srv.accelerator = threading.Lock()
    srv.served = 0
    port = srv.server_address[1]
    ep = Path(a.endpoint)
    ep.parent.mkdir(parents=True, exist_ok=True)
    tmp = ep.with_name(ep.name + ".tmp")
    tmp.write_text(
        json.dumps(
            {
                "url": f"http://{a.host}:{port}",
                "pid": os.getpid(),
                # lets the engine's runner tell this attempt's address from a dead one's
                "attempt": int(os.environ.get("MLWE_ATTEMPT", "0") or 0),
            }
        ),
        encoding="utf-8",
    )
    os.replace(tmp, ep)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"serving on http://{a.host}:{port}", flush=True)
    srv.serve_forever(poll_interval=0.1)
    srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
