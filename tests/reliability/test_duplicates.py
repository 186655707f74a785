"""A repeated event is applied once, whatever the gap between the copies.

The outbox relay republishes a whole batch when a publish or its commit fails, and JetStream drops a copy only
within its two-minute window, so after a long database or bus outage copies reach the streams hours after their
originals. Here, copies of every kind (inventory, health, quota, reserved, bound, assigned, exchanged,
released, usage, refused) are published six simulated hours after their originals, some of them after a ledger
snapshot that covers the original, and after later events changed what they describe (a newer inventory, health
and quota, a release after the exchange, the reservation's release). Then: the rebuild from the snapshot and the
rebuild from the first event both equal the live ledger; accounting's read models hold each event once; the
extender's view and each node agent's view, fed the whole stream copies included, agree with the ledger.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting.housekeeping import Retention
from services.extender.view import ClusterView
from services.node_agent.view import NodeView, allocated_by_gpu
from shared.events.bus import EventBus
from shared.events.catalogue import (
    Event,
    GpuInfo,
    HealthEvent,
    InventoryEvent,
    QuotaEvent,
    RefusedEvent,
    UsageEvent,
    encode_event,
    subject_for,
)
from shared.ledger.replay import differences, load_state, read_events
from shared.ledger.rules import is_live
from shared.ledger.snapshots import SnapshotStore, replay_tail, take_snapshot
from shared.ledger.state import LedgerState
from tests.reliability.test_crash import _record

from .compressed import GIB, Cluster, compressed_cluster


async def _copy(world: Cluster, event: Event) -> None:
    """Publish a copy of `event` as a relay would after the dedup window: same body, a message id not seen."""
    subject = subject_for(world.bus.names.prefix, event)
    await world.bus.publish_raw(subject, encode_event(event), f"{event.event_id}-late")


async def _stored(world: Cluster, stream: str) -> list[Event]:
    return [e async for e in read_events(world.bus, stream=stream)]


async def test_copies_hours_apart_are_applied_once_by_replay_and_every_consumer(
    engine: AsyncEngine, bus: EventBus
) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE acc_timeline, acc_pending, usage_samples RESTART IDENTITY"))
    async with compressed_cluster(engine, bus, Retention(), seed=3) as world:
        await world.inventory()
        a = await world.place(node=0, gpu=0, gib=2)
        b = await world.place(node=0, gpu=1, gib=2)
        c = await world.place(node=1, gpu=0, gib=4)
        assert a is not None and b is not None and c is not None
        world.clock.advance(hours=1)
        await world.flap()
        await world.sample()
        await world.place(node=1, gpu=1, gib=64)  # refused: no GPU has 64 GiB
        exchange = await world.exchange(a, b)
        await world.settle()
        # a snapshot that covers the originals; the stream keeps them too, for the rebuild from the first event
        assert (await take_snapshot(bus, trim=False)).written
        originals = [*await _stored(world, bus.names.stream), *await _stored(world, bus.names.samples_stream)]
        timeline_before = await world.count("acc_timeline")

        world.clock.advance(hours=2)  # later events change what the copies describe
        inventory = InventoryEvent(
            node="node-1",
            gpus=[GpuInfo(uuid=world.gpu(1, 0), index=0, memory_mib=16 * GIB, memory_total_mib=16 * GIB)],
            occurred_at=world.clock(),
        )  # GPU-1-1 leaves the node
        await world.record(inventory)
        await world.record(
            HealthEvent(node="node-0", gpu_uuid=world.gpu(0, 0), healthy=True, occurred_at=world.clock())
        )
        await world.record(QuotaEvent(namespace="team-a", memory_mib=8 * GIB, occurred_at=world.clock()))
        await world.end(a.allocation_id)
        await world.end(c.allocation_id)
        await world.settle()
        live_before_copies = (await _live(engine)).canonical()

        world.clock.advance(hours=6)  # the relay's copies of everything above, six hours late
        # copies of the events after the snapshot, then of those before it (a reservation's copy after its release)
        copies = [*world.published[-5:], *originals]
        kinds = {"inventory", "health", "quota", "reserved", "bound", "assigned", "exchanged", "released"}
        assert kinds | {"usage", "refused"} <= {e.kind for e in copies}
        for event in copies:
            await _copy(world, event)
        await world.settle()

        live = await _live(engine)
        assert live.canonical() == live_before_copies, "the copies went to the streams, not to the ledger"
        assert exchange.moves and live.allocations[b.allocation_id].version == 2
        # the ledger: from the newest snapshot plus the tail, and from the first event
        newest = await SnapshotStore(bus).newest()
        assert newest is not None and newest.sequence < (await bus.js.stream_info(bus.names.stream)).state.last_seq
        from_snapshot, stats = await replay_tail(bus, newest)
        assert stats.events > len(originals) // 2 and from_snapshot.duplicates > 0
        assert differences(live, from_snapshot) == []
        from_start, _ = await replay_tail(bus, None)
        assert differences(live, from_start) == [] and from_start.duplicates >= len(originals)

        # accounting: one timeline row per event and allocation, each usage event's samples once
        all_events = [*await _stored(world, bus.names.stream), *await _stored(world, bus.names.samples_stream)]
        distinct = {e.event_id: e for e in all_events}
        usage_rows = sum(len(e.samples) for e in distinct.values() if isinstance(e, UsageEvent))
        assert await world.count("usage_samples") == usage_rows
        async with engine.connect() as conn:
            repeated = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM (SELECT event_id FROM acc_timeline GROUP BY event_id, allocation_id "
                        "HAVING count(*) > 1) x"
                    )
                )
            ).scalar_one()
        assert repeated == 0
        assert await world.count("acc_timeline") == timeline_before + 2  # the two releases after the snapshot
        assert await world.count("acc_pending") == 1

        # the extender's view and each node agent's view, fed every stored event (copies included)
        view = ClusterView()
        agents = {node: NodeView(node) for node in ("node-0", "node-1")}
        for event in [e for e in all_events if not isinstance(e, UsageEvent | RefusedEvent)]:
            view.apply(event)
            node = getattr(event, "node", None)
            if node in agents:
                agents[node].apply(event)
        ledger_gpus = {u: g.allocated_memory_mib for u, g in live.gpus.items() if not g.retired}
        view_gpus = {g.uuid: g.allocated_memory_mib for n in view.nodes.values() for g in n.gpus}
        assert view_gpus == ledger_gpus
        assert set(view.allocations) == {x.pod_uid for x in live.allocations.values() if is_live(x.state)}
        for node, agent in agents.items():
            held = {u: m for u, m in allocated_by_gpu(agent.containers()).items() if m}
            assert held == {u: m for u, m in ledger_gpus.items() if m and live.gpus[u].node == node}
    _record(
        "duplicates",
        copies=len(copies),
        kinds=sorted({e.kind for e in copies}),
        stream_events=len(all_events),
        skipped_from_snapshot=from_snapshot.duplicates,
        skipped_from_start=from_start.duplicates,
        usage_rows=usage_rows,
    )


async def _live(engine: AsyncEngine) -> LedgerState:
    async with engine.connect() as conn:
        return await load_state(conn)
