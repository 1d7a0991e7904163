"""The wire between the engine's LocalBackend and a workload daemon.

One TCP connection per daemon, opened by the daemon; newline-delimited JSON
objects, each with a ``type``. The daemon speaks first.

daemon -> engine
  hello      {daemon_id, host, pid, protocol, token, nodes: [node], machine, running: [replica]}
  hb         {}                                     heartbeat, every ``heartbeat_s``
  started    {seq, id, workload, attempt, replica, node, pid}
  exited     {seq, id, workload, attempt, replica, node, code, cause, stopped, forced,
              checkpoint}  sent only once the replica's whole process tree is gone
  report     {workload, attempt, replica, node, data}      coalesced workload reports;
              ``seq`` is set when the report carries a checkpoint (then it is a fact)
  telemetry  {samples: [{node, workload, metrics, declared}]}
  error      {message}

engine -> daemon
  welcome    {heartbeat_s, telemetry_s, report_s}
  refused    {reason}                               the daemon prints it and exits 2
  start      {request_id, workload, attempt, replica, replicas, node, devices, gpu_milli,
              vram_mib, cpu_milli, memory_mib, command, env, checkpoint_dir,
              resume_work_s, correlation_id}
  stop       {request_id, workload, attempt, grace_s}   grace_s == 0: force
  ack        {upto}                                 facts up to this seq were received

Facts (``seq`` set) stay in the daemon's outbox until acknowledged and are
sent again after a reconnect; their ``id`` makes the repeat harmless.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 20  # one message; anything longer is a protocol error


class ProtocolError(ValueError):
    pass


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":"), allow_nan=True) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("a message is a JSON object with a string 'type'")
    return msg


def parse_address(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """'127.0.0.1:7070' -> ('127.0.0.1', 7070); a clear error otherwise.

    ``any_port``: port 0 (let the system choose) is allowed, for listening."""
    host, sep, port = text.rpartition(":")
    low = 0 if any_port else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) < 65536:
        raise ValueError(f"engine address {text!r} is not HOST:PORT (e.g. 127.0.0.1:7070)")
    return host.strip("[]"), int(port)


def finite_metrics(raw: Any) -> dict[str, float]:
    """Numeric metrics from a message (NaN and inf kept: they are signals), others dropped."""
    out: dict[str, float] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool):
                out[k] = float(v)
    return out


def is_fraction(v: Any) -> TypeGuard[float]:
    return (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        and 0.0 <= v <= 1.0
    )
