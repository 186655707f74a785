"""Every answer of the accounting API is what its OpenAPI document declares: status codes, content types and
bodies (the pydantic response models, errors included), checked by schemathesis on the seeded ledger."""

from __future__ import annotations

import asyncio

from schemathesis.generation import GenerationMode

from tests.schema_fuzz import fuzz_openapi

from .conftest import ADMIN_TOKEN, LiveServer, Stack

EXAMPLES = ((GenerationMode.POSITIVE, 12), (GenerationMode.NEGATIVE, 8))


def test_every_operation_documents_its_answers(stack: Stack) -> None:
    spec = stack.app.openapi()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            answers = operation["responses"]
            assert "$ref" in answers["200"]["content"]["application/json"]["schema"], (method, path)
            for status, answer in answers.items():
                schema = answer["content"]["application/json"]["schema"]
                assert "HTTPValidationError" not in str(schema), (method, path, status)  # FastAPI's, not ours


async def test_schemathesis_finds_every_answer_as_documented(seeded: Stack, live_server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    report = await asyncio.to_thread(fuzz_openapi, live_server.url, EXAMPLES, headers)
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.by_status.get(200, 0) >= 13 and report.by_status.get(422, 0) >= 10, report.by_status
