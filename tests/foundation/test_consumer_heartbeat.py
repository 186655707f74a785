"""A durable consumer's heartbeat against a real NATS server: a short ack wait hands the messages of a consumer
that died to another one soon, and the heartbeat keeps a message that is still being worked on from being
delivered twice (issue 32: the binder's replicas share one consumer)."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.api import AckPolicy, ConsumerConfig

from shared.events.bus import EventBus
from shared.events.catalogue import QuotaEvent
from shared.events.consumer import DurableConsumer

log = logging.getLogger(__name__)

# wide enough that a busy machine's stalls of the test's event loop (up to ACK_WAIT_S - heartbeat) do not redeliver
ACK_WAIT_S = 3.0


async def _until(predicate, within: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _slow_consumer(bus: EventBus, durable: str, **kw) -> tuple[DurableConsumer, list[str]]:  # type: ignore[no-untyped-def]
    calls: list[str] = []

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        calls.append(event.namespace)
        await asyncio.sleep(ACK_WAIT_S + 1.0)  # longer than the ack wait

    return DurableConsumer(bus, durable, handler, kinds=["quota"], ack_wait_s=ACK_WAIT_S, concurrency=4, **kw), calls


async def _consume_one(bus: EventBus, consumer: DurableConsumer) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await bus.publish(QuotaEvent(namespace="slow", memory_mib=1))
    await _until(lambda: consumer.applied >= 1)
    await asyncio.sleep(ACK_WAIT_S + 0.5)  # a second delivery, if one comes, arrives within an ack wait
    stop.set()
    await task


async def test_a_message_worked_on_longer_than_the_ack_wait_is_delivered_once_with_a_heartbeat(bus: EventBus) -> None:
    consumer, calls = await _slow_consumer(bus, "beating", heartbeat_s=0.3)
    await _consume_one(bus, consumer)
    info = await bus.js.consumer_info(bus.names.stream, "beating")
    assert calls == ["slow"] and info.num_redelivered == 0


async def test_without_a_heartbeat_the_same_message_is_delivered_again_while_worked_on(bus: EventBus) -> None:
    """The contrast: what the heartbeat prevents (so the test above can fail)."""
    consumer, calls = await _slow_consumer(bus, "silent")
    await _consume_one(bus, consumer)
    assert len(calls) >= 2 and set(calls) == {"slow"}


async def test_the_messages_of_a_consumer_that_died_go_to_another_after_the_ack_wait(
    nats_url: str, bus: EventBus
) -> None:
    held = asyncio.Event()

    async def hangs(event) -> None:  # type: ignore[no-untyped-def]
        held.set()
        await asyncio.Event().wait()

    dying_bus = await EventBus.connect(nats_url, bus.names, name="dying")
    dying = DurableConsumer(dying_bus, "shared", hangs, kinds=["quota"], ack_wait_s=2.0, heartbeat_s=0.5)
    dying_stop = asyncio.Event()
    dying_task = asyncio.create_task(dying.run(dying_stop))
    got: list[float] = []

    async def takes(event) -> None:  # type: ignore[no-untyped-def]
        got.append(time.monotonic())

    survivor = DurableConsumer(bus, "shared", takes, kinds=["quota"], ack_wait_s=2.0, heartbeat_s=0.5)
    survivor_stop = asyncio.Event()
    try:
        await _until(lambda: dying.ready.is_set())
        await bus.publish(QuotaEvent(namespace="held", memory_mib=1))
        await asyncio.wait_for(held.wait(), 10)
        survivor_task = asyncio.create_task(survivor.run(survivor_stop))
        # the holder dies: its connection closes without an ack, and its heartbeat stops with it
        dying_task.cancel()
        await dying_bus.nc.close()
        died = time.monotonic()
        await _until(lambda: bool(got))
        log.info("the dead consumer's message reached the other one %.1fs later", got[0] - died)
        survivor_stop.set()
        await survivor_task
    finally:
        dying_task.cancel()
        await asyncio.gather(dying_task, return_exceptions=True)
    assert len(got) == 1


async def test_an_existing_durable_takes_the_ack_wait_of_this_release(bus: EventBus) -> None:
    await bus.js.add_consumer(
        bus.names.stream,
        config=ConsumerConfig(
            durable_name="old",
            name="old",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            filter_subject=bus.names.subject("quota", ">"),
        ),
    )
    consumer = DurableConsumer(bus, "old", lambda event: asyncio.sleep(0), kinds=["quota"], ack_wait_s=5.0)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    await _until(lambda: consumer.ready.is_set())
    stop.set()
    await task
    assert (await bus.js.consumer_info(bus.names.stream, "old")).config.ack_wait == 5.0
