"""The one polling helper of the test suite: wait for a condition instead of sleeping a fixed time.

It is `devstack.cluster.waits.poll` (which the local stack's own waits use too) with keyword names that read
well in a test: `await eventually(check, what="...", within=20)`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from devstack.cluster.waits import poll


async def eventually(
    check: Callable[[], Any | Awaitable[Any]], *, what: str, within: float = 20.0, interval: float = 0.05
) -> Any:
    """Call `check` (plain or async) until it returns something truthy, and return that; TimeoutError naming
    `what` after `within` seconds."""
    return await poll(check, within, interval, what)


async def stream_events(bus: Any, kind: str) -> list[Any]:
    """Every event of one kind now in the test's stream (read with a throwaway consumer)."""
    import contextlib
    import uuid

    from nats.errors import TimeoutError as NatsTimeout

    from shared.events.catalogue import decode_event

    stream = bus.names.stream_of(kind)
    durable = f"t{uuid.uuid4().hex[:10]}"
    sub = await bus.js.pull_subscribe(bus.names.subject(kind, ">"), durable=durable, stream=stream)
    out = []
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                break
            for m in msgs:
                out.append(decode_event(m.data))
                await m.ack()
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await bus.js.delete_consumer(stream, durable)
    return out
