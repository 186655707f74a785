"""The binder against a real kube-apiserver, PostgreSQL and NATS: binding, idempotency, lifecycle, reconciliation."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import select

from services.binder.metrics import BinderMetrics
from services.binder.reconcile import Reconciler
from shared.annotations import (
    ALLOCATION,
    GPU_MEM_ASSIGNED,
    GPU_MEM_ASSUME_TIME,
    GPU_MEM_DEV,
    GPU_MEM_IDX,
    GPU_MEM_POD,
    binding_annotations,
    parse_allocation,
)
from shared.events.catalogue import AllocationPart, QuotaEvent, encode_event, subject_for
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations
from shared.settings import MemoryUnit
from tests.binder.conftest import (
    GIB,
    allocation,
    gpu_usage,
    request_for,
    state_becomes,
)
from tests.waiting import eventually, stream_events

pytestmark = pytest.mark.e2e


async def test_binds_pod_with_annotations(cluster, ledger, engine, bus, start_binder) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    pod = await cluster.pod(gib=4)
    res = await ledger.reserve(request_for(pod, node, gib=4, gpu=1))

    row = await state_becomes(engine, res, "bound")
    assert row.bound_at is not None
    bound = await cluster.read(pod.metadata.name)
    assert bound.spec.node_name == node.name
    ann = bound.metadata.annotations
    assert ann[GPU_MEM_IDX] == "1"
    assert ann[GPU_MEM_POD] == "4"
    assert ann[GPU_MEM_DEV] == "16"
    assert ann[GPU_MEM_ASSIGNED] == "false"
    allocation_id, annotated_node, parts = parse_allocation(ann[ALLOCATION])
    assert (allocation_id, annotated_node) == (res.allocation_id, node.name)
    assert [(p.gpu_uuid, p.memory_mib) for p in parts] == [(node.gpus[1], 4 * GIB)]
    assert await gpu_usage(engine, node) == {node.gpus[0]: 0, node.gpus[1]: 4 * GIB}

    await eventually(lambda: _bound_events(bus, 1), what="one bound event")
    m = binder.metrics
    assert m.value("gpushare_binder_bindings_total", reason="bound") == 1
    assert m.value("gpushare_binder_bind_seconds_count") == 1


async def _bound_events(bus, expected: int):  # type: ignore[no-untyped-def]
    events = await stream_events(bus, "bound")
    return events if len(events) == expected else None


async def test_duplicate_delivery_binds_once(cluster, ledger, engine, bus, start_binder) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    pod = await cluster.pod(gib=2)
    res = await ledger.reserve(request_for(pod, node, gib=2))
    await state_becomes(engine, res, "bound")
    reserved = (await stream_events(bus, "reserved"))[0]
    applied = binder.consumer.applied

    # the same event delivered twice more (different message ids defeat the stream's dedup: a replay)
    for i in range(2):
        await bus.publish_raw(subject_for(bus.names.prefix, reserved), encode_event(reserved), f"replay-{i}")
    await eventually(lambda: binder.consumer.applied >= applied + 2, what="replays consumed")
    # whatever the replays might (wrongly) have written is published once the outbox is empty
    await eventually(lambda: _outbox_empty(engine), what="the relay to publish everything staged")
    events = await stream_events(bus, "bound")
    assert [e.allocation_id for e in events] == [res.allocation_id]
    assert binder.metrics.value("gpushare_binder_bindings_total", reason="bound") == 1
    assert binder.metrics.value("gpushare_binder_bindings_total", reason="skipped_already_done") == 2
    assert await gpu_usage(engine, node) == {node.gpus[0]: 2 * GIB, node.gpus[1]: 0}


async def _outbox_empty(engine) -> bool:  # type: ignore[no-untyped-def]
    from sqlalchemy import func, select

    from shared.ledger.models import outbox

    async with engine.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(outbox))).scalar() == 0


async def test_pod_deleted_before_bind_fails_and_frees(cluster, ledger, engine, start_binder) -> None:
    node = await cluster.node(ledger)
    pod = await cluster.pod(gib=3)
    res = await ledger.reserve(request_for(pod, node, gib=3))
    assert (await gpu_usage(engine, node))[node.gpus[0]] == 3 * GIB
    await cluster.delete_pod(pod.metadata.name)
    await eventually(lambda: _gone(cluster, pod.metadata.name), what="pod deleted")

    binder = await start_binder()
    row = await state_becomes(engine, res, "failed")
    assert "no longer exists" in row.reason
    assert await gpu_usage(engine, node) == {node.gpus[0]: 0, node.gpus[1]: 0}
    assert binder.metrics.value("gpushare_binder_bindings_total", reason="failed_pod_gone") == 1


async def _gone(cluster, name):  # type: ignore[no-untyped-def]
    return await cluster.read(name) is None


async def test_pod_bound_elsewhere_or_replaced_fails(cluster, ledger, engine, start_binder) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    other = await cluster.node(ledger, (8,))
    elsewhere = await cluster.pod(gib=1, node_name=other.name)
    res_elsewhere = await ledger.reserve(request_for(elsewhere, node, gib=1))
    replaced = await cluster.pod(gib=1)
    res_replaced = await ledger.reserve(request_for(replaced, node, gib=1, gpu=1, uid="an-older-pod-uid"))

    row = await state_becomes(engine, res_elsewhere, "failed")
    assert other.name in row.reason
    row = await state_becomes(engine, res_replaced, "failed")
    assert "replaced" in row.reason
    assert (await cluster.read(replaced.metadata.name)).spec.node_name is None  # never bound
    assert (await cluster.read(elsewhere.metadata.name)).spec.node_name == other.name
    assert await gpu_usage(engine, node) == {node.gpus[0]: 0, node.gpus[1]: 0}
    assert binder.metrics.value("gpushare_binder_bindings_total", reason="failed_bound_elsewhere") == 1
    assert binder.metrics.value("gpushare_binder_bindings_total", reason="failed_uid_changed") == 1


async def test_release_on_completion_delete_and_terminating(cluster, ledger, engine, start_binder) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    done, deleted, terminating = [await cluster.pod(gib=2) for _ in range(3)]
    reservations = [await ledger.reserve(request_for(p, node, gib=2)) for p in (done, deleted, terminating)]
    for res in reservations:
        await state_becomes(engine, res, "bound")
    assert (await gpu_usage(engine, node))[node.gpus[0]] == 6 * GIB

    await cluster.core.patch_namespaced_pod_status(done.metadata.name, "default", {"status": {"phase": "Succeeded"}})
    row = await state_becomes(engine, reservations[0], "released", within=10)
    assert row.reason == "pod succeeded"

    await cluster.delete_pod(deleted.metadata.name, grace=0)
    row = await state_becomes(engine, reservations[1], "released", within=10)
    assert row.reason == "pod deleted"

    # a bound pod deleted with a grace period lingers with a deletionTimestamp (no kubelet finishes it): its
    # containers may still hold GPU memory, so the share stays held and is only marked terminating
    await cluster.delete_pod(terminating.metadata.name, grace=60)
    row = await eventually(
        lambda: _terminating_row(engine, reservations[2]), what="the allocation to be marked terminating"
    )
    assert row.state == "bound" and row.ended_at is None
    assert (await gpu_usage(engine, node))[node.gpus[0]] == 2 * GIB
    assert binder.metrics.value("gpushare_binder_terminating_total") >= 1  # a grace-0 delete may be marked too
    assert await binder.reconciler.run_once() is not None  # reconciliation follows the same rule
    assert (await allocation(engine, reservations[2].allocation_id)).state == "bound"

    await cluster.delete_pod(terminating.metadata.name, grace=0)  # force deletion: the object is gone
    row = await state_becomes(engine, reservations[2], "released", within=10)
    assert row.reason == "pod deleted" and row.terminating_at is not None

    assert await gpu_usage(engine, node) == {node.gpus[0]: 0, node.gpus[1]: 0}
    assert binder.metrics.value("gpushare_binder_released_total", reason="pod_succeeded") == 1


async def _terminating_row(engine, reservation):  # type: ignore[no-untyped-def]
    row = await allocation(engine, reservation.allocation_id)
    return row if row.terminating_at is not None else None


async def test_deleted_node_is_retired(cluster, ledger, engine, start_binder) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    pod = await cluster.pod(gib=2)
    res = await ledger.reserve(request_for(pod, node, gib=2))
    await state_becomes(engine, res, "bound")

    await cluster.core.delete_node(node.name)
    row = await state_becomes(engine, res, "released", within=10)
    assert row.reason == "node deleted"
    from services.binder.reads import gpus_by_index

    async def retired() -> bool:
        return await gpus_by_index(engine, node.name) == {}

    await eventually(retired, what="GPUs retired", within=10)
    assert binder.metrics.value("gpushare_binder_nodes_retired_total") == 1


def _reconciler(ledger: Ledger, kube, grace_s: float = 30.0) -> Reconciler:  # type: ignore[no-untyped-def]
    binder_ledger = Ledger(ledger.engine, prefix=ledger.prefix, source="binder", on_commit=ledger.on_commit)
    return Reconciler(binder_ledger, kube, unit=MemoryUnit.GIB, metrics=BinderMetrics(), grace_s=grace_s)


async def test_reconciliation_releases_orphans(cluster, ledger, engine, kube) -> None:
    node = await cluster.node(ledger)
    alive = await cluster.pod(gib=1, node_name=node.name)
    res_alive = await ledger.reserve(request_for(alive, node, gib=1))
    await ledger.mark_bound(res_alive.allocation_id, alive.metadata.uid, node.name)

    gone = await cluster.pod(gib=2, node_name=node.name)
    res_gone = await ledger.reserve(request_for(gone, node, gib=2))
    await ledger.mark_bound(res_gone.allocation_id, gone.metadata.uid, node.name)
    await cluster.delete_pod(gone.metadata.name, grace=0)

    # same name, new UID: the allocation belongs to the old pod
    renamed = await cluster.pod(gib=1)
    res_renamed = await ledger.reserve(request_for(renamed, node, gib=1, gpu=1))
    await ledger.mark_bound(res_renamed.allocation_id, renamed.metadata.uid, node.name)
    await cluster.delete_pod(renamed.metadata.name, grace=0)
    await eventually(lambda: _gone(cluster, renamed.metadata.name), what="pod deleted")
    await cluster.pod(gib=1, name=renamed.metadata.name)

    ghost = await cluster.pod(gib=4)
    res_young = await ledger.reserve(request_for(ghost, node, gib=4, gpu=1, uid="ghost-uid"))

    rec = _reconciler(ledger, kube, grace_s=30)
    report = await rec.run_once()
    assert report.released == 2 and report.adopted == 0 and not report.conflicts
    assert (await allocation(engine, res_gone.allocation_id)).state == "released"
    assert (await allocation(engine, res_renamed.allocation_id)).state == "released"
    assert (await allocation(engine, res_alive.allocation_id)).state == "bound"
    assert (await allocation(engine, res_young.allocation_id)).state == "reserved"  # within the grace period

    report = await _reconciler(ledger, kube, grace_s=0).run_once()
    assert report.released == 1
    assert (await allocation(engine, res_young.allocation_id)).state == "released"
    assert await gpu_usage(engine, node) == {node.gpus[0]: 1 * GIB, node.gpus[1]: 0}
    assert rec.metrics.value("gpushare_binder_released_total", reason="reconciled") == 2


async def test_reconciliation_adopts_gpushare_and_own_pods(cluster, ledger, engine, kube) -> None:
    node = await cluster.node(ledger)
    legacy = await cluster.pod(gib=4, node_name=node.name, annotations={GPU_MEM_IDX: "1", GPU_MEM_POD: "4"})
    parts = [
        AllocationPart(container="main", container_index=0, gpu_uuid=node.gpus[0], gpu_index=0, memory_mib=3 * GIB)
    ]
    own_id = uuid.uuid4()
    own = await cluster.pod(
        gib=3,
        node_name=node.name,
        annotations=binding_annotations(own_id, node.name, parts, {node.gpus[0]: 16 * GIB}, MemoryUnit.GIB),
    )
    greedy = await cluster.pod(  # created last (and sorts last): the conflict is its
        gib=14,
        node_name=node.name,
        annotations={GPU_MEM_IDX: "1", GPU_MEM_POD: "14"},
        name=f"zz-{uuid.uuid4().hex[:6]}",
    )
    finished = await cluster.pod(gib=2, node_name=node.name, annotations={GPU_MEM_IDX: "0"})
    await cluster.core.patch_namespaced_pod_status(finished.metadata.name, "default", {"status": {"phase": "Failed"}})

    rec = _reconciler(ledger, kube)
    report = await rec.run_once()
    assert report.adopted == 2
    assert len(report.conflicts) == 1 and greedy.metadata.name in report.conflicts[0]
    assert rec.metrics.value("gpushare_binder_adopted_total") == 2
    assert rec.metrics.value("gpushare_binder_conflicts_total", reason="capacity") == 1
    assert await gpu_usage(engine, node) == {node.gpus[0]: 3 * GIB, node.gpus[1]: 4 * GIB}

    async with engine.connect() as conn:
        from sqlalchemy import select

        from shared.ledger.models import allocation_parts, allocations

        rows = {
            r.pod_uid: r
            for r in (
                await conn.execute(
                    select(
                        allocations.c.id, allocations.c.pod_uid, allocations.c.state, allocation_parts.c.gpu_uuid
                    ).join(allocation_parts, allocation_parts.c.allocation_id == allocations.c.id)
                )
            ).all()
        }
    assert rows[legacy.metadata.uid].state == "bound" and rows[legacy.metadata.uid].gpu_uuid == node.gpus[1]
    assert rows[own.metadata.uid].id == own_id and rows[own.metadata.uid].state == "bound"
    assert greedy.metadata.uid not in rows and finished.metadata.uid not in rows

    again = await rec.run_once()  # idempotent; the conflict is reported again, not dropped
    assert again.adopted == 0 and again.released == 0 and len(again.conflicts) == 1
    assert rec.metrics.value("gpushare_binder_open_conflicts") == 1
    assert json.loads(own.metadata.annotations[ALLOCATION])["id"] == str(own_id)


def _hostile_annotations(gib: int, index: int = 0) -> dict[str, str]:
    """The five annotations gpushare's extender writes at bind, naming GPU `index` and `gib` GiB."""
    return {
        GPU_MEM_IDX: str(index),
        GPU_MEM_POD: str(gib),
        GPU_MEM_DEV: "16",
        GPU_MEM_ASSIGNED: "true",
        GPU_MEM_ASSUME_TIME: "1767225600000000000",
    }


async def test_a_hostile_pod_obtains_no_share_by_annotating_itself(cluster, ledger, engine, kube) -> None:
    """Anyone who may create pods can set `spec.nodeName` and gpushare's annotations: reconciliation charges only
    what a pod requests, in the shape it requests, within its namespace's quota (issue 33, item 2)."""
    node = await cluster.node(ledger)
    # no GPU request at all, the whole of GPU 0 claimed (before: adopted, 16 GiB charged)
    thief = await cluster.pod(node_name=node.name, annotations=_hostile_annotations(16), limits={})
    # asks for 2 GiB, its own record claims the whole GPU (before: adopted as recorded)
    whole = AllocationPart(container="main", container_index=0, gpu_uuid=node.gpus[0], gpu_index=0, memory_mib=16 * GIB)
    record = binding_annotations(uuid.uuid4(), node.name, [whole], {node.gpus[0]: 16 * GIB}, MemoryUnit.GIB)
    inflated = await cluster.pod(gib=2, node_name=node.name, annotations=record)
    # two GPUs of 4 GiB asked for, one index annotated (before: 8 GiB charged on GPU 0)
    spread = await cluster.pod(
        node_name=node.name,
        annotations=_hostile_annotations(8),
        limits={"aliyun.com/gpu-mem": "8", "aliyun.com/gpu-count": "2"},
    )
    # an honest gpushare pod, with a compute share (before: adopted with 0 % compute)
    honest = await cluster.pod(
        node_name=node.name,
        annotations=_hostile_annotations(3, index=1),
        limits={"aliyun.com/gpu-mem": "3", "aliyun.com/gpu-core": "30"},
    )

    rec = _reconciler(ledger, kube)
    report = await rec.run_once()
    assert report.adopted == 1, report
    assert sorted(c.split(":")[0] for c in report.conflicts) == sorted(
        f"default/{p.metadata.name}" for p in (thief, inflated, spread)
    ), report.conflicts
    assert rec.metrics.value("gpushare_binder_conflicts_total", reason="no_request") == 1
    assert rec.metrics.value("gpushare_binder_conflicts_total", reason="shape") == 2
    assert await gpu_usage(engine, node) == {node.gpus[0]: 0, node.gpus[1]: 3 * GIB}
    async with engine.connect() as conn:
        held = select(allocations.c.pod_uid, allocations.c.memory_mib, allocations.c.compute)
        assert [tuple(r) for r in (await conn.execute(held)).all()] == [(honest.metadata.uid, 3 * GIB, 30)]


async def test_adoption_counts_against_the_namespace_quota(cluster, ledger, engine, kube) -> None:
    node = await cluster.node(ledger)
    await ledger.record(QuotaEvent(namespace=cluster.namespace, memory_mib=6 * GIB))
    first = await cluster.pod(gib=4, node_name=node.name, annotations=_hostile_annotations(4), name="a-first")
    second = await cluster.pod(gib=4, node_name=node.name, annotations=_hostile_annotations(4, 1), name="b-second")
    rec = _reconciler(ledger, kube)
    report = await rec.run_once()
    assert report.adopted == 1 and len(report.conflicts) == 1 and second.metadata.name in report.conflicts[0]
    assert "quota" in report.conflicts[0] and rec.metrics.value("gpushare_binder_conflicts_total", reason="quota") == 1
    assert await gpu_usage(engine, node) == {node.gpus[0]: 4 * GIB, node.gpus[1]: 0}
    async with engine.connect() as conn:
        assert (await conn.execute(select(allocations.c.pod_uid))).scalars().all() == [first.metadata.uid]
