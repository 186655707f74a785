"""Waiting for the binder's verdict on a reservation: bus events first, a ledger poll as fallback.

A `bound` event settles the outcome by itself (once it is published the ledger row has `bound_at`, which
is what makes an allocation count as bound). Other events (failed, released, assigned) may be stale or
late relative to the ledger, so they only wake the waiter for one ledger read.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.ledger.db import reading
from shared.ledger.models import allocations
from shared.ledger.rules import AllocationState


@dataclass(frozen=True)
class Outcome:
    """How a reservation ended up: bound (the Binding exists) or not, with the reason."""

    bound: bool
    state: str
    reason: str = ""


BOUND = Outcome(True, AllocationState.BOUND.value)


class OutcomeWaiter:
    """Futures keyed by allocation id, resolved by `notify` (bus) or by polling the ledger."""

    def __init__(self, engine: AsyncEngine, *, poll_s: float = 1.0) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self.reads = 0  # ledger reads so far (observability and tests)
        self._waiting: dict[uuid.UUID, list[asyncio.Future[Outcome | None]]] = {}

    def notify(self, allocation_id: uuid.UUID, outcome: Outcome | None = None) -> None:
        """Something happened to this allocation: hand waiters the outcome when the event settles it,
        else (None) wake them for one ledger read."""
        for fut in self._waiting.get(allocation_id, ()):
            if not fut.done():
                fut.set_result(outcome)

    async def state(self, allocation_id: uuid.UUID) -> Outcome | None:
        """The allocation's outcome from the ledger, or None while it is still only reserved."""
        self.reads += 1
        async with reading(self.engine) as conn:
            row = (
                await conn.execute(
                    select(allocations.c.state, allocations.c.bound_at, allocations.c.reason).where(
                        allocations.c.id == allocation_id
                    )
                )
            ).first()
        if row is None:
            return Outcome(False, "missing", "the reservation disappeared from the ledger")
        if row.state == AllocationState.RESERVED:
            return None
        bound = row.state in (AllocationState.BOUND, AllocationState.ASSIGNED) or row.bound_at is not None
        return Outcome(bound, row.state, row.reason or "")

    async def wait(self, allocation_id: uuid.UUID, timeout_s: float, *, check_first: bool = True) -> Outcome | None:
        """The outcome, or None when the reservation is still pending after `timeout_s`.

        The ledger is read at the start (unless `check_first` is False: a reservation this process has just
        created, whose events cannot have been published before the waiter was registered), after a
        non-decisive event, and every `poll_s` without events (the fallback for a missed message).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        read = check_first
        while True:
            fut: asyncio.Future[Outcome | None] = loop.create_future()
            self._waiting.setdefault(allocation_id, []).append(fut)
            try:
                if read:
                    outcome = await self.state(allocation_id)
                    if outcome is not None:
                        return outcome
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    outcome = await asyncio.wait_for(fut, min(self.poll_s, left))
                except TimeoutError:
                    outcome = None
                if outcome is not None:
                    return outcome
                read = True
            finally:
                waiters = self._waiting.get(allocation_id, [])
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters:
                    self._waiting.pop(allocation_id, None)
