"""Schemathesis against the extender's OpenAPI document, on a real `gpushare extender` over the real
PostgreSQL ledger and NATS JetStream.

Every operation of /openapi.json gets schema-conforming requests, then schema-violating ones. No answer may be a
5xx; every answer's status, content type and body must be what the document declares; every 4xx is JSON with
an `error` that names the problem (not the generic internal-error text). The process stays up, and its log
has no traceback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from schemathesis.generation import GenerationMode

from shared.events.catalogue import GpuInfo, InventoryEvent
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from tests.reliability.harness import ServiceProcess
from tests.reliability.profile import PROFILE
from tests.schema_fuzz import error_problem, fuzz_openapi

PREFIX = "/gpushare-scheduler"
NODE = "schema-node-0"
# Per operation, from the reliability profile (bounded: 25 + 15; soak: 833 + 500): schema-conforming requests,
# then ones violating the schema.
EXAMPLES = (
    (GenerationMode.POSITIVE, PROFILE.fuzz_examples // 6),
    (GenerationMode.NEGATIVE, PROFILE.fuzz_examples // 10),
)


async def _seed_inventory(database_url: str, prefix: str) -> None:
    """One node with two 16 GiB GPUs, so that /inspect answers with GPUs (the extender loads it at start; its
    outbox relay publishes the event under `prefix`)."""
    engine = make_engine(database_url, pool_size=1)
    try:
        gpus = [
            GpuInfo(uuid=f"GPU-{NODE}-{i}", index=i, model="Tesla-T4", memory_mib=16384, memory_total_mib=16384)
            for i in range(2)
        ]
        await Ledger(engine, prefix=prefix, source="schema-test").record(InventoryEvent(node=NODE, gpus=gpus))
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
async def extender(
    database_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    """A `gpushare extender` process on the test run's database and NATS, with its own stream."""
    tag = uuid.uuid4().hex[:8]
    logs = tmp_path_factory.mktemp("extender-schema")
    env = {
        "GPUSHARE_DATABASE_URL": database_url,
        "GPUSHARE_NATS_URL": nats_url,
        "GPUSHARE_STREAM_NAME": f"GPUSHARE_SC{tag}",
        "GPUSHARE_SUBJECT_PREFIX": f"gssc{tag}",
        "KUBECONFIG": str(Path(logs) / "no-kubeconfig"),  # bind of an unseen pod answers at once
    }
    await _seed_inventory(database_url, env["GPUSHARE_SUBJECT_PREFIX"])
    proc = ServiceProcess("extender", ["extender", "--host", "127.0.0.1", "--bind-timeout", "1"], env, logs)
    try:
        await asyncio.to_thread(proc.start().wait_ready)
        yield proc
    finally:
        await asyncio.to_thread(proc.stop)


def test_extender_openapi_documents_the_wire_format(extender: ServiceProcess) -> None:
    """The document declares a JSON body for every scheduler verb, so schemathesis has something to send."""
    spec = httpx.get(extender.base_url + "/openapi.json", timeout=10).json()
    for verb in ("filter", "prioritize", "bind", "preempt"):
        operation = spec["paths"][f"{PREFIX}/{verb}"]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["required"], verb
        assert {"200", "400", "413"} <= set(operation["responses"]), verb


def test_schemathesis_finds_no_server_error_and_every_answer_conforms(extender: ServiceProcess) -> None:
    report = fuzz_openapi(extender.base_url, EXAMPLES)
    print(f"schemathesis: {report.calls} calls, answers by status {dict(sorted(report.by_status.items()))}")
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.calls >= 7 * 20, report  # every operation was exercised
    assert report.by_status.get(400, 0) >= 20, report  # schema-violating bodies were refused
    assert extender.proc is not None and extender.proc.poll() is None, extender.log_tail()
    assert httpx.get(extender.base_url + "/readyz", timeout=10).status_code == 200
    log = extender.all_logs()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]


def test_inspect_of_the_seeded_node_conforms(extender: ServiceProcess) -> None:
    """A positive case with content: the seeded node's GPUs, in the unit, through the documented schema."""
    reply = httpx.get(f"{extender.base_url}{PREFIX}/inspect/{NODE}", timeout=10)
    assert reply.status_code == 200, reply.text
    (node,) = reply.json()["nodes"]
    assert (node["name"], node["totalGPU"], len(node["devs"])) == (NODE, 32, 2)


_POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
# Bodies schemathesis's soak run (6,167 calls) answered with 500 before the fix: an AttributeError in the wire
# parsers (a node or victim whose metadata is not an object) or in the pod's hints (annotations not an object).
FOUND_500: list[tuple[str, str, dict, str]] = [
    ("node-metadata-null", "filter", {"Pod": _POD, "Nodes": {"items": [{"metadata": None}]}}, "Nodes.items"),
    ("node-metadata-string", "prioritize", {"Pod": _POD, "Nodes": {"items": [{"metadata": "x"}]}}, "Nodes.items"),
    (
        "annotations-string",
        "filter",
        {"Pod": {"metadata": {"name": "p", "annotations": "x"}}, "NodeNames": ["n"]},
        "annotations",
    ),
    ("annotations-float", "prioritize", {"Pod": {"metadata": {"name": "p", "annotations": 1.5}}}, "annotations"),
    ("annotations-list", "preempt", {"Pod": {"metadata": {"name": "p", "annotations": [1]}}}, "annotations"),
    (
        "victim-metadata-string",
        "preempt",
        {"Pod": _POD, "NodeNameToVictims": {"n": {"Pods": [{"metadata": "x"}]}}},
        "no UID",
    ),
]


@pytest.mark.parametrize(("verb", "body", "named"), [c[1:] for c in FOUND_500], ids=[c[0] for c in FOUND_500])
def test_bodies_that_crashed_the_extender_are_refused_with_the_reason(
    extender: ServiceProcess, verb: str, body: dict, named: str
) -> None:
    reply = httpx.post(f"{extender.base_url}{PREFIX}/{verb}", json=body, timeout=10)
    assert reply.status_code == 400, reply.text
    assert error_problem(reply) is None, reply.text
    assert named in reply.json()["error"], reply.text
