"""A node agent whose command waited while the binder was stopped sends it again; the gateway then receives
the same event id several times. The first copy is applied and staged; a copy arriving while the outbox still
holds it is answered as applied (before: a unique-constraint traceback and a refusal). Real PostgreSQL and NATS."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.binder.gateway import LedgerGateway
from services.binder.metrics import BinderMetrics
from shared.events.bus import EventBus
from shared.events.catalogue import GpuInfo, InventoryEvent, encode_event, node_token
from shared.ledger.ledger import Ledger
from shared.ledger.models import gpus, outbox


async def test_a_repeated_command_is_answered_as_applied(engine: AsyncEngine, bus: EventBus) -> None:
    ledger = Ledger(engine, prefix=bus.names.prefix, source="binder")  # no relay: the outbox keeps the first copy
    gateway = LedgerGateway(ledger, bus, metrics=BinderMetrics())
    event = InventoryEvent(
        node="repeat-node", gpus=[GpuInfo(uuid="GPU-r0", index=0, memory_mib=16384, memory_total_mib=16384)]
    )
    data = encode_event(event)

    first = await gateway.command(node_token(event.node), data)
    again = await gateway.command(node_token(event.node), data)

    assert first.ok and again.ok, (first, again)
    assert again.event is not None and again.event["event_id"] == str(event.event_id)
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(outbox))).scalar_one() == 1
        assert (await conn.execute(select(gpus.c.memory_mib).where(gpus.c.uuid == "GPU-r0"))).scalar_one() == 16384
