"""Accounting's projections of DRA allocations (`claim_reserved`, docs/dra.md) are those of extender allocations:
the timeline's first step is `reserved` (its detail names the claim), `gpushare_reserved_to_bound_seconds` is observed
when the pod binds, and a reservation clears older refusals, whether the events come in one batch or several."""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting import projections
from services.accounting.projections import Projector
from shared.events.catalogue import AllocationPart, BoundEvent, ClaimReservedEvent, ClaimResult, Event

from .test_bulk_projections import BASE, _compare, _reset, _snapshot, refused

ALLOCATION = uuid.uuid5(uuid.NAMESPACE_OID, "dra-allocation")


def claim_reserved(at_s: float) -> ClaimReservedEvent:
    part = AllocationPart(container="main", container_index=0, gpu_uuid="GPU-0", gpu_index=0, memory_mib=4096)
    return ClaimReservedEvent(
        allocation_id=ALLOCATION,
        pod_uid="pod-dra",
        namespace="ns",
        pod_name="pod-dra",
        node="node-0",
        parts=[part],
        claim_uid="claim-uid",
        claim_name="pod-dra-gpushare-x7k2p",
        results=[ClaimResult(request="main", device="gpu-0", share_id="s1")],
        occurred_at=BASE + timedelta(seconds=at_s),
    )


def bound(at_s: float) -> BoundEvent:
    return BoundEvent(
        allocation_id=ALLOCATION, pod_uid="pod-dra", node="node-0", occurred_at=BASE + timedelta(seconds=at_s)
    )


async def test_a_claim_allocation_is_a_reserved_step_with_its_latency_in_one_batch(engine: AsyncEngine) -> None:
    await _reset(engine)
    seen: list[tuple[str, float]] = []
    projector = Projector(engine, on_latency=lambda name, s: seen.append((name, s)))
    assert await projector.handle_many([refused("pod-dra", BASE, "no device"), claim_reserved(1), bound(6)]) == 3
    assert seen == [("reserved_to_bound", 5.0)]
    rows = await _snapshot(engine)
    assert [(r[3], r[4], r[6]) for r in rows["timeline"]] == [
        ("node-0", "reserved", "claim pod-dra-gpushare-x7k2p"),
        ("node-0", "bound", ""),
    ]
    assert rows["pending"] == []


async def test_across_batches_the_claim_reservation_is_found_again(engine: AsyncEngine) -> None:
    """The bound event and a stale refusal arrive in later batches: the read models must answer for the claim's
    reservation as for any other (first step for the latency, latest reservation for the refusal)."""
    await _reset(engine)
    seen: list[tuple[str, float]] = []
    projector = Projector(engine, on_latency=lambda name, s: seen.append((name, s)))
    await projector.handle_many([claim_reserved(1)])
    await projector.handle_many([bound(3)])
    await projector.handle_many([refused("pod-dra", BASE, "older than the reservation")])
    assert seen == [("reserved_to_bound", 2.0)]
    assert (await _snapshot(engine))["pending"] == []


async def test_bulk_equals_one_by_one_for_claim_allocations(engine: AsyncEngine) -> None:
    reservation = claim_reserved(1)
    batches: list[list[Event]] = [[reservation], [refused("pod-dra", BASE), bound(4)], [reservation]]  # redelivered
    await _reset(engine)
    async with engine.begin() as conn:
        results = await projections.apply_many(conn, [e for b in batches for e in b])
    assert [r.new for r in results] == [True, True, True, False]
    await _compare(engine, batches)
