"""OpenAPI fuzzing with schemathesis: no request, however odd, gets a server error."""

from __future__ import annotations

import asyncio

import hypothesis
import hypothesis.errors
import schemathesis
from schemathesis.generation import GenerationMode

from tests.schema_fuzz import live_server_settings

from .conftest import ADMIN_TOKEN, LiveServer, Stack

# 25 examples per operation (bounded for run time): schema-conforming ones, then ones violating the schema.
EXAMPLES = ((GenerationMode.POSITIVE, 15), (GenerationMode.NEGATIVE, 10))


def _fuzz(base_url: str) -> tuple[int, list[str]]:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    failures: list[str] = []
    calls = 0
    for mode, examples in EXAMPLES:
        for result in schema.get_all_operations():
            calls += _fuzz_operation(result.ok(), mode, examples, base_url, failures)
    return calls, failures


def _fuzz_operation(
    operation: schemathesis.APIOperation, mode: GenerationMode, examples: int, base_url: str, failures: list[str]
) -> int:
    calls = 0

    @live_server_settings(examples)
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        nonlocal calls
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        calls += 1
        if response.status_code >= 500:
            failures.append(f"{mode.value} {case.method} {case.formatted_path} {case.query} -> {response.status_code}")
        content_type = (response.headers.get("content-type") or [""])[0]
        assert content_type.startswith("application/json"), (case.formatted_path, response.text[:200])

    try:
        check()
    except hypothesis.errors.Unsatisfiable:
        # An operation without parameters or body has nothing to violate in negative mode.
        assert mode is GenerationMode.NEGATIVE, operation.label
    return calls


async def test_openapi_fuzz_finds_no_server_error(seeded: Stack, live_server: LiveServer) -> None:
    calls, failures = await asyncio.to_thread(_fuzz, live_server.url)
    assert not failures, failures[:10]
    assert calls >= 12 * 10  # every operation was exercised
    # The API still answers sensibly afterwards.
    assert (await seeded.client.get("/v1/cluster")).status_code == 200
