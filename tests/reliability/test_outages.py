"""Outages do not lose data: accounting's consumers wait out a PostgreSQL outage (stopped for good, then
started again) instead of parking the events that arrive meanwhile."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from sqlalchemy import func, select

from services.accounting.metrics import AccountingMetrics
from services.accounting.service import build_consumers
from services.accounting.tables import pending, timeline, usage_samples
from shared.events.bus import EventBus
from shared.events.catalogue import (
    AllocationPart,
    RefusedEvent,
    ReservedEvent,
    UsageEvent,
    UsageSample,
)
from shared.ledger.db import make_engine
from tests.waiting import eventually

from .late_servers import private_postgres

OUTAGE_S = 12.0  # longer than the 7.5 s after which an event used to be parked


def _reserved(node: str = "n") -> ReservedEvent:
    a_id = uuid.uuid4()
    part = AllocationPart(container="c", container_index=0, gpu_uuid="G0", gpu_index=0, memory_mib=1024)
    return ReservedEvent(allocation_id=a_id, pod_uid=str(a_id), namespace="ns", pod_name="p", node=node, parts=[part])


def _usage() -> UsageEvent:
    return UsageEvent(node="n", samples=[UsageSample(gpu_uuid="G0", pod_uid="p", used_memory_mib=100)])


async def test_accounting_waits_out_a_database_outage_and_parks_nothing(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.events.consumer")
    async with private_postgres() as pg:
        engine = make_engine(pg.url, pool_size=3, max_overflow=0)
        consumers = build_consumers(engine, bus, AccountingMetrics())
        stop = asyncio.Event()
        tasks = [asyncio.create_task(c.run(stop)) for c in consumers]

        async def rows() -> tuple[int, int, int]:
            async with engine.connect() as conn:
                counts = [
                    (await conn.execute(select(func.count()).select_from(t))).scalar_one()
                    for t in (timeline, usage_samples, pending)
                ]
            return counts[0], counts[1], counts[2]

        try:
            await bus.publish(_reserved())
            await bus.publish(_usage())
            await eventually(lambda: all(c.applied for c in consumers), what="both consumers to apply an event")

            await pg.stop()
            during = [_reserved(), _reserved(), _usage(), _usage(), _reserved()]
            during.append(RefusedEvent(pod_uid="waiting", namespace="ns", pod_name="w", summary="no GPU fits"))
            for event in during:
                await bus.publish(event)
            await asyncio.sleep(OUTAGE_S)  # the outage lasts this long (the fault, not a wait for a result)
            assert [c.parked for c in consumers] == [0, 0], "an outage parks nothing"
            await pg.start()

            await eventually(lambda: _equal(rows, (4, 3, 1)), what="every event applied", within=60)
            assert [c.parked for c in consumers] == [0, 0]
            assert (await bus.js.stream_info(bus.names.parked_stream)).state.messages == 0
            waits = [r for r in caplog.records if "waits for the database or the bus" in r.getMessage()]
            # one line per attempt (capped backoff, 0.5 s doubling up to 10 s), not one per try of anything else
            assert 0 < len(waits) <= 2 * 8
            assert all(c.outage_retries for c in consumers)
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=15)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.dispose()


async def _equal(fetch, expected: tuple[int, int, int]) -> bool:  # type: ignore[no-untyped-def]
    try:
        return await fetch() == expected
    except Exception:  # the database may still be starting
        return False
