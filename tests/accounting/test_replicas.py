"""Two accounting replicas share the durable consumers (issue 32): each takes whole batches, in its own
transaction, in whatever order the bus hands them out. The read models must come out as one process applying
the stream in order would leave them, whatever the interleaving, against the real PostgreSQL.

The interleavings that went wrong are played deterministically first (one transaction held open while the other
runs), then random splits of a realistic stream are raced by two projectors.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting import projections
from services.accounting.projections import Projector
from services.accounting.tables import pending, timeline, usage_samples
from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    Event,
    ExchangedEvent,
    ReleasedEvent,
    ReservedEvent,
    UsageEvent,
    UsageSample,
)
from shared.ledger.models import allocations

from . import sequential
from .test_bulk_projections import BASE, _reset, refused, reserved


async def _rows(engine: AsyncEngine) -> dict[str, Any]:
    """The read models as sets (serial ids and insertion order differ between replicas and say nothing)."""
    async with engine.connect() as conn:
        t = (await conn.execute(select(timeline))).all()
        p = (await conn.execute(select(pending))).all()
        u = (await conn.execute(select(usage_samples))).all()
    return {
        "timeline": sorted(tuple(r)[1:] for r in t),
        "pending": sorted((r.pod_uid, r.event_id, r.summary, r.refused_at) for r in p),
        "usage": sorted(tuple(r)[1:] for r in u),
    }


async def _in_ledger(engine: AsyncEngine, events: list[Event]) -> None:
    """The ledger's rows of the events' allocations: the extender commits an allocation before any of its events
    is published, so every replica can read it (state `released`: the stream's pods repeat between rounds)."""
    rows = [
        {
            "id": e.allocation_id,
            "pod_uid": e.pod_uid,
            "namespace": e.namespace,
            "pod_name": e.pod_name,
            "node": e.node,
            "state": "released",
            "memory_mib": 1024,
            "reserved_at": e.occurred_at,
        }
        for e in events
        if isinstance(e, ReservedEvent)
    ]
    async with engine.begin() as conn:
        await conn.execute(pg_insert(allocations).on_conflict_do_nothing(), rows)


async def _held_open_while_the_other_commits(engine: AsyncEngine, first: list[Event], second: list[Event]) -> None:
    """Replica A applies `first` and keeps its transaction open; replica B applies `second` meanwhile; then A
    commits and B finishes."""
    async with engine.begin() as conn:
        await projections.apply_many(conn, first)
        other = asyncio.create_task(Projector(engine).handle_many(second))
        await asyncio.sleep(0.5)  # B runs (or waits for A) now
    await asyncio.wait_for(other, 10)


async def _in_order(engine: AsyncEngine, events: list[Event]) -> dict[str, Any]:
    """The reference: one process applying the events one by one, in stream order."""
    await _reset(engine)
    for event in events:
        async with engine.begin() as conn:
            await sequential.apply(conn, event)
    return await _rows(engine)


async def test_a_reservation_committed_while_another_replica_holds_an_older_refusal_clears_it(
    engine: AsyncEngine,
) -> None:
    refusal, reservation = refused("pod-2", BASE), reserved(2, BASE + timedelta(seconds=2))
    expected = await _in_order(engine, [refusal, reservation])
    await _reset(engine)
    await _held_open_while_the_other_commits(engine, [refusal], [reservation])
    assert await _rows(engine) == expected
    assert expected["pending"] == []


async def test_a_usage_event_delivered_to_both_replicas_at_once_is_stored_once(engine: AsyncEngine) -> None:
    usage = UsageEvent(node="node-0", samples=[UsageSample(gpu_uuid="GPU-0", used_memory_mib=7)], occurred_at=BASE)
    expected = await _in_order(engine, [usage, usage])
    await _reset(engine)
    await _held_open_while_the_other_commits(engine, [usage], [usage])
    assert await _rows(engine) == expected
    assert len(expected["usage"]) == 1


async def test_an_exchange_applied_before_its_reservations_still_names_the_pods(engine: AsyncEngine) -> None:
    """Another replica took the batch with the exchange and committed first: the exchange still names the pods
    (the ledger's), as in stream order."""
    first, second = reserved(3, BASE), reserved(4, BASE)
    swap = ExchangedEvent(
        node="node-0",
        first_allocation_id=first.allocation_id,
        first_container="main",
        second_allocation_id=second.allocation_id,
        second_container="main",
        occurred_at=BASE + timedelta(seconds=5),
    )
    await _in_ledger(engine, [first, second])
    expected = await _in_order(engine, [first, second, swap])
    await _reset(engine)
    await Projector(engine).handle_many([swap])
    await Projector(engine).handle_many([first, second])
    assert await _rows(engine) == expected


def _stream(rng: random.Random, pods: int) -> list[Event]:
    """A plausible ledger and samples stream: pods refused, reserved, bound, assigned, some exchanged, released;
    usage between; every event in occurrence order."""
    t = BASE
    out: list[Event] = []
    live: list[Any] = []
    for i in range(pods):
        t += timedelta(milliseconds=rng.randint(1, 400))
        pod = f"pod-{i}"
        if rng.random() < 0.5:
            out.append(refused(pod, t, rng.choice(["no fit", "quota"])))
            t += timedelta(milliseconds=rng.randint(1, 200))
        alloc = uuid.uuid4()
        r = reserved(0, t)
        r = r.model_copy(update={"allocation_id": alloc, "pod_uid": pod, "pod_name": pod})
        out.append(r)
        if rng.random() < 0.15:
            continue  # still reserved when the stream ends
        t += timedelta(milliseconds=rng.randint(1, 300))
        out.append(BoundEvent(allocation_id=alloc, pod_uid=pod, node="node-0", occurred_at=t))
        t += timedelta(milliseconds=rng.randint(1, 300))
        out.append(
            AssignedEvent(
                allocation_id=alloc, pod_uid=pod, node="node-0", container="main", gpu_uuids=["GPU-0"], occurred_at=t
            )
        )
        if live and rng.random() < 0.2:
            other = rng.choice(live)
            t += timedelta(milliseconds=rng.randint(1, 50))
            out.append(
                ExchangedEvent(
                    node="node-0",
                    first_allocation_id=alloc,
                    first_container="main",
                    second_allocation_id=other[0],
                    second_container="main",
                    occurred_at=t,
                )
            )
        live.append((alloc, pod))
        if rng.random() < 0.3:
            done = live.pop(rng.randrange(len(live)))
            t += timedelta(milliseconds=rng.randint(1, 300))
            out.append(ReleasedEvent(allocation_id=done[0], pod_uid=done[1], node="node-0", occurred_at=t))
        if rng.random() < 0.3:
            samples = [UsageSample(gpu_uuid="GPU-0", pod_uid=p, used_memory_mib=rng.randint(1, 900)) for _, p in live]
            out.append(UsageEvent(node="node-0", samples=samples, occurred_at=t))
    return out


async def _race(engine: AsyncEngine, events: list[Event], rng: random.Random) -> None:
    """Two projectors pull batches from one queue, as two replicas pull from a shared durable consumer; some
    batches come again (a redelivery)."""
    queue: asyncio.Queue[list[Event]] = asyncio.Queue()
    i = 0
    while i < len(events):
        size = rng.randint(1, 12)
        queue.put_nowait(events[i : i + size])
        if rng.random() < 0.1:
            queue.put_nowait(events[i : i + size])
        i += size

    async def replica() -> None:
        projector = Projector(engine)
        while not queue.empty():
            batch = queue.get_nowait()
            await projector.handle_many(batch)
            await asyncio.sleep(rng.random() * 0.002)

    await asyncio.gather(replica(), replica())


async def test_two_replicas_racing_over_a_stream_leave_what_one_in_order_leaves(engine: AsyncEngine) -> None:
    rng = random.Random(32)
    for _ in range(4):
        events = _stream(rng, 60)
        await _in_ledger(engine, events)
        expected = await _in_order(engine, events)
        await _reset(engine)
        await _race(engine, events, rng)
        assert await _rows(engine) == expected
