"""After an exchange every record tells the truth: pod annotations follow the ledger (a real kube-apiserver).

An exchange rewrites both pods' annotations through the binder's consumer of the ledger's events; a binder
restart (adoption runs), reconciliation and a rebuild from the stream cannot bring the replaced record back;
a patch never puts an older record over a newer one.
"""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from services.binder.annotate import AnnotationSync, annotation_patch
from services.binder.metrics import BinderMetrics
from services.binder.reads import PodRecord
from services.binder.reconcile import Reconciler
from shared.annotations import (
    ALLOCATION,
    GPU_MEM_ASSIGNED,
    GPU_MEM_IDX,
    binding_annotations,
    parse_allocation,
    record_version,
)
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart
from shared.kube.binding import create_binding
from shared.ledger.ledger import Ledger
from shared.ledger.replay import differences, load_state, replay_state
from shared.settings import MemoryUnit
from tests.binder.conftest import GIB, request_for, state_becomes
from tests.waiting import eventually

pytestmark = pytest.mark.e2e


async def _annotations(cluster, name: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return dict((await cluster.read(name)).metadata.annotations or {})


async def _record(cluster, name: str) -> tuple[int, str, list[str]]:  # type: ignore[no-untyped-def]
    """(version, GPU index annotation, GPU UUIDs of the record) on the pod."""
    ann = await _annotations(cluster, name)
    _, _, parts = parse_allocation(ann[ALLOCATION])
    return record_version(ann[ALLOCATION]), ann[GPU_MEM_IDX], [p.gpu_uuid for p in parts]


async def test_exchange_rewrites_both_pods_and_nothing_resurrects_the_old_record(
    cluster, ledger: Ledger, engine, bus: EventBus, start_binder
) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    first, second = await cluster.pod(gib=4), await cluster.pod(gib=4)
    res_first = await ledger.reserve(request_for(first, node, gib=4, gpu=0))
    res_second = await ledger.reserve(request_for(second, node, gib=4, gpu=1))
    for res in (res_first, res_second):
        await state_becomes(engine, res, "bound")
    assert await _record(cluster, first.metadata.name) == (1, "0", [node.gpus[0]])

    # kubelet admitted `second` where `first` was expected: the node agent has the ledger swap their shares
    assert await ledger.exchange(node.name, (res_first.allocation_id, "main"), (res_second.allocation_id, "main"))
    await ledger.mark_assigned(res_second.allocation_id, second.metadata.uid, node.name, "main", [node.gpus[0]])

    async def rewritten() -> bool:
        return await _record(cluster, first.metadata.name) == (2, "1", [node.gpus[1]]) and await _record(
            cluster, second.metadata.name
        ) == (2, "0", [node.gpus[0]])

    await eventually(rewritten, what="both pods' annotations to follow the exchange", within=30)
    await eventually(lambda: _assigned(cluster, second.metadata.name), what="the assigned flag on the pod that started")
    assert (await _annotations(cluster, first.metadata.name)).get(GPU_MEM_ASSIGNED) == "false"
    patched = binder.metrics.value("gpushare_binder_annotation_syncs_total", reason="patched")
    assert patched >= 2

    # a binder restart: reconciliation and adoption run and change nothing
    report = await binder.reconciler.run_once()
    assert (report.adopted, report.released, report.annotated, report.conflicts) == (0, 0, 0, [])
    restarted = await start_binder()
    assert restarted.reconciler.passes >= 1
    assert await rewritten()

    # a rebuild from the stream reproduces the ledger, exchange included, and agrees with the annotations
    async with engine.connect() as conn:
        live = await load_state(conn)
    replayed, _ = await replay_state(bus)
    assert differences(live, replayed) == []
    for res, name in ((res_first, first.metadata.name), (res_second, second.metadata.name)):
        alloc = replayed.allocations[res.allocation_id]
        assert alloc.version == 2
        assert [p.gpu_uuid for p in alloc.parts] == (await _record(cluster, name))[2]


async def test_reconciliation_repairs_an_annotation_an_exchange_left_behind(cluster, ledger: Ledger, kube) -> None:
    """No binder consumed the exchange (its patch was lost): the next reconciliation pass finds the pods'
    records older than the ledger's and rewrites them."""
    node = await cluster.node(ledger)
    first, second = await cluster.pod(gib=2), await cluster.pod(gib=2)
    reservations = []
    for pod, gpu in ((first, 0), (second, 1)):
        res = await ledger.reserve(request_for(pod, node, gib=2, gpu=gpu))
        annotations = binding_annotations(
            res.allocation_id, node.name, list(res.parts), dict.fromkeys(node.gpus, 16 * GIB), MemoryUnit.GIB
        )
        await create_binding(
            kube, pod.metadata.namespace, pod.metadata.name, node.name, uid=pod.metadata.uid, annotations=annotations
        )
        await ledger.mark_bound(res.allocation_id, pod.metadata.uid, node.name)
        reservations.append(res)
    await ledger.exchange(node.name, (reservations[0].allocation_id, "main"), (reservations[1].allocation_id, "main"))
    assert await _record(cluster, first.metadata.name) == (1, "0", [node.gpus[0]]), "nobody patched it yet"

    metrics = BinderMetrics()
    sync = AnnotationSync(ledger.engine, kube, unit=MemoryUnit.GIB, metrics=metrics)
    reconciler = Reconciler(ledger, kube, unit=MemoryUnit.GIB, metrics=metrics, annotate=sync.sync)
    report = await reconciler.run_once()
    assert report.annotated == 2
    assert await _record(cluster, first.metadata.name) == (2, "1", [node.gpus[1]])
    assert await _record(cluster, second.metadata.name) == (2, "0", [node.gpus[0]])
    assert (await reconciler.run_once()).annotated == 0, "repaired once"


async def _assigned(cluster, name: str) -> bool:  # type: ignore[no-untyped-def]
    return (await _annotations(cluster, name)).get(GPU_MEM_ASSIGNED) == "true"


def _record_of(version: int, gpu: int) -> PodRecord:
    part = AllocationPart(container="main", container_index=0, gpu_uuid=f"GPU-{gpu}", gpu_index=gpu, memory_mib=2 * GIB)
    return PodRecord(
        allocation_id=uuid.UUID(int=7),
        pod_uid="u",
        namespace="ns",
        pod_name="p",
        node="n1",
        state="bound",
        version=version,
        parts=[part],
        assigned=False,
        gpu_memory={"GPU-0": 16 * GIB, "GPU-1": 16 * GIB},
    )


def test_a_patch_never_puts_an_older_record_over_a_newer_one() -> None:
    newer = annotation_patch(_record_of(3, 1), {}, MemoryUnit.GIB, now_ns=1)
    assert record_version(newer[ALLOCATION]) == 3 and newer[GPU_MEM_IDX] == "1"
    assert annotation_patch(_record_of(2, 0), newer, MemoryUnit.GIB, now_ns=2) == {}, "older than the pod's"
    assert annotation_patch(_record_of(3, 1), newer, MemoryUnit.GIB, now_ns=3) == {}, "the same: nothing to do"
    legacy = {ALLOCATION: json.dumps({"id": str(uuid.UUID(int=7)), "node": "n1", "parts": []})}
    assert record_version(legacy[ALLOCATION]) == 1, "records written before versions count as version 1"
    assert annotation_patch(_record_of(2, 1), legacy, MemoryUnit.GIB, now_ns=4)[GPU_MEM_IDX] == "1"


async def _bound_and_assigned(cluster, ledger: Ledger, kube, node, gpu: int):  # type: ignore[no-untyped-def]
    """A 2 GiB pod on `gpu`: reserved, its Binding written with its annotations (as the binder writes it), bound
    and assigned in the ledger; (its reservation, its metadata)."""
    pod = await cluster.pod(gib=2)
    res = await ledger.reserve(request_for(pod, node, gib=2, gpu=gpu))
    annotations = binding_annotations(
        res.allocation_id, node.name, list(res.parts), dict.fromkeys(node.gpus, 16 * GIB), MemoryUnit.GIB
    )
    meta = pod.metadata
    await create_binding(kube, meta.namespace, meta.name, node.name, uid=meta.uid, annotations=annotations)
    await ledger.mark_bound(res.allocation_id, meta.uid, node.name)
    await ledger.mark_assigned(res.allocation_id, meta.uid, node.name, "main", [node.gpus[gpu]])
    return res, meta


async def test_the_assigned_flag_is_one_patch_when_the_pod_watch_shows_the_pod(
    cluster, ledger: Ledger, kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binder's pod watch already shows the pod: the assigned flag is one conditional PATCH, without a GET
    first. When the watch trails the pod (its resourceVersion is older), the patch conflicts and the pod is read,
    compared and patched again; a pod whose watched annotations already tell the ledger's record is left alone."""
    from services.binder import annotate
    from services.binder.pod_index import binder_index
    from shared.kube.pods import get_pod

    node = await cluster.node(ledger)
    index = binder_index()
    index.synced()
    allocations = []
    for gpu in (0, 1):
        res, meta = await _bound_and_assigned(cluster, ledger, kube, node, gpu)
        index.update("ADDED", await get_pod(kube, meta.namespace, meta.name))
        allocations.append((res.allocation_id, meta.name))
    # the second pod changes after the watch saw it (kubelet reports its status, say)
    await cluster.core.patch_namespaced_pod(allocations[1][1], cluster.namespace, {"metadata": {"labels": {"x": "y"}}})

    gets: list[str] = []

    async def counted_get(api, namespace: str, name: str, **kwargs):  # type: ignore[no-untyped-def]
        gets.append(name)
        return await get_pod(api, namespace, name, **kwargs)

    monkeypatch.setattr(annotate, "get_pod", counted_get)
    sync = AnnotationSync(ledger.engine, kube, unit=MemoryUnit.GIB, metrics=BinderMetrics(), pods=index)
    assert await sync.sync(allocations[0][0]) == "patched" and gets == []
    assert await sync.sync(allocations[1][0]) == "patched" and gets == [allocations[1][1]]
    for _, name in allocations:
        assert await _assigned(cluster, name)
    index.update("MODIFIED", await get_pod(kube, cluster.namespace, allocations[0][1]))
    assert await sync.sync(allocations[0][0]) == "up_to_date" and len(gets) == 1


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, every GET of a pod by AnnotationSync ("GET") and every read of a record from the ledger
    ("ledger"), in order."""
    from services.binder import annotate, reads
    from shared.kube.pods import get_pod

    calls: list[str] = []

    def counted(what, real):  # type: ignore[no-untyped-def]
        async def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(what)
            return await real(*args, **kwargs)

        return call

    monkeypatch.setattr(annotate, "get_pod", counted("GET", get_pod))
    monkeypatch.setattr(reads, "pod_record", counted("ledger", reads.pod_record))
    return calls


async def test_an_assigned_event_sets_the_flag_from_the_pod_watch_without_reading_the_ledger(
    cluster, ledger: Ledger, kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `assigned` event says the allocation was assigned: when the binder's watch shows the pod (by its UID),
    the flag is one conditional PATCH, with no ledger read and no GET; a second container's event then finds the
    flag set. A pod the watch does not show is read from ledger and API server as before."""
    from services.binder.pod_index import binder_index
    from shared.events.catalogue import AssignedEvent
    from shared.kube.pods import get_pod

    node = await cluster.node(ledger)
    index = binder_index()
    index.synced()
    events = []
    for gpu, watched in ((0, True), (1, False)):
        res, meta = await _bound_and_assigned(cluster, ledger, kube, node, gpu)
        if watched:
            index.update("ADDED", await get_pod(kube, meta.namespace, meta.name))
        events.append(
            (
                AssignedEvent(
                    allocation_id=res.allocation_id,
                    pod_uid=meta.uid,
                    node=node.name,
                    container="main",
                    gpu_uuids=[node.gpus[gpu]],
                ),
                meta.name,
            )
        )
    calls = _count_reads(monkeypatch)
    metrics = BinderMetrics()
    sync = AnnotationSync(ledger.engine, kube, unit=MemoryUnit.GIB, metrics=metrics, pods=index)
    await sync(events[0][0])
    assert calls == [] and await _assigned(cluster, events[0][1])
    index.update("MODIFIED", await get_pod(kube, cluster.namespace, events[0][1]))
    await sync(events[0][0])  # the pod's next container, say
    assert calls == []
    await sync(events[1][0])  # not watched: ledger and pod are read
    assert calls == ["ledger", "GET"] and await _assigned(cluster, events[1][1])
    assert metrics.value("gpushare_binder_annotation_syncs_total", reason="up_to_date") == 1


async def test_a_claims_first_annotations_go_on_the_pods_uid_not_its_resource_version(cluster, kube) -> None:  # type: ignore[no-untyped-def]
    """A DRA pod's first record (a claim's: one version, never exchanged) is patched on the pod's UID: a pod that
    changed since the binder's watch saw it (kubelet reporting its start, say) takes it without a conflict and a
    GET; a pod of that name with another UID (deleted and created again meanwhile) refuses it."""
    from services.binder.pod_index import binder_index
    from shared.kube.pods import get_pod

    sync = AnnotationSync(None, kube, unit=MemoryUnit.GIB, metrics=BinderMetrics())
    first = await cluster.pod(gib=2)
    index = binder_index()
    index.synced()
    index.update("ADDED", await get_pod(kube, cluster.namespace, first.metadata.name))
    seen = index.get(cluster.namespace, first.metadata.name)
    name = first.metadata.name
    await cluster.core.patch_namespaced_pod(name, cluster.namespace, {"metadata": {"labels": {"x": "y"}}})
    with pytest.raises(ApiException) as conflict:
        await sync._patch(seen, {GPU_MEM_IDX: "0"})  # on the resourceVersion seen: conflicts
    assert conflict.value.status == 409
    await sync._patch(seen, {GPU_MEM_IDX: "0"}, versioned=False)
    assert (await _annotations(cluster, first.metadata.name))[GPU_MEM_IDX] == "0"

    await cluster.delete_pod(first.metadata.name)
    await eventually(lambda: _gone(cluster, first.metadata.name), what="the first pod gone", within=30)
    await cluster.pod(gib=2, name=first.metadata.name)  # the same name, another UID
    with pytest.raises(ApiException) as refused:
        await sync._patch(seen, {GPU_MEM_IDX: "1"}, versioned=False)
    assert refused.value.status in (409, 422), refused.value  # what AnnotationSync.sync reads the pod again on
    assert GPU_MEM_IDX not in await _annotations(cluster, first.metadata.name)


async def _gone(cluster, name: str) -> bool:  # type: ignore[no-untyped-def]
    return await cluster.read(name) is None


async def test_a_claims_annotations_at_assigned_come_from_the_gates_record_without_a_ledger_read(
    cluster, kube, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A DRA pod's annotations are first written when its claim is assigned. The claim gate kept the record it gave
    the ledger (tests/dra/test_gate_queries.py shows it is the one the ledger returns), so the `assigned` event's sync
    writes it, with the claim and the assigned flag, without reading the ledger or the pod; the record is taken
    once."""
    from services.binder import reads
    from services.binder.pod_index import binder_index
    from shared.dra import CLAIM_ANNOTATION
    from shared.events.catalogue import AllocationPart, AssignedEvent
    from shared.kube.pods import get_pod

    started = await cluster.pod(gib=2)
    meta = started.metadata
    index = binder_index()
    index.synced()
    index.update("ADDED", await get_pod(kube, meta.namespace, meta.name))
    allocation_id, gpu_uuid, node = uuid.uuid4(), f"GPU-{uuid.uuid4()}", "dra-node"
    part = AllocationPart(container="main", container_index=0, gpu_uuid=gpu_uuid, gpu_index=3, memory_mib=2 * GIB)
    record = reads.claim_record(
        allocation_id,
        pod_uid=meta.uid,
        namespace=meta.namespace,
        pod_name=meta.name,
        node=node,
        parts=[part],
        gpu_memory={gpu_uuid: 16 * GIB, f"GPU-{uuid.uuid4()}": 16 * GIB},
        claim_uid="claim-uid-1",
    )
    kept = {allocation_id: record}
    calls = _count_reads(monkeypatch)
    metrics = BinderMetrics()
    sync = AnnotationSync(
        None, kube, unit=MemoryUnit.GIB, metrics=metrics, pods=index, recorded=lambda a: kept.pop(a, None)
    )
    event = AssignedEvent(
        allocation_id=allocation_id, pod_uid=meta.uid, node=node, container="main", gpu_uuids=[gpu_uuid]
    )
    await sync(event)
    assert calls == [] and kept == {}
    written = await _annotations(cluster, meta.name)
    assert written[CLAIM_ANNOTATION] == "claim-uid-1" and written[GPU_MEM_ASSIGNED] == "true"
    assert written[GPU_MEM_IDX] == "3" and parse_allocation(written[ALLOCATION]) == (allocation_id, node, [part])
    assert metrics.value("gpushare_binder_annotation_syncs_total", reason="patched") == 1
