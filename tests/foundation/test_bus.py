"""The JetStream helpers against a real NATS server: dedup, ack after effect, retries, parking."""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.bus import EventBus
from shared.events.catalogue import HealthEvent, QuotaEvent
from shared.events.consumer import DurableConsumer, PermanentError
from shared.ledger.idempotency import claim


async def _until(predicate, within: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_republishing_the_same_event_id_is_dropped_by_the_stream(bus: EventBus) -> None:
    event = QuotaEvent(namespace="ml", memory_mib=1024)
    first = await bus.publish(event)
    second = await bus.publish(event)
    assert not first.duplicate and second.duplicate
    info = await bus.js.stream_info(bus.names.stream)
    assert info.state.messages == 1


async def test_consumer_applies_each_event_once_even_when_delivered_twice(bus: EventBus, engine: AsyncEngine) -> None:
    applied: list[uuid.UUID] = []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        async with engine.begin() as conn:
            if await claim(conn, "test", event.event_id):
                applied.append(event.event_id)

    consumer = DurableConsumer(bus, "idem", handler, kinds=["quota"])
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    event = QuotaEvent(namespace="ml", memory_mib=1024)
    await bus.publish(event)
    # a second message with another msg-id but the same event body: a replayed event
    await bus.publish_raw(f"{bus.names.prefix}.quota._", event.model_dump_json().encode(), "other-msg-id")
    await _until(lambda: consumer.applied == 2)
    stop.set()
    await task
    assert applied == [event.event_id]


async def test_poison_and_persistently_failing_messages_are_parked_not_looped(bus: EventBus) -> None:
    seen: list[str] = []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        seen.append(event.namespace)
        if event.namespace == "reject":
            raise PermanentError("namespace reject is not allowed")
        if event.namespace == "flaky":
            raise RuntimeError("database unavailable")

    consumer = DurableConsumer(bus, "poison", handler, kinds=["quota"], max_deliver=3, backoff_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await bus.publish_raw(f"{bus.names.prefix}.quota._", b"{not json", "garbage-1")
    await bus.publish(QuotaEvent(namespace="reject", memory_mib=1))
    await bus.publish(QuotaEvent(namespace="flaky", memory_mib=1))
    await bus.publish(QuotaEvent(namespace="fine", memory_mib=1))
    await _until(lambda: consumer.parked == 3 and consumer.applied == 1)
    stop.set()
    await task
    assert seen.count("flaky") == 3  # bounded redelivery
    assert seen.count("fine") == 1
    parked = await bus.js.stream_info(bus.names.parked_stream)
    assert parked.state.messages == 3


async def test_consumer_resumes_where_it_left_off(bus: EventBus) -> None:
    got: list[str] = []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        got.append(event.gpu_uuid)

    for i in range(3):
        await bus.publish(HealthEvent(node="n", gpu_uuid=f"G{i}", healthy=True))
    first = DurableConsumer(bus, "resume", handler, kinds=["health"])
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    await _until(lambda: len(got) == 3)
    stop.set()
    await task
    for i in range(3, 5):
        await bus.publish(HealthEvent(node="n", gpu_uuid=f"G{i}", healthy=True))
    second = DurableConsumer(bus, "resume", handler, kinds=["health"])
    stop = asyncio.Event()
    task = asyncio.create_task(second.run(stop))
    await _until(lambda: len(got) == 5)
    stop.set()
    await task
    assert got == ["G0", "G1", "G2", "G3", "G4"]


async def test_a_slow_message_holds_only_its_own_slot(bus: EventBus) -> None:
    slow_started, release = asyncio.Event(), asyncio.Event()
    done: list[str] = []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        if event.namespace == "slow":
            slow_started.set()
            await release.wait()
        done.append(event.namespace)

    consumer = DurableConsumer(bus, "pipeline", handler, kinds=["quota"], concurrency=4)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await bus.publish(QuotaEvent(namespace="slow", memory_mib=1))
    await asyncio.wait_for(slow_started.wait(), 10)
    # published one by one after the slow one was fetched: each needs a fetch of its own
    for i in range(6):
        await bus.publish(QuotaEvent(namespace=f"fast-{i}", memory_mib=1))
        await _until(lambda n=i + 1: len(done) == n, within=5)
    assert "slow" not in done
    info = await bus.js.consumer_info(bus.names.stream, "pipeline")
    assert info.num_ack_pending == 1  # the slow one is acked only after its effect
    release.set()
    await _until(lambda: consumer.applied == 7)
    stop.set()
    await task
    assert done[-1] == "slow"


async def test_concurrency_bounds_the_handlers_in_flight(bus: EventBus) -> None:
    running, peak, seen = 0, 0, []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        seen.append(event.namespace)
        running -= 1

    for i in range(12):
        await bus.publish(QuotaEvent(namespace=f"ns-{i}", memory_mib=1))
    consumer = DurableConsumer(bus, "bounded", handler, kinds=["quota"], concurrency=3)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await _until(lambda: consumer.applied == 12)
    stop.set()
    await task
    assert peak == 3
    assert sorted(seen) == sorted(f"ns-{i}" for i in range(12))


async def test_stop_waits_for_handlers_in_flight(bus: EventBus) -> None:
    started = asyncio.Event()
    finished: list[str] = []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        started.set()
        await asyncio.sleep(0.3)
        finished.append(event.namespace)

    consumer = DurableConsumer(bus, "drain", handler, kinds=["quota"], concurrency=2)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await bus.publish(QuotaEvent(namespace="a", memory_mib=1))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert finished == ["a"] and consumer.applied == 1


async def test_a_backlog_is_applied_in_batches_and_a_bad_event_falls_back_to_one_by_one(bus: EventBus) -> None:
    batches: list[list[str]] = []
    singles: list[str] = []

    async def one(event) -> None:  # type: ignore[no-untyped-def]
        if event.namespace == "bad":
            raise PermanentError("never valid")
        singles.append(event.namespace)

    async def many(events) -> None:  # type: ignore[no-untyped-def]
        names = [e.namespace for e in events]
        if "bad" in names:
            raise RuntimeError("one event of the batch is bad: the whole batch rolls back")
        batches.append(names)

    # a backlog published before the consumer starts, with one bad event and one undecodable message in it
    for i in range(20):
        await bus.publish(QuotaEvent(namespace=f"ns-{i}", memory_mib=1))
    await bus.publish_raw(f"{bus.names.prefix}.quota._", b"{not json", "garbage-batch")
    await bus.publish(QuotaEvent(namespace="bad", memory_mib=1))
    await bus.publish(HealthEvent(node="n", gpu_uuid="G", healthy=True))  # another kind: acked, not handled
    for i in range(20, 25):
        await bus.publish(QuotaEvent(namespace=f"ns-{i}", memory_mib=1))
    consumer = DurableConsumer(bus, "batched", one, kinds=["quota"], batch=8, batch_handler=many)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await _until(lambda: consumer.applied == 25 and consumer.parked == 2)
    stop.set()
    await task
    in_batches = [n for b in batches for n in b]
    assert batches and max(len(b) for b in batches) > 1  # the backlog went through the batch handler
    assert sorted(in_batches + singles) == sorted(f"ns-{i}" for i in range(25))  # each good event exactly once
    assert "bad" not in singles and "bad" not in in_batches
    info = await bus.js.consumer_info(bus.names.stream, "batched")
    assert info.num_ack_pending == 0 and info.num_pending == 0
