"""Waiting for the binder's verdict on a reservation: bus events first, a ledger poll as fallback."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.ledger.models import allocations


@dataclass(frozen=True)
class Outcome:
    """How a reservation ended up: bound (the Binding exists) or not, with the reason."""

    bound: bool
    state: str
    reason: str = ""


class OutcomeWaiter:
    """Futures keyed by allocation id, resolved by `notify` (bus) or by polling the ledger."""

    def __init__(self, engine: AsyncEngine, *, poll_s: float = 1.0) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self._waiting: dict[uuid.UUID, list[asyncio.Future[None]]] = {}

    def notify(self, allocation_id: uuid.UUID) -> None:
        """Something happened to this allocation: wake its waiters (they read the ledger)."""
        for fut in self._waiting.get(allocation_id, ()):
            if not fut.done():
                fut.set_result(None)

    async def state(self, allocation_id: uuid.UUID) -> Outcome | None:
        """The allocation's outcome from the ledger, or None while it is still only reserved."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(allocations.c.state, allocations.c.bound_at, allocations.c.reason).where(
                        allocations.c.id == allocation_id
                    )
                )
            ).first()
        if row is None:
            return Outcome(False, "missing", "the reservation disappeared from the ledger")
        if row.state == "reserved":
            return None
        bound = row.state in ("bound", "assigned") or row.bound_at is not None
        return Outcome(bound, row.state, row.reason or "")

    async def wait(self, allocation_id: uuid.UUID, timeout_s: float) -> Outcome | None:
        """The outcome, or None when the reservation is still pending after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            self._waiting.setdefault(allocation_id, []).append(fut)
            try:
                outcome = await self.state(allocation_id)
                if outcome is not None:
                    return outcome
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(fut, min(self.poll_s, left))
                except TimeoutError:
                    pass
            finally:
                waiters = self._waiting.get(allocation_id, [])
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters:
                    self._waiting.pop(allocation_id, None)
