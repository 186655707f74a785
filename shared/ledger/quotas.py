"""Namespace GPU quotas (enforced at reservation time by `reservations.reserve`)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import QuotaEvent
from shared.ledger.models import quotas


async def apply_quota(conn: AsyncConnection, event: QuotaEvent) -> None:
    """Set a namespace's quota, or remove it when both limits are None."""
    if event.memory_mib is None and event.compute is None:
        await conn.execute(delete(quotas).where(quotas.c.namespace == event.namespace))
        return
    values = {"memory_mib": event.memory_mib, "compute": event.compute, "updated_at": event.occurred_at}
    stmt = insert(quotas).values(namespace=event.namespace, **values)
    await conn.execute(stmt.on_conflict_do_update(index_elements=[quotas.c.namespace], set_=values))


async def get_quota(conn: AsyncConnection, namespace: str) -> tuple[int | None, int | None] | None:
    """(memory MiB, compute %) for a namespace, or None when it has no quota."""
    row = (await conn.execute(select(quotas).where(quotas.c.namespace == namespace))).first()
    return None if row is None else (row.memory_mib, row.compute)
