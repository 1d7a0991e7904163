"""Schemathesis against the OpenAPI schema: for every operation, generated requests
(valid and invalid) never cause a server error, and every response matches the
documented status codes, content type and schema. Examples are kept few so it stays fast.

Schemathesis's pytest fixture integration does not run on pytest 9, so the operations
are driven with Hypothesis directly (one ``@given`` per operation)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

from mlwe.api.auth import Role
from mlwe.api.context import ApiSettings
from tests.api.conftest import Api, make_api

#: Every check schemathesis runs on single requests (the CLI's ``--checks all``; the
#: stateful ones need links between operations and run in the CLI only).
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
    checks.negative_data_rejection,
    checks.positive_data_acceptance,
    checks.missing_required_header,
    checks.unsupported_method,
    checks.allow_header_conformance,
    checks.ignored_auth,
]
#: What no JSON schema can say, by operation, with the reason (checks left out there only).
NOT_EXPRESSIBLE = {
    # a schema-valid spec can be one no node of this cluster could ever hold: refused as
    # inadmissible (422) at submission, by design
    ("POST", "/api/v1/workloads"): {checks.positive_data_acceptance},
    # the body's name, when given, must equal the path's: a cross-field rule
    ("PUT", "/api/v1/queues/{queue}"): {checks.positive_data_acceptance},
}
EXAMPLES = 8


@pytest.fixture(scope="module")
def schema_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    # generated submissions must not all be throttled by the per-token rate limit
    api = make_api(Path(tmp_path_factory.mktemp("schemathesis")),
                   ApiSettings(submit_rate_per_s=1e6, submit_burst=10**6))
    yield api
    api.svc.close()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_server_errors_and_responses_match_the_schema(schema_api: Api, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", schema_api.svc.app)
    headers = {"Authorization": f"Bearer {schema_api.tokens[Role.ADMIN]}"}
    operations = [r.ok() for r in schema.get_all_operations()]
    tested = []
    for op in operations:
        if op.path == "/api/v1/streams":
            continue  # an endless event stream: tested in test_sse.py
        if op.method.upper() == "DELETE" and op.path.startswith("/api/v1/tokens/"):
            continue  # it would revoke the token the run uses; tested in test_auth.py

        skip = NOT_EXPRESSIBLE.get((op.method.upper(), op.path), set())
        op_checks = [c for c in CHECKS if c not in skip]

        @given(case=op.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:  # type: ignore[no-untyped-def]
            case.call_and_validate(headers=headers, checks=op_checks)  # noqa: B023 (run at once, below)

        try:
            run()
        except Unsatisfiable:
            if mode is GenerationMode.NEGATIVE:
                continue  # nothing to get wrong: the operation takes no input
            raise
        except Exception as exc:
            raise AssertionError(f"{op.method.upper()} {op.path}: {exc}") from exc
        tested.append(f"{op.method.upper()} {op.path}")
    assert len(tested) >= (35 if mode is GenerationMode.POSITIVE else 20), tested
