"""Exactly-once effects from at-least-once delivery: remember which events a consumer applied."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.ledger.models import applied_events


async def claim(conn: AsyncConnection, consumer: str, event_id: uuid.UUID, *, at: datetime | None = None) -> bool:
    """Record that `consumer` applies `event_id` in the caller's transaction (`at`: when, the database's clock
    by default; claims are pruned after the dedupe horizon).

    Returns False when it was already applied (the caller then skips the effect). Because the claim
    commits or rolls back with the effect, a crash in between leaves neither.
    """
    values = {"consumer": consumer, "event_id": event_id} | ({"applied_at": at} if at is not None else {})
    result = await conn.execute(
        insert(applied_events).values(**values).on_conflict_do_nothing().returning(applied_events.c.event_id)
    )
    return result.first() is not None
