"""An inventory that reports less than a GPU's live allocations hold: memory and compute follow one rule
(`shared.ledger.gpu_rules.recorded`), in the ledger's tables, in the ledger folded from its events and in the
extender's view."""

from __future__ import annotations

from types import SimpleNamespace

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.view import ClusterView
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent, decode_event
from shared.ledger.gpu_rules import (
    AGENT_UNHEALTHY,
    COMPUTE_BELOW_ALLOCATED,
    MEMORY_BELOW_ALLOCATED,
    recorded,
)
from shared.ledger.ledger import Ledger
from shared.ledger.models import outbox
from shared.ledger.replay import differences, load_state
from shared.ledger.reservations import ReservationRequest
from shared.ledger.state import LedgerState

NODE = "node-a"
GIB = 1024


def _gpu(index: int, memory_gib: int = 16, compute: int = 100, healthy: bool = True) -> GpuInfo:
    return GpuInfo(
        uuid=f"GPU-{index}",
        index=index,
        model="Tesla-T4",
        memory_mib=memory_gib * GIB,
        memory_total_mib=memory_gib * GIB,
        compute_units=compute,
        healthy=healthy,
    )


def _inventory(*gpus: GpuInfo) -> InventoryEvent:
    return InventoryEvent(node=NODE, driver_version="550", cuda_version="12.4", gpus=list(gpus))


def test_the_rule_keeps_the_old_capacity_of_each_dimension_that_falls_below_what_is_held() -> None:
    held = SimpleNamespace(
        memory_mib=16 * GIB,
        memory_total_mib=16 * GIB,
        compute_units=100,
        allocated_memory_mib=8 * GIB,
        allocated_compute=60,
    )
    assert recorded(_gpu(0), None) == (16 * GIB, 16 * GIB, 100, True, "")
    assert recorded(_gpu(0, healthy=False), held) == (16 * GIB, 16 * GIB, 100, False, AGENT_UNHEALTHY)
    assert recorded(_gpu(0, memory_gib=8, compute=60), held) == (8 * GIB, 8 * GIB, 60, True, "")  # all still fits
    assert recorded(_gpu(0, memory_gib=4), held) == (16 * GIB, 16 * GIB, 100, False, MEMORY_BELOW_ALLOCATED)
    assert recorded(_gpu(0, memory_gib=24, compute=50), held) == (
        24 * GIB,
        24 * GIB,
        100,
        False,
        COMPUTE_BELOW_ALLOCATED,
    )
    both = recorded(_gpu(0, memory_gib=4, compute=50, healthy=False), held)
    assert both == (16 * GIB, 16 * GIB, 100, False, f"{MEMORY_BELOW_ALLOCATED}; {COMPUTE_BELOW_ALLOCATED}")
    assert both.below_allocated and not recorded(_gpu(0, healthy=False), held).below_allocated


async def _staged(engine: AsyncEngine) -> list:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(outbox.c.payload).order_by(outbox.c.seq))).all()
    return [decode_event(r.payload) for r in rows]


async def test_fewer_compute_units_than_allocated_keep_the_gpu_and_the_rest_of_the_inventory(
    engine: AsyncEngine,
) -> None:
    """Before the rule covered compute, the CHECK `ck_gpus_compute_fits` refused the whole inventory: the new GPU
    1 of the same report was never recorded."""
    ledger = Ledger(engine, prefix="gsrules", source="test")
    await ledger.record(_inventory(_gpu(0)))
    part = AllocationPart(
        container="main", container_index=0, gpu_uuid="GPU-0", gpu_index=0, memory_mib=GIB, compute=60
    )
    await ledger.reserve(ReservationRequest(pod_uid="p1", namespace="ns", pod_name="p1", node=NODE, parts=(part,)))
    await ledger.record(_inventory(_gpu(0, compute=50), _gpu(1)))
    async with engine.connect() as conn:
        live = await load_state(conn)
    gpu = live.gpus["GPU-0"]
    assert (gpu.compute_units, gpu.allocated_compute, gpu.memory_mib) == (100, 60, 16 * GIB)
    assert (gpu.healthy, gpu.health_reason) == (False, COMPUTE_BELOW_ALLOCATED)
    assert live.gpus["GPU-1"].healthy and not live.gpus["GPU-1"].retired
    replayed = LedgerState()
    for event in await _staged(engine):
        replayed.apply(event)
    assert not differences(live, replayed)
    # the capacity comes back: the report is taken as it is again
    await ledger.record(_inventory(_gpu(0, compute=80), _gpu(1)))
    async with engine.connect() as conn:
        gpu = (await load_state(conn)).gpus["GPU-0"]
    assert (gpu.compute_units, gpu.healthy, gpu.health_reason) == (80, True, "")


async def test_the_extender_view_applies_the_ledgers_rule_to_a_shrunken_gpu(engine: AsyncEngine) -> None:
    """Before: the view took the agent's health flag and clamped memory to what was allocated (8 GiB, healthy),
    while the ledger kept 16 GiB and marked the GPU unhealthy; the view also took 50 compute units below 60 held."""
    ledger = Ledger(engine, prefix="gsrules", source="test")
    await ledger.record(_inventory(_gpu(0), _gpu(1)))
    for i, (memory, compute) in enumerate([(8 * GIB, 0), (GIB, 60)]):
        part = AllocationPart(
            container="main", container_index=0, gpu_uuid=f"GPU-{i}", gpu_index=i, memory_mib=memory, compute=compute
        )
        await ledger.reserve(
            ReservationRequest(pod_uid=f"p{i}", namespace="ns", pod_name="p", node=NODE, parts=(part,))
        )
    await ledger.record(_inventory(_gpu(0, memory_gib=4), _gpu(1, compute=50)))
    from_events = ClusterView()
    for event in await _staged(engine):
        from_events.apply(event)
    reloaded = ClusterView()
    await reloaded.reload(engine)
    async with engine.connect() as conn:
        live = await load_state(conn)
    expected = {
        u: (g.memory_mib, g.allocated_memory_mib, g.compute_units, g.allocated_compute, g.healthy)
        for u, g in live.gpus.items()
    }
    assert expected == {"GPU-0": (16 * GIB, 8 * GIB, 100, 0, False), "GPU-1": (16 * GIB, GIB, 100, 60, False)}
    for view in (from_events, reloaded):
        said = {
            g.uuid: (g.memory_mib, g.allocated_memory_mib, g.compute_units, g.allocated_compute, g.healthy)
            for g in view.nodes[NODE].gpus
        }
        assert said == expected
