"""Exactly-once effects from at-least-once delivery: remember which events a consumer applied."""

from __future__ import annotations

import uuid

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.ledger.models import applied_events


async def claim(conn: AsyncConnection, consumer: str, event_id: uuid.UUID) -> bool:
    """Record that `consumer` applies `event_id` in the caller's transaction.

    Returns False when it was already applied (the caller then skips the effect). Because the claim
    commits or rolls back with the effect, a crash in between leaves neither.
    """
    result = await conn.execute(
        insert(applied_events)
        .values(consumer=consumer, event_id=event_id)
        .on_conflict_do_nothing()
        .returning(applied_events.c.event_id)
    )
    return result.first() is not None
