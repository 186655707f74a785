"""Accounting fixtures: a seeded ledger with a relay and the accounting consumer, the app, a live server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting.api import create_app
from services.accounting.metrics import AccountingMetrics
from services.accounting.projections import Projector
from services.accounting.tables import CONSUMER, SAMPLES_CONSUMER
from services.cli import main as gpushare
from shared.events.bus import EventBus
from shared.events.catalogue import (
    AllocationPart,
    GpuInfo,
    InventoryEvent,
    RefusedEvent,
    UsageEvent,
    UsageSample,
)
from shared.events.consumer import DurableConsumer
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.ledger.replay import wait_for_quiet
from shared.ledger.reservations import Reservation, ReservationRequest
from shared.settings import Settings

from .live import LiveServer

ADMIN_TOKEN = "s3cret-admin-token"
GIB = 1024


async def cli(*argv: str) -> int:
    """Run `gpushare ARGV...` in a thread; undo the logging set-up it does onto (captured) stderr."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return await asyncio.to_thread(gpushare, list(argv))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@dataclass
class Stack:
    """A ledger writer, the accounting consumer and the app over one test's database and stream."""

    engine: AsyncEngine
    bus: EventBus
    ledger: Ledger
    consumer: DurableConsumer  # the ledger stream's
    samples_consumer: DurableConsumer  # the samples stream's
    metrics: AccountingMetrics
    app: FastAPI
    client: httpx.AsyncClient
    settings: Settings
    pods: dict[str, Reservation] = field(default_factory=dict)
    seeded_at: datetime | None = None

    async def settle(self, timeout_s: float = 20.0) -> None:
        """Wait until every committed change is published and applied by both consumers."""
        await wait_for_quiet(self.engine, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        names = self.bus.names
        while True:
            done = True
            for stream, durable in ((names.stream, CONSUMER), (names.samples_stream, SAMPLES_CONSUMER)):
                info = await self.bus.js.stream_info(stream)
                try:
                    ci = await self.bus.js.consumer_info(stream, durable)
                    done = done and ci.delivered.stream_seq >= info.state.last_seq and ci.num_ack_pending == 0
                except Exception:
                    done = False
            if done:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the accounting consumer did not catch up")
            await asyncio.sleep(0.05)


async def truncate_projections(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE acc_timeline, acc_pending RESTART IDENTITY"))


@pytest.fixture
async def stack(engine: AsyncEngine, bus: EventBus) -> AsyncIterator[Stack]:
    await truncate_projections(engine)
    settings = Settings(
        admin_token=SecretStr(ADMIN_TOKEN), stream_name=bus.names.stream, subject_prefix=bus.names.prefix
    )
    stop = asyncio.Event()
    relay = OutboxRelay(engine, bus, poll_s=0.05)
    ledger = Ledger(engine, prefix=bus.names.prefix, source="test", on_commit=relay.kick)
    metrics = AccountingMetrics(min_refresh_s=0)
    projector = Projector(engine, on_latency=metrics.observe_latency)
    consumer = DurableConsumer(bus, CONSUMER, projector.handle, batch=128)
    samples = DurableConsumer(bus, SAMPLES_CONSUMER, projector.handle, batch=128, stream=bus.names.samples_stream)
    tasks = [asyncio.create_task(t.run(stop)) for t in (relay, consumer, samples)]
    app = create_app(engine, settings, ledger=ledger, metrics=metrics)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://accounting")
    try:
        yield Stack(engine, bus, ledger, consumer, samples, metrics, app, client, settings)
    finally:
        stop.set()
        await client.aclose()
        await asyncio.wait(tasks, timeout=3)  # let the consumer finish its fetch and unsubscribe cleanly
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def plain_client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    """The app over an empty ledger, without bus or consumer (for validation tests)."""
    app = create_app(engine, Settings(admin_token=SecretStr(ADMIN_TOKEN)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://accounting") as client:
        yield client


def part(gpu: str, index: int, mib: int, container: str = "main", ci: int = 0) -> AllocationPart:
    return AllocationPart(container=container, container_index=ci, gpu_uuid=gpu, gpu_index=index, memory_mib=mib)


async def seed(s: Stack) -> Stack:
    """Two nodes with two 15 GiB T4s each, allocations in every state, refusals and usage samples."""
    for n in range(2):
        await s.ledger.record(
            InventoryEvent(
                node=f"node-{n}",
                driver_version="550.54",
                cuda_version="12.4",
                gpus=[
                    GpuInfo(uuid=f"GPU-{n}-{i}", index=i, model="Tesla-T4", memory_mib=15 * GIB, memory_total_mib=15360)
                    for i in range(2)
                ],
            )
        )

    async def reserve(key: str, ns: str, name: str, node: str, parts: tuple, kind: str, owner: str) -> Reservation:
        r = await s.ledger.reserve(
            ReservationRequest(
                pod_uid=f"uid-{key}",
                namespace=ns,
                pod_name=name,
                node=node,
                parts=parts,
                owner_kind=kind,
                owner_name=owner,
            )
        )
        s.pods[key] = r
        return r

    # Refused first, then reserved: the reasons must be cleared.
    await s.bus.publish(
        RefusedEvent(
            pod_uid="uid-a", namespace="team-a", pod_name="bert-1", summary="0/2 nodes fit", reasons={"node-0": "x"}
        )
    )
    await asyncio.sleep(0.01)
    a = await reserve("a", "team-a", "bert-1", "node-0", (part("GPU-0-0", 0, 2 * GIB),), "Deployment", "bert")
    await s.ledger.mark_bound(a.allocation_id, a.pod_uid, a.node)
    await s.ledger.mark_assigned(a.allocation_id, a.pod_uid, a.node, "main", ["GPU-0-0"])
    b = await reserve("b", "team-a", "bert-2", "node-0", (part("GPU-0-1", 1, 2 * GIB),), "Deployment", "bert")
    await s.ledger.mark_bound(b.allocation_id, b.pod_uid, b.node)
    c = await reserve(
        "c",
        "team-b",
        "train-0",
        "node-1",
        (part("GPU-1-0", 0, 4 * GIB), part("GPU-1-1", 1, 4 * GIB, "side", 1)),
        "Job",
        "train",
    )
    await s.ledger.mark_bound(c.allocation_id, c.pod_uid, c.node)
    await s.ledger.mark_assigned(c.allocation_id, c.pod_uid, c.node, "main", ["GPU-1-0"])
    d = await reserve("d", "team-b", "old-0", "node-1", (part("GPU-1-0", 0, 3 * GIB),), "Job", "old")
    await s.ledger.release(d.allocation_id, d.pod_uid, d.node, "pod deleted")
    e = await reserve("e", "team-c", "flaky-0", "node-1", (part("GPU-1-1", 1, 1 * GIB),), "", "")
    await s.ledger.mark_failed(e.allocation_id, e.pod_uid, e.node, "binding refused: node gone")
    # A pod that waits: its latest refusal wins.
    for summary in ("0/2 nodes fit: insufficient GPU memory", "0/2 nodes fit: needs 20 GiB on one GPU"):
        await s.bus.publish(
            RefusedEvent(
                pod_uid="uid-big",
                namespace="team-b",
                pod_name="huge-0",
                summary=summary,
                reasons={"node-0": "needs 20 GiB on one GPU, largest free 13 GiB", "node-1": "needs 20 GiB on one GPU"},
            )
        )
    # Usage: bert-1 peaks at 1.3 GiB (1331 MiB); train-0 uses 6 of its 8 GiB.
    now = datetime.now(UTC)
    for i, used in enumerate((900, 1000, 1331, 1100, 1200)):
        await s.bus.publish(
            UsageEvent(
                node="node-0",
                occurred_at=now - timedelta(seconds=50 - 10 * i),
                samples=[
                    UsageSample(
                        gpu_uuid="GPU-0-0",
                        pod_uid="uid-a",
                        namespace="team-a",
                        pod_name="bert-1",
                        container="main",
                        used_memory_mib=used,
                        utilization_pct=40.0,
                    ),
                ],
            )
        )
    await s.bus.publish(
        UsageEvent(
            node="node-1",
            samples=[
                UsageSample(
                    gpu_uuid="GPU-1-0",
                    pod_uid="uid-c",
                    namespace="team-b",
                    pod_name="train-0",
                    container="main",
                    used_memory_mib=3 * GIB,
                ),
                UsageSample(
                    gpu_uuid="GPU-1-1",
                    pod_uid="uid-c",
                    namespace="team-b",
                    pod_name="train-0",
                    container="side",
                    used_memory_mib=3 * GIB,
                ),
            ],
        )
    )
    await s.settle()
    s.seeded_at = datetime.now(UTC)
    return s


@pytest.fixture
async def seeded(stack: Stack) -> Stack:
    return await seed(stack)


@pytest.fixture
def live_server(database_url: str, stack: Stack, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """The app on a real port; its ledger writes go to the test's outbox, which the stack's relay publishes (a
    test module's `SCHEDULING(stack)` gives it what knows pending pods' waits)."""
    make = getattr(request.module, "SCHEDULING", None)
    with LiveServer(database_url, stack.settings, scheduling=make(stack) if make else None) as server:
        yield server
