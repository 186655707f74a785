"""The stream is a complete log of the ledger: replaying it yields the live ledger."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncEngine

from services.cli import main as gpushare
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart, GpuInfo, HealthEvent, InventoryEvent, QuotaEvent
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.ledger.replay import differences, load_state, replay_state, wait_for_quiet, write_state
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, ReservationRequest


async def _busy_ledger(engine: AsyncEngine, bus: EventBus, seed: int = 7) -> Ledger:
    relay = OutboxRelay(engine, bus, poll_s=0.05)
    stop = asyncio.Event()
    relay_task = asyncio.create_task(relay.run(stop))
    ledger = Ledger(engine, prefix=bus.names.prefix, source="test", on_commit=relay.kick)
    rng = random.Random(seed)
    for n in range(3):
        await ledger.record(
            InventoryEvent(
                node=f"node-{n}",
                driver_version="550.54",
                cuda_version="12.4",
                gpus=[
                    GpuInfo(uuid=f"GPU-{n}-{i}", index=i, model="Tesla-T4", memory_mib=15360, memory_total_mib=15360)
                    for i in range(2)
                ],
            )
        )
    await ledger.record(QuotaEvent(namespace="team-a", memory_mib=30 * 1024))
    live: list = []
    for _ in range(60):
        roll = rng.random()
        if live and roll < 0.3:
            r = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                await ledger.release(r.allocation_id, r.pod_uid, r.node, "pod deleted")
            else:  # the claim gate's end: failed while still reserved, else released
                await ledger.end_allocation(r.allocation_id, r.pod_uid, r.node, "claim deallocated")
        elif live and roll < 0.5:
            r = rng.choice(live)
            await ledger.mark_bound(r.allocation_id, r.pod_uid, r.node)
            if rng.random() < 0.5:
                await ledger.mark_assigned(r.allocation_id, r.pod_uid, r.node, "main", [r.parts[0].gpu_uuid])
        else:
            n, i = rng.randrange(3), rng.randrange(2)
            req = ReservationRequest(
                pod_uid=str(uuid.uuid4()),
                namespace=rng.choice(["team-a", "team-b"]),
                pod_name="p",
                node=f"node-{n}",
                owner_kind="Deployment",
                owner_name="bert",
                parts=(
                    AllocationPart(
                        container="main",
                        container_index=0,
                        gpu_uuid=f"GPU-{n}-{i}",
                        gpu_index=i,
                        memory_mib=rng.choice([1024, 2048, 4096]),
                        compute=rng.choice([0, 20]),
                    ),
                ),
            )
            try:
                live.append(await ledger.reserve(req))
            except (InsufficientCapacity, QuotaExceeded):  # a second busy round on the same ledger fills it
                pass
    await ledger.record(HealthEvent(node="node-1", gpu_uuid="GPU-1-1", healthy=False, reason="XID 79"))
    await ledger.retire_node("node-2")
    await wait_for_quiet(engine)
    stop.set()
    await relay_task
    return ledger


async def test_replay_of_the_stream_equals_the_live_ledger(engine: AsyncEngine, bus: EventBus) -> None:
    await _busy_ledger(engine, bus)
    replayed, stats = await replay_state(bus)
    async with engine.connect() as conn:
        live = await load_state(conn)
    assert stats.events > 60
    assert len(live.allocations) > 10
    assert differences(live, replayed) == []


async def test_rebuild_apply_restores_a_lost_ledger(engine: AsyncEngine, bus: EventBus) -> None:
    await _busy_ledger(engine, bus, seed=11)
    async with engine.connect() as conn:
        before = await load_state(conn)
    # lose the ledger, then rebuild it from the stream
    await write_state(engine, type(before)())
    replayed, _ = await replay_state(bus)
    await write_state(engine, replayed)
    async with engine.connect() as conn:
        after = await load_state(conn)
    assert differences(before, after) == []


async def test_cli_rebuild_verifies_against_the_live_ledger(
    engine: AsyncEngine, bus: EventBus, database_url: str, nats_url: str, capsys
) -> None:  # type: ignore[no-untyped-def]
    await _busy_ledger(engine, bus, seed=3)
    args = [
        "ledger",
        "rebuild",
        "--database-url",
        database_url,
        "--nats-url",
        nats_url,
        "--stream-name",
        bus.names.stream,
        "--subject-prefix",
        bus.names.prefix,
        "--log-format",
        "text",
    ]
    code = await asyncio.to_thread(gpushare, args)
    assert code == 0
    assert "ledger verified" in capsys.readouterr().err


@contextlib.asynccontextmanager
async def _ledger_on_two_gpus(engine: AsyncEngine, bus: EventBus) -> AsyncIterator[Ledger]:
    """A ledger publishing to `bus`, with node `n` holding two 16 GiB GPUs (G0, G1); every event it staged is
    published when the block ends."""
    relay = OutboxRelay(engine, bus, poll_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    ledger = Ledger(engine, prefix=bus.names.prefix, on_commit=relay.kick)
    try:
        await ledger.record(
            InventoryEvent(
                node="n",
                gpus=[GpuInfo(uuid=f"G{i}", index=i, memory_mib=16384, memory_total_mib=16384) for i in range(2)],
            )
        )
        yield ledger
        await wait_for_quiet(engine)
    finally:
        stop.set()
        await task


async def test_exchange_swaps_equal_shares_keeps_capacity_and_replays(engine: AsyncEngine, bus: EventBus) -> None:
    import pytest

    from shared.ledger.rules import ExchangeRefused

    def req(gpu: int, memory: int) -> ReservationRequest:
        return ReservationRequest(
            pod_uid=str(uuid.uuid4()),
            namespace="ns",
            pod_name="p",
            node="n",
            parts=(
                AllocationPart(container="c", container_index=0, gpu_uuid=f"G{gpu}", gpu_index=gpu, memory_mib=memory),
            ),
        )

    async with _ledger_on_two_gpus(engine, bus) as ledger:
        a, b, c = (
            await ledger.reserve(req(0, 4096)),
            await ledger.reserve(req(1, 4096)),
            await ledger.reserve(req(1, 2048)),
        )
        assert await ledger.exchange("n", (a.allocation_id, "c"), (b.allocation_id, "c"))
        with pytest.raises(ExchangeRefused, match="different sizes"):
            await ledger.exchange("n", (a.allocation_id, "c"), (c.allocation_id, "c"))
    async with engine.connect() as conn:
        live = await load_state(conn)
    assert live.allocations[a.allocation_id].parts[0].gpu_uuid == "G1"
    assert live.allocations[b.allocation_id].parts[0].gpu_uuid == "G0"
    assert (live.gpus["G0"].allocated_memory_mib, live.gpus["G1"].allocated_memory_mib) == (4096, 6144)
    replayed, _ = await replay_state(bus)
    assert differences(live, replayed) == []


def test_replay_of_an_exchange_and_a_release_published_out_of_order_ends_the_same() -> None:
    from shared.events.catalogue import ExchangedEvent, ReleasedEvent, ReservedEvent
    from shared.ledger.state import LedgerState

    inventory = InventoryEvent(
        node="n", gpus=[GpuInfo(uuid=f"G{i}", index=i, memory_mib=16384, memory_total_mib=16384) for i in range(2)]
    )
    a, b = uuid.uuid4(), uuid.uuid4()
    reserved = [
        ReservedEvent(
            allocation_id=x,
            pod_uid=str(x),
            namespace="ns",
            pod_name="p",
            node="n",
            parts=[AllocationPart(container="c", container_index=0, gpu_uuid=f"G{i}", gpu_index=i, memory_mib=4096)],
        )
        for i, x in enumerate((a, b))
    ]
    exchange = ExchangedEvent(
        node="n", first_allocation_id=a, first_container="c", second_allocation_id=b, second_container="c"
    )
    release = ReleasedEvent(allocation_id=a, pod_uid=str(a), node="n", reason="deleted")
    in_commit_order, out_of_order = LedgerState(), LedgerState()
    for event in [inventory, *reserved, exchange, release]:
        in_commit_order.apply(event)
    for event in [inventory, *reserved, release, exchange]:
        out_of_order.apply(event)
    assert in_commit_order.canonical()["gpus"] == out_of_order.canonical()["gpus"]
    assert (out_of_order.gpus["G0"].allocated_memory_mib, out_of_order.gpus["G1"].allocated_memory_mib) == (4096, 0)


async def test_a_sidecar_share_is_charged_beside_the_app_released_exactly_and_replayed(
    engine: AsyncEngine, bus: EventBus
) -> None:
    """Kubernetes' sidecar rule in SQL, in the replayed state and through a lost-ledger rebuild."""
    import pytest

    from shared.ledger.rules import ExchangeRefused

    def part(container: str, index: int, gib: int, *, gpu: int = 0, init: bool = False, sidecar: bool = False):
        return AllocationPart(
            container=container,
            container_index=index,
            gpu_uuid=f"G{gpu}",
            gpu_index=gpu,
            memory_mib=gib * 1024,
            init=init,
            sidecar=sidecar,
        )

    def req(*parts: AllocationPart) -> ReservationRequest:
        return ReservationRequest(pod_uid=str(uuid.uuid4()), namespace="ns", pod_name="p", node="n", parts=parts)

    async with _ledger_on_two_gpus(engine, bus) as ledger:
        # sidecar (init 0) 4 GiB, regular init (init 1) 10 GiB after it, app 8 GiB: max(10 + 4, 4 + 8) = 14 GiB
        first = await ledger.reserve(
            req(part("proxy", 0, 4, init=True, sidecar=True), part("setup", 1, 10, init=True), part("app", 0, 8))
        )
        async with engine.connect() as conn:
            live = await load_state(conn)
        assert live.gpus["G0"].allocated_memory_mib == 14 * 1024
        assert live.allocations[first.allocation_id].memory_mib == 14 * 1024
        assert [p.sidecar for p in live.allocations[first.allocation_id].parts if p.container == "proxy"] == [True]
        # 4 GiB left: a 6 GiB pod is refused (as a plain init container the sidecar would have left 6 GiB)
        with pytest.raises(InsufficientCapacity):
            await ledger.reserve(req(part("main", 0, 6)))
        # equal-sized shares of different kinds are not exchanged: their charges follow different rules
        other = await ledger.reserve(req(part("main", 0, 4, gpu=1, init=True), part("app", 0, 1, gpu=1)))
        with pytest.raises(ExchangeRefused, match="different sizes"):
            await ledger.exchange("n", (first.allocation_id, "proxy"), (other.allocation_id, "main"))
        await wait_for_quiet(engine)
        replayed, _ = await replay_state(bus)
        async with engine.connect() as conn:
            live = await load_state(conn)
        assert differences(live, replayed) == []
        await write_state(engine, type(live)())
        await write_state(engine, replayed)
        async with engine.connect() as conn:
            assert differences(live, await load_state(conn)) == []
        # the release gives back exactly what was charged
        await ledger.release(first.allocation_id, first.pod_uid, "n", "pod deleted")
    async with engine.connect() as conn:
        live = await load_state(conn)
    assert live.gpus["G0"].allocated_memory_mib == 0
    replayed, _ = await replay_state(bus)
    assert differences(live, replayed) == []
