"""`gpushare accounting` as a real process: consumes the stream, serves the API, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.bus import EventBus
from shared.events.catalogue import GpuInfo, InventoryEvent, RefusedEvent
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay

from .conftest import truncate_projections
from .live import free_port


async def _until(check, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = await check()
            if result:
                return result
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.2)


async def test_accounting_process(engine: AsyncEngine, bus: EventBus, database_url: str, nats_url: str) -> None:
    await truncate_projections(engine)
    relay = OutboxRelay(engine, bus)
    ledger = Ledger(engine, prefix=bus.names.prefix, source="test")
    await ledger.record(
        InventoryEvent(node="n1", gpus=[GpuInfo(uuid="G1", index=0, memory_mib=8192, memory_total_mib=8192)])
    )
    await relay.flush()
    await bus.publish(RefusedEvent(pod_uid="u1", namespace="ns", pod_name="waiting", summary="no GPU node fits"))
    port = free_port()
    env = {
        **os.environ,
        "GPUSHARE_DATABASE_URL": database_url,
        "GPUSHARE_NATS_URL": nats_url,
        "GPUSHARE_STREAM_NAME": bus.names.stream,
        "GPUSHARE_SUBJECT_PREFIX": bus.names.prefix,
        "GPUSHARE_LOG_FORMAT": "text",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "accounting",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await _until(ready)

            async def pending() -> list:
                return (await client.get("/v1/pending")).json()["items"]

            items = await _until(pending)
            assert [(p["namespace"], p["pod_name"], p["summary"]) for p in items] == [
                ("ns", "waiting", "no GPU node fits")
            ]
            assert (await client.get("/v1/cluster")).json()["memory_mib"] == 8192
            metrics = (await client.get("/metrics")).text
            assert "gpushare_accounting_events_applied_total 1.0" in metrics
            assert 'gpushare_pending_pods{reason="no GPU node fits"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"Traceback" not in err
