"""Transactional outbox: events are written in the same transaction as the ledger change they
describe, then relayed to JetStream. A crash between commit and publish loses nothing (the relay
publishes on restart), and a double publish is dropped by the stream's dedup on the event id."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.events.bus import EventBus
from shared.events.catalogue import encode_event, subject_for
from shared.ledger import driver

log = logging.getLogger(__name__)

RELAY_LOCK_KEY = 0x67707573686172  # "gpushar": one relay publishes at a time, in staging order

_STAGE = "INSERT INTO outbox (event_id, subject, payload) VALUES ($1, $2, $3)"
_RELAY_LOCK = "SELECT pg_advisory_xact_lock($1)"
# no row lock: the advisory lock already lets one relay at a time take rows (and a row lock would need UPDATE
# on the outbox, which no service is granted)
_TAKE = (
    "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox ORDER BY seq LIMIT $1) "
    "RETURNING seq, event_id, subject, payload"
)


async def stage(conn: AsyncConnection, prefix: str, *events: object) -> None:
    """Add events to the outbox inside the caller's transaction."""
    if not events:
        return
    await driver.execute_many(
        conn,
        _STAGE,
        [(e.event_id, subject_for(prefix, e), encode_event(e)) for e in events],  # type: ignore[attr-defined, arg-type]
    )


_STAGED = "SELECT event_id FROM outbox WHERE event_id = ANY($1::uuid[])"


async def stage_new(conn: AsyncConnection, prefix: str, events: list[Any]) -> None:
    """`stage` the events whose ids the outbox does not hold yet (each id once): a command sent again while
    its first copy still waits for the relay is not staged twice."""
    unique = list({e.event_id: e for e in events}.values())
    if not unique:
        return
    held = {r["event_id"] for r in await driver.fetch(conn, _STAGED, [e.event_id for e in unique])}
    await stage(conn, prefix, *(e for e in unique if e.event_id not in held))


def is_repeat_of_staged_event(exc: BaseException) -> bool:
    """Whether a failed transaction staged an event id the outbox already holds: the same event was applied and
    staged by an earlier transaction that the relay has not published yet (a command sent again, say)."""
    return isinstance(exc, IntegrityError) and "uq_outbox_event_id" in str(exc.orig)


class OutboxRelay:
    """Publishes staged events in order and deletes them once JetStream acknowledged them."""

    def __init__(self, engine: AsyncEngine, bus: EventBus, *, batch: int = 256, poll_s: float = 1.0) -> None:
        self.engine = engine
        self.bus = bus
        self.batch = batch
        self.poll_s = poll_s
        self.published = 0
        self._kick = asyncio.Event()

    def kick(self) -> None:
        """Ask the relay to flush now (called right after a commit that staged events)."""
        self._kick.set()

    async def flush(self) -> int:
        """Publish everything staged so far; returns how many events went out.

        Relays of all processes take turns (a transaction-scoped advisory lock), so events reach the stream
        in the order their transactions staged them: replay applies causally related changes in the order
        they happened. Each round deletes up to `batch` rows in one statement, publishes them in sequence
        order, and only then commits: a failed publish rolls the delete back. A round that found fewer than
        `batch` rows took everything visible, so no empty round follows (rows committed meanwhile come with
        their own kick).
        """
        total = 0
        while True:
            async with self.engine.begin() as conn:
                await driver.fetch(conn, _RELAY_LOCK, RELAY_LOCK_KEY)
                rows = await driver.fetch(conn, _TAKE, self.batch)
                if not rows:
                    return total
                rows.sort(key=lambda r: r["seq"])
                await asyncio.gather(
                    *(self.bus.publish_raw(r["subject"], r["payload"], str(r["event_id"])) for r in rows)
                )
            total += len(rows)
            self.published += len(rows)
            if len(rows) < self.batch:
                return total

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Flush on every kick and at least every `poll_s` seconds, until `stop` is set."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox relay: %s; will retry", exc)
                await asyncio.sleep(self.poll_s)
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.poll_s)
            except TimeoutError:
                pass
            self._kick.clear()
