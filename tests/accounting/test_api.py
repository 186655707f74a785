"""Every REST endpoint against a seeded ledger, including bad queries and the token on writes."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import SecretStr
from sqlalchemy import event

from services.accounting import queries
from services.accounting.api import create_app
from services.accounting.resource_quotas import ResourceQuotas, gpu_quota_rows, quantity
from services.accounting.routes import cluster
from services.accounting.routes.quotas import NO_KUBERNETES
from services.accounting.schemas import NodeList
from shared.events.catalogue import GpuInfo, HealthEvent, InventoryEvent, NodeRetiredEvent, QuotaEvent
from shared.ledger.replay import read_events
from shared.settings import Settings

from .conftest import ADMIN_TOKEN, GIB, Stack


async def test_cluster_and_nodes(seeded: Stack) -> None:
    c = (await seeded.client.get("/v1/cluster")).json()
    assert c["nodes"] == 2 and c["gpus"] == 4
    assert c["memory_mib"] == 60 * GIB
    assert c["allocated_memory_mib"] == 12 * GIB  # bert-1 2 + bert-2 2 + train-0 8
    assert c["allocated_pct"] == 20
    assert c["allocations_by_state"] == {"reserved": 0, "bound": 1, "assigned": 2, "released": 1, "failed": 1}
    assert c["pending_pods"] == 1
    assert c["memory_unit"] == "GiB"
    nodes = (await seeded.client.get("/v1/nodes")).json()["items"]
    assert [n["name"] for n in nodes] == ["node-0", "node-1"]
    n0 = nodes[0]
    assert n0["allocated_memory_mib"] == 4 * GIB and n0["memory_mib"] == 30 * GIB and n0["live_allocations"] == 2
    g00 = n0["gpus"][0]
    assert (g00["uuid"], g00["model"], g00["allocated_memory_mib"], g00["used_memory_mib"]) == (
        "GPU-0-0",
        "Tesla-T4",
        2 * GIB,
        1200,  # the latest sample
    )


async def test_node_detail(seeded: Stack) -> None:
    r = await seeded.client.get("/v1/nodes/node-1")
    assert r.status_code == 200
    node = r.json()
    by_gpu = {g["uuid"]: g["allocations"] for g in node["gpus"]}
    assert [(a["pod_name"], a["container"], a["memory_mib"]) for a in by_gpu["GPU-1-0"]] == [("train-0", "main", 4096)]
    assert [(a["pod_name"], a["container"]) for a in by_gpu["GPU-1-1"]] == [("train-0", "side")]
    assert [a["pod_name"] for a in node["allocations"]] == ["train-0"]
    missing = await seeded.client.get("/v1/nodes/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]


async def test_allocations_filters_and_pagination(seeded: Stack) -> None:
    get = seeded.client.get
    everything = (await get("/v1/allocations")).json()
    assert everything["total"] == 5 and everything["next_offset"] is None
    assert everything["items"][0]["pod_name"] == "flaky-0"  # newest first
    assert (await get("/v1/allocations?namespace=team-b")).json()["total"] == 2
    assert {a["pod_name"] for a in (await get("/v1/allocations?state=live")).json()["items"]} == {
        "bert-1",
        "bert-2",
        "train-0",
    }
    assert [a["pod_name"] for a in (await get("/v1/allocations?state=released")).json()["items"]] == ["old-0"]
    assert [a["pod_name"] for a in (await get("/v1/allocations?node=node-0&pod=bert-2")).json()["items"]] == ["bert-2"]
    assert (await get("/v1/allocations?pod=uid-c")).json()["items"][0]["pod_name"] == "train-0"
    page1 = (await get("/v1/allocations?limit=2")).json()
    page2 = (await get("/v1/allocations?limit=2&offset=2")).json()
    page3 = (await get("/v1/allocations?limit=2&offset=4")).json()
    assert page1["next_offset"] == 2 and page2["next_offset"] == 4 and page3["next_offset"] is None
    names = [a["pod_name"] for p in (page1, page2, page3) for a in p["items"]]
    assert sorted(names) == sorted(a["pod_name"] for a in everything["items"]) and len(set(names)) == 5
    later = (seeded.seeded_at + timedelta(hours=1)).isoformat().replace("+", "%2B")
    # Only allocations still alive an hour from now overlap that range.
    assert (await get(f"/v1/allocations?since={later}")).json()["total"] == 3
    before = (seeded.seeded_at - timedelta(days=1)).isoformat().replace("+", "%2B")
    assert (await get(f"/v1/allocations?until={before}")).json()["total"] == 0


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("/v1/allocations?limit=0", "limit"),
        ("/v1/allocations?limit=5000", "limit"),
        ("/v1/allocations?offset=-1", "offset"),
        ("/v1/allocations?state=sleeping", "state"),
        ("/v1/allocations?namespace=Bad_NS", "namespace"),
        ("/v1/allocations?since=yesterday", "since"),
        ("/v1/allocations?since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", "after until"),
        ("/v1/usage/namespaces?since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", "after until"),
        ("/v1/usage/workloads?until=0001-01-01T00:00:00", "out of bounds"),
        ("/v1/rightsizing?headroom=-1", "headroom"),
        ("/v1/rightsizing?step_mib=0", "step_mib"),
        ("/v1/pods/UPPER/x", "namespace"),
    ],
)
async def test_bad_queries_get_422_with_a_reason(plain_client: httpx.AsyncClient, query: str, needle: str) -> None:
    r = await plain_client.get(query)
    assert r.status_code == 422, r.text
    assert needle in r.text


async def test_pod_view_and_pending(seeded: Stack) -> None:
    pod = (await seeded.client.get("/v1/pods/team-b/train-0")).json()
    assert pod["pod_uid"] == "uid-c" and pod["status"] == "assigned"
    assert pod["allocation"]["memory_mib"] == 8 * GIB
    assert [p["gpu_uuid"] for p in pod["allocation"]["parts"]] == ["GPU-1-0", "GPU-1-1"]
    assert [t["step"] for t in pod["timeline"]] == ["reserved", "bound", "assigned"]
    assert all(t["at"] for t in pod["timeline"])
    waiting = (await seeded.client.get("/v1/pods/team-b/huge-0")).json()
    assert waiting["status"] == "pending" and waiting["allocation"] is None
    assert set(waiting["pending"]["reasons"]) == {"node-0", "node-1"}
    items = (await seeded.client.get("/v1/pending")).json()["items"]
    assert [(p["namespace"], p["pod_name"]) for p in items] == [("team-b", "huge-0")]
    assert (await seeded.client.get("/v1/pending?namespace=team-a")).json()["items"] == []
    assert (await seeded.client.get("/v1/pods/team-a/ghost")).status_code == 404


async def test_terminating_holders_are_shown_as_such(seeded: Stack) -> None:
    assert (await seeded.ledger.mark_terminating("uid-c")) == 1, "train-0 is being deleted"
    assert (await seeded.ledger.mark_terminating("uid-c")) == 0, "marked once"
    await seeded.settle()
    pod = (await seeded.client.get("/v1/pods/team-b/train-0")).json()
    assert pod["status"] == "assigned" and pod["allocation"]["terminating_at"], "still holding its share"
    assert [t["step"] for t in pod["timeline"]] == ["reserved", "bound", "assigned", "terminating"]
    node = (await seeded.client.get("/v1/nodes/node-1")).json()
    assert node["allocated_memory_mib"] == 8 * GIB
    assert [(a["pod_name"], bool(a["terminating_at"])) for a in node["gpus"][0]["allocations"]] == [("train-0", True)]
    (waiting,) = (await seeded.client.get("/v1/pending")).json()["items"]
    assert waiting["pod_name"] == "huge-0"
    assert [(h["namespace"], h["pod_name"], h["node"]) for h in waiting["terminating_holders"]] == [
        ("team-b", "train-0", "node-1")
    ]
    assert waiting["terminating_holders"][0]["memory_mib"] == 8 * GIB


async def test_usage_per_namespace_and_workload(seeded: Stack) -> None:
    ns = {u["namespace"]: u for u in (await seeded.client.get("/v1/usage/namespaces")).json()["items"]}
    assert set(ns) == {"team-a", "team-b", "team-c"}
    a, b = ns["team-a"], ns["team-b"]
    assert a["allocated_gib_hours"] > 0 and b["allocated_gib_hours"] > 0
    assert a["pods"] == 2 and a["pods_with_samples"] == 1
    assert 0 < a["used_gib_hours"] < a["allocated_gib_hours"]
    assert b["efficiency_pct"] is not None and b["efficiency_pct"] < 100
    workloads = (await seeded.client.get("/v1/usage/workloads?namespace=team-b")).json()["items"]
    assert {(w["owner_kind"], w["owner_name"]) for w in workloads} == {("Job", "train"), ("Job", "old")}
    bare = (await seeded.client.get("/v1/usage/workloads?namespace=team-c")).json()["items"]
    assert [(w["owner_kind"], w["owner_name"]) for w in bare] == [("Pod", "flaky-0")]


async def test_rightsizing(seeded: Stack) -> None:
    fine = (await seeded.client.get("/v1/rightsizing?step_mib=512")).json()
    bert = next(x for x in fine["items"] if x["owner_name"] == "bert")
    assert (bert["allocated_mib"], bert["peak_used_mib"], bert["recommended_mib"]) == (2048, 1331, 1536)
    assert bert["p95_used_mib"] <= bert["peak_used_mib"]
    assert bert["summary"] == "allocates 2 GiB, peaks at 1.3 GiB: 33 % more pods per GPU at 1.5 GiB"
    assert bert["density_gain_pct"] == 33
    train = next(x for x in fine["items"] if x["owner_name"] == "train")
    assert train["peak_used_mib"] == 6 * GIB and train["recommended_mib"] == 7168
    # Default step: the resource unit (GiB), since aliyun.com/gpu-mem is a whole number of units.
    coarse = (await seeded.client.get("/v1/rightsizing")).json()
    assert coarse["step_mib"] == 1024
    assert next(x for x in coarse["items"] if x["owner_name"] == "bert")["summary"].endswith("right-sized")


async def test_quotas_need_the_token_and_go_through_the_ledger(seeded: Stack) -> None:
    c = seeded.client
    assert (await c.get("/v1/quotas")).json() == {
        "items": [],
        "resource_quotas": [],
        "resource_quotas_unavailable": NO_KUBERNETES,
        "memory_unit": "GiB",
    }
    assert (await c.get("/v1/quotas/team-a")).status_code == 404
    body = {"memory_mib": 10 * GIB}
    missing = await c.put("/v1/quotas/team-a", json=body)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "error" in missing.json()
    wrong = await c.put("/v1/quotas/team-a", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and wrong.json() == {"error": "invalid token"}
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert (await c.put("/v1/quotas/team-a", json={}, headers=auth)).status_code == 422
    assert (await c.put("/v1/quotas/team-a", json={"memory_mib": -1}, headers=auth)).status_code == 422
    assert (await c.put("/v1/quotas/team-a", content=b"{not json", headers=auth)).status_code == 422
    ok = await c.put("/v1/quotas/team-a", json={**body, "compute": 150}, headers=auth)
    assert ok.status_code == 200, ok.text
    assert ok.json()["memory_mib"] == 10 * GIB and ok.json()["allocated_memory_mib"] == 4 * GIB
    assert (await c.get("/v1/quotas")).json()["items"][0]["namespace"] == "team-a"
    assert (await c.delete("/v1/quotas/team-a")).status_code == 401
    assert (await c.delete("/v1/quotas/team-a", headers=auth)).status_code == 200
    assert (await c.delete("/v1/quotas/team-a", headers=auth)).status_code == 404
    assert (await c.get("/v1/quotas/team-a")).status_code == 404
    await seeded.settle()
    quota_events = [e for e in [e async for e in read_events(seeded.bus)] if isinstance(e, QuotaEvent)]
    assert [(e.namespace, e.memory_mib, e.compute) for e in quota_events] == [
        ("team-a", 10 * GIB, 150),
        ("team-a", None, None),
    ]


async def test_writes_are_refused_without_a_configured_token(stack: Stack) -> None:
    app = create_app(stack.engine, Settings(admin_token=None), ledger=stack.ledger)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as client:
        r = await client.put("/v1/quotas/x", json={"memory_mib": 1}, headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "no admin token" in r.json()["error"]
    configured = create_app(stack.engine, Settings(admin_token=SecretStr("t")), ledger=stack.ledger)
    assert configured.openapi()["paths"]["/v1/quotas/{namespace}"]["put"]


async def test_openapi_docs_and_dashboard_are_served(stack: Stack) -> None:
    assert (await stack.client.get("/docs")).status_code == 200
    spec = (await stack.client.get("/openapi.json")).json()
    assert {"/v1/cluster", "/v1/nodes", "/v1/allocations", "/v1/rightsizing", "/v1/quotas/{namespace}"} <= set(
        spec["paths"]
    )
    ui = await stack.client.get("/ui")
    assert ui.status_code == 200 and "<script>" in ui.text and "http" not in ui.text.split("<script>")[1]
    assert (await stack.client.get("/healthz")).json() == {"status": "ok", "role": "active"}


def test_gib_hours_keep_small_amounts() -> None:
    """A pod held for a fraction of a second uses a tiny but non-zero amount (it was rounded to 0.0 before:
    the cause of test_usage_per_namespace_and_workload failing when the request came quickly after seeding)."""
    from services.accounting.queries import significant

    tiny = 1100 / 1024 * (0.1 / 3600)  # 1100 MiB for 0.1 s
    assert round(tiny, 4) == 0.0 and significant(tiny) > 0
    assert significant(tiny) == float(f"{tiny:.6g}")
    assert significant(1234.56789) == 1234.57


def test_resource_quota_rows_on_gpushares_resources() -> None:
    items = [
        {
            "metadata": {"namespace": "team-a", "name": "gpus"},
            "spec": {"hard": {"requests.aliyun.com/gpu-mem": "16"}},
            "status": {
                "hard": {"requests.aliyun.com/gpu-mem": "16", "requests.aliyun.com/gpu-count": "2", "pods": "10"},
                "used": {"requests.aliyun.com/gpu-mem": "4", "pods": "3"},
            },
        },
        # not counted yet by the quota controller: the spec's limits, nothing used
        {"metadata": {"namespace": "team-b", "name": "new"}, "spec": {"hard": {"requests.aliyun.com/gpu-mem": "1k"}}},
        {"metadata": {"namespace": "team-c", "name": "cpu"}, "status": {"hard": {"requests.cpu": "4"}}},
    ]
    assert gpu_quota_rows(items) == [
        {
            "namespace": "team-a",
            "name": "gpus",
            "key": "requests.aliyun.com/gpu-count",
            "resource": "aliyun.com/gpu-count",
            "hard": 2,
            "used": 0,
        },
        {
            "namespace": "team-a",
            "name": "gpus",
            "key": "requests.aliyun.com/gpu-mem",
            "resource": "aliyun.com/gpu-mem",
            "hard": 16,
            "used": 4,
        },
        {
            "namespace": "team-b",
            "name": "new",
            "key": "requests.aliyun.com/gpu-mem",
            "resource": "aliyun.com/gpu-mem",
            "hard": 1000,
            "used": 0,
        },
    ]
    assert [quantity(q) for q in ("8", "2Ki", "1.5", "-1", "x")] == [8, 2048, None, None, None]


async def test_quotas_say_why_resource_quotas_are_missing(stack: Stack, tmp_path) -> None:
    missing = tmp_path / "kubeconfig"
    missing.write_text("{}")  # no cluster, no context: Kubernetes access cannot be configured
    app = create_app(stack.engine, stack.settings, resource_quotas=ResourceQuotas(str(missing)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as client:
        body = (await client.get("/v1/quotas")).json()
    assert body["resource_quotas"] == [] and body["items"] == []
    assert body["resource_quotas_unavailable"].startswith("accounting has no Kubernetes access (")


async def test_oversized_bodies_are_refused_before_parsing(plain_client: httpx.AsyncClient) -> None:
    """Accounting had no body limit: a multi-megabyte body was read and parsed whole."""
    from services.accounting.api import MAX_BODY_BYTES

    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    padding = "x" * (MAX_BODY_BYTES + 1)
    for headers in ({}, auth):
        r = await plain_client.put("/v1/quotas/team-a", json={"memory_mib": 1, "pad": padding}, headers=headers)
        assert r.status_code == 413, r.text
        assert f"larger than {MAX_BODY_BYTES} bytes" in r.json()["error"]

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b" " * 1024

    r = await plain_client.put("/v1/quotas/team-a", content=chunks(), headers=auth)
    assert r.status_code == 413
    ok = await plain_client.put("/v1/quotas/team-a", json={"memory_mib": -1}, headers=auth)
    assert ok.status_code == 422  # an ordinary body still reaches validation


async def test_cluster_totals_are_the_sums_of_the_node_list(seeded: Stack) -> None:
    """/v1/cluster adds up what /v1/nodes lists (read without building that list): retired nodes and GPUs left
    out, unhealthy GPUs counted, the latest usage samples summed."""
    gone = [GpuInfo(uuid=f"GPU-gone-{i}", index=i, memory_mib=8 * GIB, memory_total_mib=8 * GIB) for i in range(2)]
    await seeded.ledger.record(InventoryEvent(node="node-gone", gpus=gone))
    await seeded.ledger.record(NodeRetiredEvent(node="node-gone"))
    await seeded.ledger.record(HealthEvent(node="node-1", gpu_uuid="GPU-1-1", healthy=False, reason="Xid 79"))
    await seeded.settle()
    c = (await seeded.client.get("/v1/cluster")).json()
    nodes = (await seeded.client.get("/v1/nodes")).json()["items"]
    gpus = [g for n in nodes for g in n["gpus"]]
    assert c["nodes"] == len(nodes) == 2
    assert c["gpus"] == len(gpus) == 4
    assert c["unhealthy_gpus"] == sum(1 for g in gpus if not g["healthy"]) == 1
    assert c["memory_mib"] == sum(n["memory_mib"] for n in nodes)
    assert c["allocated_memory_mib"] == sum(n["allocated_memory_mib"] for n in nodes)
    assert c["used_memory_mib"] == sum(n["used_memory_mib"] for n in nodes) > 0


@pytest.mark.parametrize("per_chunk", [1, 2, 100])
async def test_node_listing_is_streamed_as_the_answer_model_writes_it(
    seeded: Stack, monkeypatch: pytest.MonkeyPatch, per_chunk: int
) -> None:
    """/v1/nodes is streamed without FastAPI's answer check (for memory at 5,000 nodes): its bytes are exactly
    the JSONResponse of the listing validated by NodeList, whatever the chunking, retired nodes included."""
    monkeypatch.setattr(cluster, "NODES_PER_CHUNK", per_chunk)
    gone = [GpuInfo(uuid="GPU-gone-0", index=0, memory_mib=8 * GIB, memory_total_mib=8 * GIB)]
    await seeded.ledger.record(InventoryEvent(node="node-gone", gpus=gone))
    await seeded.ledger.record(NodeRetiredEvent(node="node-gone"))
    await seeded.settle()
    for retired in (False, True):
        r = await seeded.client.get(f"/v1/nodes?include_retired={str(retired).lower()}")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        async with seeded.engine.connect() as conn:
            items = await queries.list_nodes(conn, include_retired=retired)
        answer = NodeList.model_validate({"items": items, "memory_unit": "GiB"})
        assert r.content == JSONResponse(jsonable_encoder(answer)).body
        assert len(items) == (3 if retired else 2)
    await seeded.ledger.record(NodeRetiredEvent(node="node-0"))
    await seeded.ledger.record(NodeRetiredEvent(node="node-1"))
    await seeded.settle()
    empty = await seeded.client.get("/v1/nodes")
    assert empty.json() == {"items": [], "memory_unit": "GiB"}


async def test_node_detail_reads_only_its_node(seeded: Stack) -> None:
    """/v1/nodes/{name} is the listing's entry for that node plus its allocations, read for that node alone
    (it used to build the whole cluster's listing to pick one node from it)."""
    async with seeded.engine.connect() as conn:
        listing = {n["name"]: n for n in await queries.list_nodes(conn)}
        statements: list[str] = []

        def record(conn_: object, cursor: object, statement: str, *args: object) -> None:
            statements.append(statement)

        event.listen(seeded.engine.sync_engine, "before_cursor_execute", record)
        try:
            detail = await queries.node_detail(conn, "node-0")
        finally:
            event.remove(seeded.engine.sync_engine, "before_cursor_execute", record)
    assert detail is not None
    summary = {k: v for k, v in detail.items() if k not in ("allocations", "pending_allocations")}
    summary["gpus"] = [{k: v for k, v in g.items() if k != "allocations"} for g in detail["gpus"]]
    assert summary == listing["node-0"]
    node_reads = [s for s in statements if "FROM nodes" in s]
    assert node_reads and all("nodes.name = " in s for s in node_reads)
