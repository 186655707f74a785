"""Namespace GPU quotas: what a namespace holds against them, enforced when the extender reserves
(`reservations.reserve`) and when a gpushare ResourceClaim is created (`claim_holds.admit_claim`)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, delete, exists, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import QuotaEvent
from shared.ledger.models import allocations, claim_holds, quotas
from shared.ledger.rules import LIVE_STATE_VALUES

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


@dataclass(frozen=True)
class Usage:
    """What a namespace holds against its quota: live allocations, and claims admitted but not allocated."""

    allocated_mib: int
    allocated_compute: int
    waiting_mib: int
    waiting_compute: int
    waiting_claims: int

    @property
    def memory_mib(self) -> int:
        return self.allocated_mib + self.waiting_mib

    @property
    def compute(self) -> int:
        return self.allocated_compute + self.waiting_compute


def unallocated_hold() -> ColumnElement[bool]:
    """The holds whose claim holds no live allocation (an allocated claim counts through its allocation)."""
    live = and_(allocations.c.claim_uid == claim_holds.c.claim_uid, allocations.c.state.in_(LIVE_STATE_VALUES))
    return ~exists().where(live)


async def namespace_usage(conn: AsyncConnection, namespace: str) -> Usage:
    """What `namespace` holds now: its live allocations and the holds of its claims not allocated yet (read it under
    the namespace's quota lock to act on it)."""
    allocated = (
        await conn.execute(
            select(
                func.coalesce(func.sum(allocations.c.memory_mib), 0),
                func.coalesce(func.sum(allocations.c.compute), 0),
            ).where(and_(allocations.c.namespace == namespace, allocations.c.state.in_(LIVE_STATE_VALUES)))
        )
    ).one()
    waiting = (
        await conn.execute(
            select(
                func.coalesce(func.sum(claim_holds.c.memory_mib), 0),
                func.coalesce(func.sum(claim_holds.c.compute), 0),
                func.count(),
            ).where(and_(claim_holds.c.namespace == namespace, unallocated_hold()))
        )
    ).one()
    return Usage(int(allocated[0]), int(allocated[1]), int(waiting[0]), int(waiting[1]), int(waiting[2]))
