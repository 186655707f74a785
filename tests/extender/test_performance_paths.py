"""The extender's fast paths keep the answers exact: compact view, streamed reload, score cache, encoders,
and bind outcomes taken from the bus without re-reading the ledger."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
from starlette.responses import JSONResponse

from services.extender.service import ExtenderService
from services.extender.view import ClusterView
from services.extender.wire import dump_priorities, parse_extender_args
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent, NodeRetiredEvent, ReleasedEvent
from shared.http import dump_json
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import ReservationRequest
from tests.extender.conftest import PREFIX, StandInBinder, add_node, bind_args, gpu_pod, names_args


def _part(gpu: str, index: int, mib: int, *, container: str = "main", init: bool = False) -> AllocationPart:
    return AllocationPart(
        container=container, container_index=0, gpu_uuid=gpu, gpu_index=index, memory_mib=mib, init=init
    )


async def _quiet(service: ExtenderService) -> None:
    """Wait until the bus has stopped changing the view (events of the setup have all arrived)."""
    version, still = service.view.version, 0
    while still < 6:
        await asyncio.sleep(0.05)
        still = still + 1 if service.view.version == version else 0
        version = service.view.version


def _summary(view: ClusterView) -> dict:
    return {
        "nodes": {
            name: [(g.uuid, g.index, g.memory_mib, g.allocated_memory_mib, g.healthy) for g in node.gpus]
            for name, node in sorted(view.nodes.items())
        },
        "allocations": {
            uid: (a.allocation_id, a.namespace, a.pod_name, a.node, a.state, a.charges)
            for uid, a in sorted(view.allocations.items())
        },
        "usage": {ns: view.namespace_usage(ns) for ns in ("default", "team")},
    }


def test_encoders_match_fastapi_json_byte_for_byte() -> None:
    pairs = [("node-1", 3), ('nö"de\\x\n', 10), ("", 0), ("\u2028x", 5), ("big", 12)]
    expected = JSONResponse([{"Host": h, "Score": s} for h, s in pairs]).body
    assert dump_priorities(pairs) == expected
    assert dump_priorities([]) == b"[]"
    assert dump_priorities(pairs) == expected  # again, from the rendered rows kept for each host
    value = {"Nodes": None, "NodeNames": ["ü"], "FailedNodes": {"a": "b"}, "Error": ""}
    assert dump_json(value) == JSONResponse(value).body
    awkward = {
        "NodeNames": ['q"\\/', "\x00\x1f\x7f\b\f\n\r\t", "\u2028\u00e9\U0001f600", ""],
        "n": [0, -1, 2**53],
        "b": True,
    }
    assert dump_json(awkward) == JSONResponse(awkward).body


def test_node_names_must_all_be_strings() -> None:
    pod = gpu_pod("p", 1)
    assert parse_extender_args({"Pod": pod, "NodeNames": ["a", "b"]}).node_names == ["a", "b"]
    for bad in (["a", 1], [None], ["a", ["b"]]):
        try:
            parse_extender_args({"Pod": pod, "NodeNames": bad})
        except ValueError as exc:
            assert "NodeNames" in str(exc)
        else:
            raise AssertionError(f"accepted NodeNames={bad!r}")


def test_inventory_and_retirement_touch_only_their_node() -> None:
    view = ClusterView()
    for node in ("a", "b"):
        view.apply(
            InventoryEvent(
                node=node,
                cuda_version="12.2",
                gpus=[GpuInfo(uuid=f"{node}-{i}", index=i, memory_mib=8192, memory_total_mib=8192) for i in range(2)],
            )
        )
    alloc = uuid.uuid4()
    view.add_reservation(alloc, "p1", "team", "p1", "a", (_part("a-1", 1, 2048),))
    # node a now reports only GPU 0: GPU 1 leaves a, b keeps both
    view.apply(
        InventoryEvent(
            node="a", cuda_version="12.2", gpus=[GpuInfo(uuid="a-0", index=0, memory_mib=8192, memory_total_mib=8192)]
        )
    )
    assert [g.uuid for g in view.nodes["a"].gpus] == ["a-0"]
    assert [g.uuid for g in view.nodes["b"].gpus] == ["b-0", "b-1"]
    assert view.namespace_usage("team") == (2048, 0)
    assert [a.pod_uid for a in view.pods_on("a", "a-1")] == ["p1"]
    before = view.version
    view.apply(NodeRetiredEvent(node="a"))
    assert view.version > before
    assert "a" not in view.nodes and "b" in view.nodes
    # as in the ledger, the allocation stays counted until its own release (`Ledger.retire_node` sends it first)
    assert view.namespace_usage("team") == (2048, 0)
    view.apply(ReleasedEvent(allocation_id=alloc, pod_uid="p1", node="a", reason="node deleted"))
    assert "p1" not in view.allocations and view.namespace_usage("team") == (0, 0)
    assert view.pods_on("a", "a-1") == []


async def test_streamed_reload_equals_the_view_built_from_events(ledger: Ledger, service: ExtenderService) -> None:
    await add_node(ledger, "n1", [8, 8])
    await add_node(ledger, "n2", [16])
    await service.resync("test")
    # two parts on one GPU (app + init: the effective-request rule), one on another node, one released
    r1 = await ledger.reserve(
        ReservationRequest(
            "uid-1",
            "team",
            "one",
            "n1",
            (_part("GPU-n1-0", 0, 2048), _part("GPU-n1-0", 0, 3072, container="i", init=True)),
        )
    )
    r2 = await ledger.reserve(ReservationRequest("uid-2", "team", "two", "n2", (_part("GPU-n2-0", 0, 4096),)))
    r3 = await ledger.reserve(ReservationRequest("uid-3", "default", "three", "n1", (_part("GPU-n1-1", 1, 1024),)))
    await ledger.release(r3.allocation_id, "uid-3", "n1", "test")
    live = [r1, r2]
    fresh = ClusterView()
    await fresh.reload(service.engine)
    summary = _summary(fresh)
    assert summary["allocations"]["uid-1"][5] == {"GPU-n1-0": (3072, 0)}
    assert summary["allocations"]["uid-2"][5] == {"GPU-n2-0": (4096, 0)}
    assert "uid-3" not in summary["allocations"]
    assert summary["usage"] == {"default": (0, 0), "team": (7168, 0)}
    assert summary["nodes"]["n1"][0][3] == 3072 and summary["nodes"]["n1"][1][3] == 0
    assert {a.allocation_id for a in fresh.allocations.values()} == {r.allocation_id for r in live}
    # the running service followed the same changes through the bus; a resync must not change anything
    for _ in range(100):
        if _summary(service.view) == summary:
            break
        await asyncio.sleep(0.05)
    assert _summary(service.view) == summary
    version = service.view.version
    await service.resync("test-again")
    assert _summary(service.view) == summary and service.view.version > version


async def test_prioritize_reuses_the_scores_filter_computed(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService
) -> None:
    await add_node(ledger, "empty", [16])
    await add_node(ledger, "half", [16])
    await service.resync("test")
    await ledger.reserve(ReservationRequest("uid-h", "default", "h", "half", (_part("GPU-half-0", 0, 8192),)))
    await service.resync("test")
    await _quiet(service)
    pod = gpu_pod("p", 4)
    args = names_args(pod, ["empty", "half", "nowhere"])
    assert (await client.post(f"{PREFIX}/filter", json=args)).json()["NodeNames"] == ["empty", "half"]
    hits = service.scores.hits
    r = await client.post(f"{PREFIX}/prioritize", json=args)
    assert r.headers["content-type"] == "application/json"
    expected = [{"Host": "empty", "Score": 3}, {"Host": "half", "Score": 8}, {"Host": "nowhere", "Score": 0}]
    assert r.json() == expected and service.scores.hits == hits + 1
    # the view changes between filter and prioritize: the cached scores are not used
    await client.post(f"{PREFIX}/filter", json=args)
    res = await ledger.reserve(ReservationRequest("uid-e", "default", "e", "empty", (_part("GPU-empty-0", 0, 8192),)))
    service.view.add_reservation(res.allocation_id, "uid-e", "default", "e", "empty", res.parts)
    misses = service.scores.misses
    r = await client.post(f"{PREFIX}/prioritize", json=args)
    assert r.json()[0] == {"Host": "empty", "Score": 8} and service.scores.misses == misses + 1
    # another pod (or another demand for the same UID) never gets these scores
    other = gpu_pod("p", 8, uid=pod["metadata"]["uid"])
    r = await client.post(f"{PREFIX}/prioritize", json=names_args(other, ["empty", "half"]))
    assert r.json() == [{"Host": "empty", "Score": 10}, {"Host": "half", "Score": 10}]
    body = json.loads((await client.post(f"{PREFIX}/prioritize", json={"Pod": pod})).content)
    assert body == []


async def test_a_bound_event_settles_the_bind_without_reading_the_ledger(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder
) -> None:
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    pod = gpu_pod("p", 2)
    await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    service.waiter.poll_s = 30.0  # no fallback poll during the bind: only the bus can settle it in time
    reads = service.waiter.reads
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json() == {"Error": ""}
    assert service.waiter.reads == reads  # the bound event said it all (the poll interval is 0.2 s)
    # a failure still reports the ledger's reason (read once the failed event arrives)
    failing = gpu_pod("fail-me", 2)
    await client.post(f"{PREFIX}/filter", json=names_args(failing, ["n1"]))
    answer = (await client.post(f"{PREFIX}/bind", json=bind_args(failing, "n1"))).json()["Error"]
    assert answer == "binding failed (failed): stand-in binder refused"
    # a retried bind for the bound pod finds the reservation and its outcome in the ledger
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json() == {"Error": ""}
