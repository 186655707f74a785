"""Regressions found by the ledger state machine (kept as focused tests)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import AllocationPart, InventoryEvent
from shared.ledger.ledger import Ledger
from shared.ledger.replay import load_state
from shared.ledger.reservations import ReservationRequest
from tests.reliability.test_ledger_stateful import GPU_MIB, _gpu


async def test_inventory_shrinking_below_allocated_memory_keeps_the_gpu(engine: AsyncEngine) -> None:
    """Found by the state machine: a node agent reporting shrunken memory must not break the ledger."""
    ledger = Ledger(engine, prefix="gsrel", source="stateful")
    await ledger.record(InventoryEvent(node="node-a", gpus=[_gpu("node-a", 0)]))
    part = AllocationPart(container="c0", container_index=0, gpu_uuid="GPU-node-a-0", gpu_index=0, memory_mib=8192)
    await ledger.reserve(ReservationRequest(pod_uid="p1", namespace="ns", pod_name="p1", node="node-a", parts=(part,)))
    await ledger.record(InventoryEvent(node="node-a", gpus=[_gpu("node-a", 0, memory_mib=2048)]))
    async with engine.connect() as conn:
        state = await load_state(conn)
    gpu = state.gpus["GPU-node-a-0"]
    assert (gpu.memory_mib, gpu.allocated_memory_mib, gpu.healthy) == (GPU_MIB, 8192, False)
