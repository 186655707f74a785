"""Namespace GPU quotas (enforced at reservation time by `reservations.reserve`)."""

from __future__ import annotations

from sqlalchemy import delete, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import QuotaEvent
from shared.ledger.models import quotas

QUOTA_LOCK_CLASS = 0x71756F74  # "quot": the first key of the namespaces' advisory locks (two-key space)


async def lock_quota(conn: AsyncConnection, namespace: str) -> None:
    """Serialise, until the transaction ends, everything that reads or changes `namespace`'s quota and usage.

    An advisory lock rather than a row lock (`SELECT ... FOR UPDATE` on the quota row), which PostgreSQL grants
    only to roles that may UPDATE the row: the extender and binder reserve against quotas but may not change them.
    """
    await conn.execute(
        text("SELECT pg_advisory_xact_lock(:cls, hashtext(:namespace))"),
        {"cls": QUOTA_LOCK_CLASS, "namespace": namespace},
    )


async def apply_quota(conn: AsyncConnection, event: QuotaEvent) -> None:
    """Set a namespace's quota, or remove it when both limits are None."""
    await lock_quota(conn, event.namespace)
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
