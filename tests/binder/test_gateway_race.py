"""An inventory that shrinks or removes a GPU, sent by a node agent through the binder's gateway while the
extender reserves shares of that very GPU: real concurrent transactions on the real PostgreSQL, the command
over real NATS. Every inventory is applied (never a CHECK violation or a refusal), every reservation either
holds or is refused for capacity, the GPU never holds more than its capacity, and a replay equals the ledger."""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from services.node_agent.ledger_link import LedgerLink
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.ledger.replay import differences, load_state, replay_state, wait_for_quiet
from shared.ledger.reservations import InsufficientCapacity, Reservation, ReservationRequest
from tests.node_agent import conftest as node_agent_fixtures
from tests.reliability.test_crash import _record

gateway = node_agent_fixtures.gateway  # the binder's gateway answering over NATS, with an outbox relay

NODE = "shrinking"
GIB = 1024
ROUNDS = 12
RESERVATIONS = 8  # 2 GiB each on GPU 0 (16 GiB), racing an inventory that shrinks it to 8 GiB or removes it


def _inventory(gpu0_gib: int | None, *, round_: int) -> InventoryEvent:
    gpus = [GpuInfo(uuid="G1", index=1, memory_mib=16 * GIB, memory_total_mib=16 * GIB)]
    if gpu0_gib is not None:
        gpus.append(GpuInfo(uuid="G0", index=0, memory_mib=gpu0_gib * GIB, memory_total_mib=gpu0_gib * GIB))
    return InventoryEvent(node=NODE, gpus=gpus, driver_version=f"r{round_}")


def _request() -> ReservationRequest:
    part = AllocationPart(container="c", container_index=0, gpu_uuid="G0", gpu_index=0, memory_mib=2 * GIB)
    uid = str(uuid.uuid4())
    return ReservationRequest(pod_uid=uid, namespace="ns", pod_name=uid[:8], node=NODE, parts=(part,))


async def test_inventory_shrinks_racing_reservations_are_applied_safely(
    gateway: tuple[Ledger, OutboxRelay], engine: AsyncEngine, bus: EventBus
) -> None:
    ledger, link = gateway[0], LedgerLink(bus, NODE)  # the gateway answers over NATS, as for a node agent
    outcomes = {"reserved": 0, "refused": 0, "old_capacity_kept": 0}
    for round_ in range(ROUNDS):
        # back to a healthy 16 GiB GPU 0 with nothing on it
        async with engine.connect() as conn:
            live = [a for a in (await load_state(conn)).allocations.items() if a[1].state.value != "released"]
        for a_id, alloc in live:
            await ledger.release(a_id, alloc.pod_uid, NODE, "round over")
        assert (await link.send(_inventory(16, round_=round_), deadline_s=10)).ok
        shrink = _inventory(None if round_ % 3 == 2 else 8, round_=round_)

        async def reserve() -> Reservation | InsufficientCapacity:
            try:
                return await ledger.reserve(_request())
            except InsufficientCapacity as exc:
                return exc

        results = await asyncio.gather(
            *(reserve() for _ in range(RESERVATIONS // 2)),
            link.send(shrink, deadline_s=10),
            *(reserve() for _ in range(RESERVATIONS // 2)),
        )
        reply = results[RESERVATIONS // 2]
        assert reply.ok, f"round {round_}: the inventory was refused: {reply.error}"
        assert all(isinstance(r, Reservation | InsufficientCapacity) for r in results if r is not reply)
        outcomes["reserved"] += sum(isinstance(r, Reservation) for r in results)
        outcomes["refused"] += sum(isinstance(r, InsufficientCapacity) for r in results)
        async with engine.connect() as conn:
            state = await load_state(conn)
        gpu = state.gpus["G0"]
        assert gpu.allocated_memory_mib <= gpu.memory_mib
        if shrink.gpus[-1].uuid == "G0" and gpu.allocated_memory_mib > 8 * GIB:
            # reservations won the race: the old capacity stays and the GPU is unhealthy
            outcomes["old_capacity_kept"] += 1
            assert (gpu.memory_mib, gpu.healthy) == (16 * GIB, False)
            assert gpu.health_reason == "reported memory below allocated memory"
    await wait_for_quiet(engine)
    async with engine.connect() as conn:
        live_state = await load_state(conn)
    replayed, _ = await replay_state(bus)
    assert differences(live_state, replayed) == []
    _record("inventory-shrink-race", rounds=ROUNDS, reservations=ROUNDS * RESERVATIONS, **outcomes)
