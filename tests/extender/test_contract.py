"""Contract tests: bodies shaped exactly as kube-scheduler 1.20 sends them, answers in its wire format."""

from __future__ import annotations

import json

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.app import create_app
from services.extender.service import ExtenderService
from services.extender.wire import DEFAULT_PREFIX
from shared.events.bus import EventBus
from shared.events.catalogue import QuotaEvent, RefusedEvent
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations, gpus
from tests.extender.conftest import (
    PREFIX,
    StandInBinder,
    add_node,
    bind_args,
    gpu_pod,
    names_args,
    nodes_args,
)
from tests.waiting import eventually, stream_events


async def settle(service: ExtenderService) -> None:
    await service.resync("test")


async def test_filter_in_node_names_mode_sorts_nodes_with_reasons(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService
) -> None:
    await add_node(ledger, "big", [16, 16])
    await add_node(ledger, "small", [4, 4])
    await settle(service)
    pod = gpu_pod("p", 8)
    r = await client.post(f"{PREFIX}/filter", json=names_args(pod, ["big", "small", "cpu-only"]))
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert body["NodeNames"] == ["big"] and body["Nodes"] is None and body["Error"] == ""
    assert "small" in body["FailedAndUnresolvableNodes"] and "8192 MiB" in body["FailedAndUnresolvableNodes"]["small"]
    assert "inventory" in body["FailedAndUnresolvableNodes"]["cpu-only"]
    assert body["FailedNodes"] == {}


async def test_filter_in_nodes_mode_returns_node_objects(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService
) -> None:
    await add_node(ledger, "n1", [8])
    await add_node(ledger, "n2", [16])
    await settle(service)
    r = await client.post(f"{PREFIX}/filter", json=nodes_args(gpu_pod("p", 12), ["n1", "n2"]))
    body = r.json()
    assert body["NodeNames"] is None
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["n2"]
    assert body["Nodes"]["items"][0]["metadata"]["labels"] == {"kubernetes.io/hostname": "n2"}
    assert "n1" in body["FailedAndUnresolvableNodes"]


async def test_full_now_is_failed_nodes_and_a_refusal_is_published(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder, bus: EventBus
) -> None:
    await add_node(ledger, "n1", [8])
    await settle(service)
    first = gpu_pod("first", 6)
    assert (await client.post(f"{PREFIX}/filter", json=names_args(first, ["n1"]))).json()["NodeNames"] == ["n1"]
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(first, "n1"))).json() == {"Error": ""}

    second = gpu_pod("second", 4)
    for _ in range(2):  # the second refusal of the same pod within 10 s is throttled
        body = (await client.post(f"{PREFIX}/filter", json=names_args(second, ["n1"]))).json()
        assert body["NodeNames"] == [] and "n1" in body["FailedNodes"]
        assert "GPU 0" in body["FailedNodes"]["n1"] and "2048 MiB" in body["FailedNodes"]["n1"]
    # filter returns once the stream has acknowledged its refusal: the stream holds all there is
    refusals: list[RefusedEvent] = await stream_events(bus, "refused")
    assert len(refusals) == 1
    assert refusals[0].pod_uid == second["metadata"]["uid"] and "n1" in refusals[0].reasons


async def test_prioritize_scores_binpack(client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService) -> None:
    await add_node(ledger, "empty", [16, 16])
    await add_node(ledger, "half", [16])
    await settle(service)
    pod = gpu_pod("p", 8)
    r = await client.post(f"{PREFIX}/prioritize", json=names_args(pod, ["empty", "half", "ghost"]))
    assert r.status_code == 200
    scores = {e["Host"]: e["Score"] for e in r.json()}
    assert set(r.json()[0]) == {"Host", "Score"}
    assert scores == {"empty": 3, "half": 5, "ghost": 0}


async def test_bind_reserves_best_fit_and_answers_after_the_binder(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder, engine: AsyncEngine
) -> None:
    await add_node(ledger, "n1", [12, 8, 4, 16])
    await settle(service)
    pod = gpu_pod("p", 8, owners=[{"kind": "ReplicaSet", "name": "rs-1", "controller": True, "uid": "x"}])
    await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    r = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert r.json() == {"Error": ""}
    async with engine.connect() as conn:
        row = (await conn.execute(select(allocations))).one()
        parts = (await conn.execute(select(allocation_parts))).all()
    assert row.state == "bound" and row.owner_kind == "ReplicaSet" and row.owner_name == "rs-1"
    assert [(p.gpu_index, p.memory_mib) for p in parts] == [(1, 8192)]
    # a retried bind for the same pod finds the existing allocation and reports it truthfully
    again = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert again.json() == {"Error": ""}
    assert len(binder.seen) == 1
    inspect = (await client.get(f"{PREFIX}/inspect/n1")).json()
    dev1 = inspect["nodes"][0]["devs"][1]
    assert inspect["nodes"][0]["totalGPU"] == 40 and inspect["nodes"][0]["usedGPU"] == 8
    assert dev1["id"] == 1 and dev1["usedGPU"] == 8 and dev1["pods"][0]["name"] == "p"
    assert (await client.get(f"{PREFIX}/inspect/nowhere")).status_code == 404
    assert (await client.get(f"{PREFIX}/inspect")).json()["nodes"][0]["name"] == "n1"


async def test_binder_failure_is_reported_and_capacity_returns(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder, engine: AsyncEngine
) -> None:
    await add_node(ledger, "n1", [8])
    await settle(service)
    pod = gpu_pod("fail-me", 8)
    await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    r = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert "stand-in binder refused" in r.json()["Error"]
    async with engine.connect() as conn:
        assert (await conn.execute(select(allocations.c.state))).scalar_one() == "failed"
        assert (await conn.execute(select(gpus.c.allocated_memory_mib))).scalar_one() == 0


async def test_bind_timeout_keeps_the_reservation_for_the_binder_to_settle(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, engine: AsyncEngine
) -> None:
    """A slow binder may be creating the Binding right now: the extender must not release under it."""
    service.bind_timeout_s = 0.5
    await add_node(ledger, "n1", [8])
    await settle(service)
    pod = gpu_pod("slow-binder", 4)
    await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    r = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert "reservation on n1 is kept" in r.json()["Error"]
    async with engine.connect() as conn:
        row = (await conn.execute(select(allocations.c.id, allocations.c.state))).one()
        assert row.state == "reserved"
        assert (await conn.execute(select(gpus.c.allocated_memory_mib))).scalar_one() == 4096
    # the binder catches up; kube-scheduler's retry of the same bind now answers success
    await ledger.mark_bound(row.id, pod["metadata"]["uid"], "n1")
    again = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert again.json()["Error"] == ""


async def test_bind_of_an_unknown_pod_without_kubernetes_is_a_clear_error(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, engine: AsyncEngine
) -> None:
    await add_node(ledger, "n1", [8])
    r = await client.post(f"{PREFIX}/bind", json=bind_args(gpu_pod("ghost", 1), "n1"))
    assert r.status_code == 200 and "not seen" in r.json()["Error"]
    async with engine.connect() as conn:
        assert (await conn.execute(select(allocations))).first() is None


async def test_namespace_quota_fails_every_node(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService
) -> None:
    await add_node(ledger, "n1", [16])
    await ledger.record(QuotaEvent(namespace="team", memory_mib=4096))
    await settle(service)
    body = (await client.post(f"{PREFIX}/filter", json=names_args(gpu_pod("p", 6, namespace="team"), ["n1"]))).json()
    assert body["NodeNames"] == [] and "quota 4096 MiB" in body["FailedNodes"]["n1"]


async def test_preempt_without_the_api_keeps_kube_schedulers_victims_where_they_free_the_right_gpu(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder
) -> None:
    await add_node(ledger, "n1", [8, 8])
    await add_node(ledger, "n2", [6])
    await settle(service)
    placed = {}
    for name, node, mem in (("a", "n1", 6), ("b", "n1", 6), ("c", "n2", 2)):
        pod = gpu_pod(name, mem)
        await client.post(f"{PREFIX}/filter", json=names_args(pod, [node]))
        assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, node))).json() == {"Error": ""}
        placed[name] = pod["metadata"]["uid"]
    pod = gpu_pod("urgent", 7)
    args = {
        "Pod": pod,
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            "n1": {"Pods": [{"UID": placed["a"]}, {"UID": placed["b"]}, {"UID": "cpu-pod"}], "NumPDBViolations": 0},
            "n2": {"Pods": [{"UID": placed["c"]}], "NumPDBViolations": 1},
        },
    }
    r = await client.post(f"{PREFIX}/preempt", json=args)
    assert r.status_code == 200
    out = r.json()["NodeNameToMetaVictims"]
    assert set(out) == {"n1"}  # n2's only GPU has 6 GiB: no eviction makes room for 7
    # without the API (--trust-filter-pods) no other pod of the node is known: kube-scheduler's victims, all of
    # them (it chose them for what it checks itself), with its count; tests/e2e/test_preemption.py with the API
    assert out["n1"] == args["NodeNameToMetaVictims"]["n1"]


async def test_version_health_and_metrics(client: httpx.AsyncClient) -> None:
    assert "version" in (await client.get("/version")).json()
    assert (await client.get("/healthz")).status_code == 200
    assert (await client.get("/readyz")).status_code == 200
    text = (await client.get("/metrics")).text
    assert "gpushare_extender_filter_seconds" in text and "gpushare_extender_binds_total" in text


async def test_multi_gpu_and_init_container_pod_is_reserved_by_the_charge_rule(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder, engine: AsyncEngine
) -> None:
    """kubelet hands the init container's devices on to the app container (device reuse, `shared.placement.reuse`):
    an init container on one GPU before an app container on two could never start as placed (the app container
    would take the init container's 6 devices on one GPU), so that pod is refused with the reason; on the same two
    GPUs as the app container, it is reserved by the charge rule."""
    await add_node(ledger, "n1", [8, 8, 16])
    await settle(service)
    init = [{"name": "setup", "image": "x", "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}}]
    pod = gpu_pod("p", 8, limits={"aliyun.com/gpu-count": "2"}, init=init)
    body = (await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))).json()
    assert body["NodeNames"] == [] and "different numbers of GPUs" in body["FailedAndUnresolvableNodes"]["n1"], body
    init[0]["resources"]["limits"] = {"aliyun.com/gpu-mem": "8", "aliyun.com/gpu-count": "2"}
    pod = gpu_pod("p", 8, limits={"aliyun.com/gpu-count": "2"}, init=init)
    body = (await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))).json()
    assert body["NodeNames"] == ["n1"], body
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json() == {"Error": ""}
    async with engine.connect() as conn:
        parts = (await conn.execute(select(allocation_parts))).all()
        held = {r.uuid: r.allocated_memory_mib for r in (await conn.execute(select(gpus))).all()}
    app = sorted((p.gpu_index, p.memory_mib) for p in parts if not p.init)
    inits = sorted((p.gpu_index, p.memory_mib) for p in parts if p.init)
    assert app == [(0, 4096), (1, 4096)]  # best fit: the two 8 GiB GPUs, 4 GiB each
    assert inits == app  # where the app container takes over its devices
    assert held == {"GPU-n1-0": 4096, "GPU-n1-1": 4096, "GPU-n1-2": 0}  # max(4096, 4096) per GPU


async def test_the_view_follows_ledger_events_without_a_resync(ledger: Ledger, service: ExtenderService) -> None:
    from shared.events.catalogue import AllocationPart
    from shared.ledger.reservations import ReservationRequest

    await add_node(ledger, "late", [8])
    await eventually(lambda: "late" in service.view.nodes, what="the view to learn the new node")
    part = AllocationPart(container="main", container_index=0, gpu_uuid="GPU-late-0", gpu_index=0, memory_mib=2048)
    res = await ledger.reserve(ReservationRequest("uid-x", "default", "x", "late", (part,)))
    await eventually(
        lambda: service.view.nodes["late"].gpus[0].allocated_memory_mib == 2048, what="the view to count the share"
    )
    await ledger.release(res.allocation_id, "uid-x", "late", "test")
    await eventually(
        lambda: service.view.nodes["late"].gpus[0].allocated_memory_mib == 0, what="the view to give the share back"
    )
    assert "uid-x" not in service.view.allocations


async def test_the_lean_path_and_the_fastapi_routes_answer_the_verbs_alike(service: ExtenderService) -> None:
    """The verbs are served by `HotPath`; the FastAPI routes behind it (what /openapi.json documents) call the
    same handlers: same status and body for a good and a malformed call of each."""
    app = create_app(service, max_body_bytes=256 * 1024)
    pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u-lean"}, "spec": {"containers": []}}
    bodies = {
        "filter": {"Pod": pod, "NodeNames": ["nowhere"]},
        "prioritize": {"Pod": pod, "NodeNames": ["nowhere"]},
        "bind": {"PodName": "p", "PodNamespace": "default", "PodUID": "u-lean", "Node": "nowhere"},
        "preempt": {"Pod": pod, "NodeNameToMetaVictims": {}},
    }
    for verb, body in bodies.items():
        for content in (json.dumps(body).encode(), b"{not json"):
            answers = []
            for asgi in (app, app.app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://e") as c:
                    reply = await c.post(f"{DEFAULT_PREFIX}/{verb}", content=content)
                answers.append((reply.status_code, reply.json()))
            assert answers[0] == answers[1], (verb, content[:20], answers)
