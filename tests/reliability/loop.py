"""An asyncio loop on its own thread, so synchronous code (hypothesis state machines) can drive async I/O, and
what the state machines that drive the real ledger share."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, settings
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import Event, decode_event
from shared.ledger.db import make_engine
from shared.ledger.models import outbox
from shared.ledger.replay import load_state
from shared.ledger.state import LedgerState
from tests.conftest import LEDGER_TABLES
from tests.reliability.profile import PROFILE

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on a private event loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reliability-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coro` to completion on the private loop and return its result (or raise its error)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# -- driving the real ledger from a hypothesis state machine -------------------------------------------------


def ledger_env(database_url: str) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    """A private loop and an engine on the test database, for a module-scoped fixture (`yield from`)."""
    runner = LoopThread()
    engine = make_engine(database_url, pool_size=3)
    yield runner, engine
    runner.run(engine.dispose())
    runner.close()


async def empty_ledger(engine: AsyncEngine) -> None:
    """Empty every ledger table (each example of a state machine starts from nothing)."""
    async with engine.begin() as conn:
        await conn.execute(text(f"TRUNCATE {', '.join(LEDGER_TABLES)} RESTART IDENTITY CASCADE"))


async def staged_events(engine: AsyncEngine, after_seq: int) -> list[tuple[int, Event]]:
    """(outbox sequence, event) of every event the ledger staged after `after_seq`, in order."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(outbox.c.seq, outbox.c.payload).where(outbox.c.seq > after_seq).order_by(outbox.c.seq)
            )
        ).all()
    return [(row.seq, decode_event(row.payload)) for row in rows]


async def ledger_tables(engine: AsyncEngine) -> LedgerState:
    """The ledger's tables as a `LedgerState`."""
    async with engine.connect() as conn:
        return await load_state(conn)


_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)


def machine_settings(examples: int, steps: int) -> settings:
    """A state machine's settings: bounded, derandomized except in a soak, and shrinking only with
    GPUSHARE_SHRINK=1 (shrinking a failing run against the database can take many minutes)."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=not PROFILE.soak,
        database=None,
        phases=tuple(Phase)
        if os.environ.get("GPUSHARE_SHRINK")
        else (Phase.explicit, Phase.reuse, Phase.generate, Phase.target),
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
