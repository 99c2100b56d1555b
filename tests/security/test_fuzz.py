"""Junk and numeric extremes on every endpoint: schemathesis drives a real ``serve`` from the OpenAPI
document it serves, in positive (valid per schema) and negative (invalid) modes, and checks every answer:
never a 5xx, every status and body as documented, invalid data always refused.

Bounded for CI: ``FUZZ_EXAMPLES`` examples per operation (env ``VOLUNTEER_FUZZ_EXAMPLES``), no shrinking,
so the module stays well under a minute on a 2-core machine. ``tests/security/report.py`` runs the same
fuzzer with a larger budget for the reliability figures (docs/reliability.md#figures).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.security.conftest import Target

FUZZ_EXAMPLES = int(os.environ.get("VOLUNTEER_FUZZ_EXAMPLES", "15"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# Operations that would end the fuzzing session's own run or volunteer keep their random targets.
_KEEP_RANDOM = {"/api/v1/volunteers/{name}/ban", "/api/v1/runs/{name}/finish"}


@pytest.fixture(scope="module")
def api_schema(target: Target) -> Any:
    return schemathesis.openapi.from_url(f"{target.url}/api/v1/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def prepare_case(case: Any, target: Target) -> None:
    """Credentials for the operation, and real ids for most path parameters so that generated bodies reach
    the code behind the lookups (heartbeats, lease reports) instead of stopping at a 404."""
    security = case.operation.definition.raw.get("security") or []
    schemes = {name for requirement in security for name in requirement}
    headers: dict[str, str] = {}
    # A case without the header is a negative case about a missing credential: it stays without one.
    if any(name.lower() == "authorization" for name in case.headers or {}):
        if "organizer_token" in schemes:
            headers["Authorization"] = f"Bearer {target.admin}"
        elif "volunteer_credential" in schemes:
            headers["Authorization"] = f"Bearer {target.volunteer}"
        case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"} | headers
    if case.path_parameters and case.operation.path not in _KEEP_RANDOM:
        real = {"session_id": target.session_id, "lease_id": target.lease_id, "name": "shapes"}
        for name in case.path_parameters:
            if name in real:
                case.path_parameters[name] = real[name]


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_every_endpoint_answers_junk_with_a_documented_4xx_never_a_5xx(case: Any, target: Target) -> None:
    prepare_case(case, target)
    response = case.call(timeout=30)
    target.count(response.status_code)
    documented = set(case.operation.definition.raw.get("responses", {}))
    # A documented "try again later" (the gallery's generate without a swarm peer: 503) is an answer, not
    # a failure; anything else at 500 and above is a bug, shown with the server's own account of it.
    unavailable = response.status_code in (503, 504) and str(response.status_code) in documented
    if response.status_code >= 500 and not unavailable:
        pytest.fail(
            f"{case.method} {case.formatted_path} answered {response.status_code}:\n{target.log()[-4000:]}"
        )
    checks = [check for check in CHECKS if not (unavailable and check is not_a_server_error)]
    # Reads ignore unknown query parameters, as HTTP servers do; a body over the size limit is refused
    # with 413 before it is validated (schemathesis counts only 4xx codes of validation as a rejection).
    if case.method == "GET" or response.status_code == 413:
        checks.remove(negative_data_rejection)
    case.validate_response(response, checks=checks)


def test_the_fuzzed_server_logged_no_traceback(target: Target) -> None:
    assert sum(target.answers.values()) > 0, "the fuzzer sent nothing"
    assert target.server_errors() == 0
    assert "Traceback" not in target.log() and "unhandled error" not in target.log()
    report = os.environ.get("VOLUNTEER_FUZZ_REPORT")
    if report:  # tests/security/report.py reads the figures from here
        Path(report).write_text(json.dumps({str(k): v for k, v in sorted(target.answers.items())}))
