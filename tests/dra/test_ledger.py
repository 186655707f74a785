"""Recording DRA claims in the ledger, against real PostgreSQL and NATS: the same CHECK-guarded statements as the
extender's reservations, one allocation per claim allocation, refusals that write nothing, no GPU served by both
paths, and the `claim_reserved` event replayed and snapshotted into the same ledger."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.dra.claims import read_claim
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart, ClaimReservedEvent, InventoryEvent, QuotaEvent, decode_event
from shared.ledger.claims import ClaimAllocationEnded, PathConflict
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, gpus, nodes, outbox
from shared.ledger.outbox import OutboxRelay
from shared.ledger.replay import differences, load_state, replay_state, wait_for_quiet
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, ReservationError, ReservationRequest
from shared.ledger.snapshot import Snapshot, decode_snapshot, encode_snapshot
from shared.settings import MemoryUnit
from tests.dra.objects import claim, gpu, ledger_gpus, pod, request

NODE = "dra-node"
GPUS = [gpu(NODE, 0), gpu(NODE, 1)]


def claim_event(memory: str = "4Gi", *, namespace: str = "team", g: int = 0, compute: str = "0") -> ClaimReservedEvent:
    """The event the binder records for a one-container pod whose claim got `memory` of GPU `g`."""
    name = f"p-{uuid.uuid4().hex[:6]}"
    p = pod(name, [("main", "r")], namespace=namespace)
    c = claim(f"{name}-gpushare", namespace, [request("r", memory)], [("r", GPUS[g], memory, compute)], node=NODE)
    c["status"]["reservedFor"] = [{"resource": "pods", "name": name, "uid": p["metadata"]["uid"]}]
    return read_claim(c, p, ledger_gpus(GPUS), MemoryUnit.GIB).event(source="test")


async def _dra_node(ledger: Ledger, node: str = NODE, allocator: str = "dra") -> None:
    gpus_of = GPUS if node == NODE else [gpu(node, 0)]
    await ledger.record(InventoryEvent(node=node, gpus=gpus_of, allocator=allocator))  # type: ignore[arg-type]


async def _counters(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(gpus.c.uuid, gpus.c.allocated_memory_mib))).all()
    return {r.uuid: r.allocated_memory_mib for r in rows}


async def _staged_kinds(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(outbox.c.payload).order_by(outbox.c.seq))).all()
    return [decode_event(r.payload).kind for r in rows]


async def test_a_claim_is_recorded_once_with_its_claim_and_its_own_event(engine: AsyncEngine) -> None:
    ledger = Ledger(engine, prefix="t")
    await _dra_node(ledger)
    event = claim_event("4Gi")
    first = await ledger.reserve_claim(event)
    again = await ledger.reserve_claim(event)  # a repeated watch event, a restarted binder
    assert first.created and not again.created and again.allocation_id == first.allocation_id
    assert (await _counters(engine))[GPUS[0].uuid] == 4096
    async with engine.connect() as conn:
        row = (await conn.execute(select(allocations).where(allocations.c.id == event.allocation_id))).one()
        allocator = (await conn.execute(select(nodes.c.allocator).where(nodes.c.name == NODE))).scalar()
    assert (row.claim_uid, row.claim_name, row.state) == (event.claim_uid, event.claim_name, "reserved")
    assert allocator == "dra"
    assert (await _staged_kinds(engine)).count("claim_reserved") == 1


@pytest.mark.parametrize("case", ["capacity", "extender_node", "extender_share", "ended", "second"])
async def test_a_refusal_writes_nothing(engine: AsyncEngine, case: str) -> None:
    ledger = Ledger(engine, prefix="t")
    await _dra_node(ledger)
    event = claim_event("4Gi")
    expected: type[Exception] = ReservationError
    if case == "capacity":
        event = claim_event("16Gi")
        await ledger.reserve_claim(claim_event("4Gi"))
        expected = InsufficientCapacity
    elif case == "extender_node":
        await _dra_node(ledger, NODE, "extender")  # the node's agent went back to the device plugins
        expected = PathConflict
    elif case == "extender_share":
        part = AllocationPart(container="c", container_index=0, gpu_uuid=GPUS[0].uuid, gpu_index=0, memory_mib=1024)
        await ledger.reserve(
            ReservationRequest(pod_uid="old", namespace="team", pod_name="old", node=NODE, parts=(part,))
        )
        expected = PathConflict
    elif case == "ended":
        await ledger.reserve_claim(event)
        await ledger.mark_failed(event.allocation_id, event.pod_uid, NODE, "claim deallocated")
        expected = ClaimAllocationEnded
    elif case == "second":  # the claim holds a live allocation: a new one of the same claim waits for its end
        await ledger.reserve_claim(event)
        event = event.model_copy(update={"allocation_id": uuid.uuid4(), "event_id": uuid.uuid4()})
    before_counters, before_kinds = await _counters(engine), await _staged_kinds(engine)
    with pytest.raises(expected) as refused:
        await ledger.reserve_claim(event)
    assert str(refused.value)
    assert await _counters(engine) == before_counters
    assert await _staged_kinds(engine) == before_kinds
    if case == "extender_share":
        assert "scheduler extender placed" in str(refused.value) and "team/old" in str(refused.value)


async def test_a_claim_is_recorded_whatever_the_quota_says_now(engine: AsyncEngine) -> None:
    """A claim took its namespace's quota when it was created (gpushare admission): recording the allocation
    kube-scheduler made checks capacity, not the quota again (a quota lowered since admits it all the same)."""
    ledger = Ledger(engine, prefix="t")
    await _dra_node(ledger)
    await ledger.record(QuotaEvent(namespace="team", memory_mib=2048))
    assert (await ledger.reserve_claim(claim_event("4Gi"))).created
    assert (await _counters(engine))[GPUS[0].uuid] == 4096
    # the extender path's reservations still answer to the quota, which the claim's allocation now fills
    part = AllocationPart(container="c", container_index=0, gpu_uuid=GPUS[1].uuid, gpu_index=1, memory_mib=1024)
    with pytest.raises(QuotaExceeded):
        await ledger.reserve(ReservationRequest(pod_uid="x", namespace="team", pod_name="x", node=NODE, parts=(part,)))


async def test_racing_claims_never_overcommit_a_gpu(engine: AsyncEngine) -> None:
    """Twelve 4 GiB claims on one 16 GiB GPU, recorded concurrently on a pool of connections: four win."""
    ledger = Ledger(engine, prefix="t")
    await _dra_node(ledger)
    events = [claim_event("4Gi") for _ in range(12)]
    results = await asyncio.gather(*(ledger.reserve_claim(e) for e in events), return_exceptions=True)
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 4 and all(isinstance(r, InsufficientCapacity) for r in lost)
    assert (await _counters(engine))[GPUS[0].uuid] == 16384


async def test_claims_replay_and_snapshot_into_the_same_ledger(engine: AsyncEngine, bus: EventBus) -> None:
    relay = OutboxRelay(engine, bus, poll_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    ledger = Ledger(engine, prefix=bus.names.prefix, source="test", on_commit=relay.kick)
    await _dra_node(ledger)
    kept, released = claim_event("4Gi", compute="30"), claim_event("8Gi", g=1)
    for e in (kept, released):
        await ledger.reserve_claim(e)
    await ledger.mark_bound(kept.allocation_id, kept.pod_uid, NODE)
    await ledger.mark_assigned(kept.allocation_id, kept.pod_uid, NODE, "main", [GPUS[0].uuid])
    await ledger.release(released.allocation_id, released.pod_uid, NODE, "claim deallocated")
    await wait_for_quiet(engine)
    stop.set()
    await task
    replayed, _ = await replay_state(bus)
    async with engine.connect() as conn:
        live = await load_state(conn)
    assert differences(live, replayed) == []
    row = replayed.allocations[kept.allocation_id]
    assert (row.claim_uid, row.claim_name, row.state.value) == (kept.claim_uid, kept.claim_name, "assigned")
    assert replayed.nodes[NODE].allocator == "dra"
    assert (
        replayed.gpus[GPUS[0].uuid].allocated_memory_mib == 4096
        and replayed.gpus[GPUS[1].uuid].allocated_memory_mib == 0
    )
    back = decode_snapshot(encode_snapshot(Snapshot(replayed, "S", 9, datetime.now(UTC)))).state
    assert differences(replayed, back) == [] and back.allocations[kept.allocation_id].claim_uid == kept.claim_uid
