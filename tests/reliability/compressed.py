"""A cluster's life in compressed time: a fake clock, the real ledger with its outbox relay, accounting's two
durable consumers and its housekeeping, all on the test's PostgreSQL and NATS. Every event carries the fake
clock's time, claims are stamped with it, and housekeeping prunes by it, so a simulated week takes seconds."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy import table as table_clause
from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting.housekeeping import Housekeeper, Retention
from services.accounting.projections import Projector
from services.accounting.tables import CONSUMER, SAMPLES_CONSUMER
from shared.events.bus import EventBus
from shared.events.catalogue import (
    AllocationPart,
    AssignedEvent,
    BoundEvent,
    Event,
    ExchangedEvent,
    GpuInfo,
    HealthEvent,
    InventoryEvent,
    QuotaEvent,
    RefusedEvent,
    ReleasedEvent,
    ReservedEvent,
    UsageEvent,
    UsageSample,
)
from shared.events.consumer import DurableConsumer
from shared.ledger.ledger import Ledger, LedgerEvent
from shared.ledger.outbox import OutboxRelay
from shared.ledger.replay import wait_for_quiet
from shared.ledger.reservations import ReservationError
from tests.waiting import eventually

START = datetime(2026, 3, 2, tzinfo=UTC)
GIB = 1024


class FakeClock:
    """Time that moves only when told."""

    def __init__(self, start: datetime = START) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        """Move on by `timedelta(**delta)`; returns the new time."""
        self.now += timedelta(**delta)
        return self.now


@dataclass
class Cluster:
    """Nodes with GPUs, pods coming and going, usage samples: every change through the real ledger."""

    engine: AsyncEngine
    bus: EventBus
    ledger: Ledger
    relay: OutboxRelay
    clock: FakeClock
    housekeeper: Housekeeper
    consumers: list[DurableConsumer]
    rng: random.Random
    nodes: int = 2
    gpus_per_node: int = 2
    live: dict[uuid.UUID, ReservedEvent] = field(default_factory=dict)
    published: list[Event] = field(default_factory=list)

    def gpu(self, node: int, index: int) -> str:
        return f"GPU-{node}-{index}"

    async def record(self, event: LedgerEvent) -> object:
        """Apply a ledger event (stamped by the fake clock) and keep it for the test's bookkeeping."""
        self.published.append(event)
        return await self.ledger.record(event)

    async def publish(self, event: Event) -> None:
        """Publish a sample (usage or refusal) as the node agent or the extender does."""
        self.published.append(event)
        await self.bus.publish(event)

    async def inventory(self) -> None:
        for n in range(self.nodes):
            gpus = [
                GpuInfo(uuid=self.gpu(n, i), index=i, model="Tesla-T4", memory_mib=16 * GIB, memory_total_mib=16 * GIB)
                for i in range(self.gpus_per_node)
            ]
            await self.record(InventoryEvent(node=f"node-{n}", gpus=gpus, occurred_at=self.clock()))

    async def place(
        self, node: int | None = None, gpu: int | None = None, gib: int | None = None
    ) -> ReservedEvent | None:
        """Reserve, bind and assign a pod (1-4 GiB on a random GPU unless told) (None when it does not fit)."""
        n = self.rng.randrange(self.nodes) if node is None else node
        i = self.rng.randrange(self.gpus_per_node) if gpu is None else gpu
        a_id = uuid.UUID(int=self.rng.getrandbits(128))  # ids from the seed: the same run every time
        pod = f"pod-{a_id.hex[:8]}"
        part = AllocationPart(
            container="main",
            container_index=0,
            gpu_uuid=self.gpu(n, i),
            gpu_index=i,
            memory_mib=(gib or self.rng.choice([1, 2, 4])) * GIB,
        )
        reserved = ReservedEvent(
            allocation_id=a_id,
            pod_uid=pod,
            namespace=self.rng.choice(["team-a", "team-b"]),
            pod_name=pod,
            node=f"node-{n}",
            parts=[part],
            occurred_at=self.clock(),
        )
        try:
            await self.record(reserved)
        except ReservationError:
            self.published.pop()
            await self.publish(
                RefusedEvent(
                    pod_uid=pod,
                    namespace=reserved.namespace,
                    pod_name=pod,
                    summary="no GPU has room",
                    occurred_at=self.clock(),
                )
            )
            return None
        await self.record(BoundEvent(allocation_id=a_id, pod_uid=pod, node=reserved.node, occurred_at=self.clock()))
        await self.record(
            AssignedEvent(
                allocation_id=a_id,
                pod_uid=pod,
                node=reserved.node,
                container="main",
                gpu_uuids=[part.gpu_uuid],
                occurred_at=self.clock(),
            )
        )
        self.live[a_id] = reserved
        return reserved

    async def exchange(self, first: ReservedEvent, second: ReservedEvent) -> ExchangedEvent:
        """Swap two live pods' equal shares on one node (the node agent's correction); returns the staged event."""
        ask = ExchangedEvent(
            node=first.node,
            first_allocation_id=first.allocation_id,
            first_container="main",
            second_allocation_id=second.allocation_id,
            second_container="main",
            occurred_at=self.clock(),
        )
        staged = await self.record(ask)
        assert isinstance(staged, ExchangedEvent) and staged.moves
        self.published[-1] = staged
        return staged

    async def end(self, allocation_id: uuid.UUID | None = None) -> None:
        """Release a live pod (a random one unless told)."""
        if not self.live:
            return
        a_id = self.rng.choice(sorted(self.live)) if allocation_id is None else allocation_id
        r = self.live.pop(a_id)
        await self.record(
            ReleasedEvent(
                allocation_id=a_id, pod_uid=r.pod_uid, node=r.node, reason="pod deleted", occurred_at=self.clock()
            )
        )

    async def flap(self) -> None:
        """A GPU goes unhealthy or recovers; a quota changes."""
        n, i = self.rng.randrange(self.nodes), self.rng.randrange(self.gpus_per_node)
        healthy = self.rng.random() < 0.7
        await self.record(
            HealthEvent(
                node=f"node-{n}",
                gpu_uuid=self.gpu(n, i),
                healthy=healthy,
                reason="" if healthy else "XID 79",
                occurred_at=self.clock(),
            )
        )
        await self.record(
            QuotaEvent(namespace="team-a", memory_mib=self.rng.choice([24, 32, 48]) * GIB, occurred_at=self.clock())
        )

    async def sample(self) -> None:
        """One usage event per node: what each live pod on it uses."""
        events = []
        for n in range(self.nodes):
            node = f"node-{n}"
            samples = [
                UsageSample(
                    gpu_uuid=r.parts[0].gpu_uuid,
                    pod_uid=r.pod_uid,
                    namespace=r.namespace,
                    pod_name=r.pod_name,
                    container="main",
                    used_memory_mib=self.rng.randrange(r.parts[0].memory_mib + 1),
                    utilization_pct=self.rng.random() * 100,
                )
                for r in self.live.values()
                if r.node == node
            ] or [UsageSample(gpu_uuid=self.gpu(n, 0), used_memory_mib=0)]
            events.append(UsageEvent(node=node, samples=samples, occurred_at=self.clock()))
        await asyncio.gather(*map(self.publish, events))

    async def settle(self) -> None:
        """Wait until every ledger change is in the stream and both accounting consumers applied everything."""
        await wait_for_quiet(self.engine)
        names = self.bus.names

        async def caught_up() -> bool:
            for stream, durable in ((names.stream, CONSUMER), (names.samples_stream, SAMPLES_CONSUMER)):
                last = (await self.bus.js.stream_info(stream)).state.last_seq
                info = await self.bus.js.consumer_info(stream, durable)
                if info.delivered.stream_seq < last or info.num_ack_pending:
                    return False
            return True

        await eventually(caught_up, what="accounting to apply every event", within=60)

    async def count(self, table: str) -> int:
        """Rows in a table."""
        async with self.engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(table_clause(table)))).scalar_one())


@asynccontextmanager
async def compressed_cluster(
    engine: AsyncEngine, bus: EventBus, retention: Retention, *, seed: int = 7, snapshot_keep: int = 2
) -> AsyncIterator[Cluster]:
    """A `Cluster` with its relay, accounting consumers and housekeeper running until the block ends."""
    clock = FakeClock()
    stop = asyncio.Event()
    relay = OutboxRelay(engine, bus, poll_s=0.05)
    ledger = Ledger(engine, prefix=bus.names.prefix, source="week", on_commit=relay.kick)
    projector = Projector(engine, clock=clock)
    consumers = [
        DurableConsumer(bus, durable, projector.handle, batch_handler=projector.handle_many, batch=256, stream=stream)
        for durable, stream in ((CONSUMER, bus.names.stream), (SAMPLES_CONSUMER, bus.names.samples_stream))
    ]
    housekeeper = Housekeeper(engine, bus, retention, snapshot_keep=snapshot_keep, clock=clock)
    tasks = [asyncio.create_task(relay.run(stop)), *(asyncio.create_task(c.run(stop)) for c in consumers)]
    try:
        yield Cluster(engine, bus, ledger, relay, clock, housekeeper, consumers, random.Random(seed))
    finally:
        await stop_tasks(stop, tasks)


async def stop_tasks(stop: asyncio.Event, tasks: list[asyncio.Task[None]], timeout_s: float = 5.0) -> None:
    """Set `stop`, give the tasks `timeout_s` to finish (consumers end their fetch), then cancel the rest."""
    stop.set()
    await asyncio.wait(tasks, timeout=timeout_s)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
