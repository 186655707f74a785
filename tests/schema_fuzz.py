"""What the schemathesis tests share: hypothesis settings for fuzzing a live server, and a fuzz run that checks
every answer against the OpenAPI document."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import hypothesis
import hypothesis.errors
import schemathesis
from hypothesis import HealthCheck
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)


def live_server_settings(examples: int) -> hypothesis.settings:
    """Repeatable (derandomized), no deadline (a real server over HTTP), no example database, no health checks."""
    return hypothesis.settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERIC_ERROR = "internal error"


@dataclass
class FuzzReport:
    """What a schemathesis run sent and what went wrong."""

    calls: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def error_problem(response: httpx.Response | object) -> str | None:
    """Why a 4xx answer does not name its problem in a JSON `error`, or None when it does."""
    try:
        body = response.json()  # type: ignore[attr-defined]
    except ValueError:
        return "a 4xx answer is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, str) or not error.strip():
        return "a 4xx answer has no `error`"
    if error.startswith(GENERIC_ERROR):
        return f"a 4xx answer gives no reason: {error!r}"
    return None


def fuzz_openapi(
    base_url: str, examples: tuple[tuple[GenerationMode, int], ...], headers: dict[str, str] | None = None
) -> FuzzReport:
    """Send every operation of `base_url`/openapi.json `examples` generated requests per generation mode (with
    `headers`); run schemathesis's response checks (`CHECKS`: status, content type and body as documented) and
    `error_problem` on 4xx answers; collect the failures."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    report = FuzzReport()
    for mode, count in examples:
        for result in schema.get_all_operations():
            _fuzz_operation(result.ok(), mode, count, base_url, headers, report)
    return report


def _fuzz_operation(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    count: int,
    base_url: str,
    headers: dict[str, str] | None,
    report: FuzzReport,
) -> None:
    @live_server_settings(count)
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        report.calls += 1
        report.by_status[response.status_code] = report.by_status.get(response.status_code, 0) + 1
        what = f"{mode.value} {case.method} {case.formatted_path} body={str(case.body)[:200]}"
        try:
            case.validate_response(response, checks=CHECKS)
        except (Failure, FailureGroup) as exc:
            report.failures.append(f"{what}: {str(exc)[:600]}")
        if 400 <= response.status_code < 500 and (problem := error_problem(response)):
            report.failures.append(f"{what}: {problem}: {response.text[:200]}")

    try:
        check()
    except hypothesis.errors.Unsatisfiable:
        # An operation without parameters or body has nothing to violate in negative mode.
        assert mode is GenerationMode.NEGATIVE, operation.label
