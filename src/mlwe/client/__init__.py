"""A Python client for a running mlwe server (``mlwe serve``), over httpx; sync and async.

    from mlwe.client import Client
    with Client("http://localhost:8080", token="mlwe_...") as c:
        created = c.submit_file("job.yaml")
        w = c.wait(created[0], {"running", "succeeded"}, timeout=600)
        print(c.explain(w["id"])["summary"])
        for ev in c.stream(["state"]):          # reconnects, resuming after the last event
            print(ev.topic, ev.workload, ev.payload.get("to"))

    async with AsyncClient() as c:              # the same methods, awaited
        await c.wait("job-1", {"succeeded"})

``url`` and ``token`` default to ``$MLWE_URL`` / ``$MLWE_TOKEN``, then the current
client context (``mlwe config``, :mod:`mlwe.clientconfig`), then
http://127.0.0.1:8080. Answers are typed dicts (:class:`WorkloadSummary`,
:class:`Node`, ...: the server's OpenAPI models, checked against them by a
test). Every failure raises a :class:`ClientError`: :class:`ServerUnreachable`
when no answer came (connection refused, timeout), else the subclass for the
HTTP status, with the server's message and each problem it named.
"""

from __future__ import annotations

from mlwe.client.aio import AsyncClient
from mlwe.client.answers import (
    MODELS as MODELS,
)
from mlwe.client.answers import (
    ActionResult as ActionResult,
)
from mlwe.client.answers import (
    AgentStatus as AgentStatus,
)
from mlwe.client.answers import (
    Approval as Approval,
)
from mlwe.client.answers import (
    AuditRecord as AuditRecord,
)
from mlwe.client.answers import (
    Decision as Decision,
)
from mlwe.client.answers import (
    Explanation as Explanation,
)
from mlwe.client.answers import (
    Node as Node,
)
from mlwe.client.answers import (
    NodeQuantities as NodeQuantities,
)
from mlwe.client.answers import (
    Quantities as Quantities,
)
from mlwe.client.answers import (
    Queue as Queue,
)
from mlwe.client.answers import (
    Resources as Resources,
)
from mlwe.client.answers import (
    SubmitResult as SubmitResult,
)
from mlwe.client.answers import (
    TokenCreated as TokenCreated,
)
from mlwe.client.answers import (
    TokenInfo as TokenInfo,
)
from mlwe.client.answers import (
    TokenPolicy as TokenPolicy,
)
from mlwe.client.answers import (
    Transition as Transition,
)
from mlwe.client.answers import (
    WorkloadDetail as WorkloadDetail,
)
from mlwe.client.answers import (
    WorkloadSummary as WorkloadSummary,
)
from mlwe.client.errors import (
    ClientError,
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    RateLimited,
    ServerError,
    ServerUnreachable,
    Unauthorized,
    WaitTimeout,
)
from mlwe.client.streams import StreamEvent
from mlwe.client.streams import parse_sse as parse_sse
from mlwe.client.sync import Client
from mlwe.clientconfig import DEFAULT_URL
from mlwe.clientconfig import resolve as resolve

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Conflict",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "RateLimited",
    "ServerError",
    "ServerUnreachable",
    "StreamEvent",
    "Unauthorized",
    "WaitTimeout",
]
_ = DEFAULT_URL  # re-exported for callers that knew it here
# the typed answers (MODELS ...), parse_sse and resolve are importable from here too (``X as X``),
# as they were before the client became a package: errors, answers, streams, sync, aio.
