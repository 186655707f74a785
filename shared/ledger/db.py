"""Database connections: plain `postgresql://` URLs in, an async SQLAlchemy engine out."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

log = logging.getLogger(__name__)

T = TypeVar("T")

UNAVAILABLE = "the GPU ledger is unavailable right now (database unreachable or out of connections)"


class LedgerUnavailable(Exception):
    """The database stayed unreachable (or refused connections) for the whole retry budget."""


def is_transient(exc: BaseException) -> bool:
    """A database failure that may pass on its own: lost or refused connections, "too many clients", a full
    pool, a restart in progress, a deadlock PostgreSQL broke by aborting this transaction. Constraint
    violations and other statement errors are not."""
    if isinstance(exc, PoolTimeout | InterfaceError | OperationalError | ConnectionError | OSError | TimeoutError):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        text = str(exc.orig or exc).lower()
        return any(
            marker in text
            for marker in (
                "too many clients",
                "connection",
                "cannot connect",
                "the database system is",
                "terminat",
                "deadlock detected",  # PostgreSQL aborted one of two waiting transactions: retrying succeeds
            )
        )
    return False


async def retry_transient(fn: Callable[[], Awaitable[T]], *, budget_s: float, what: str) -> T:
    """Await `fn()`, retrying transient database failures with capped exponential backoff for `budget_s`
    seconds; then raise `LedgerUnavailable`. Other errors are raised at once."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            attempt += 1
            delay = min(2.0, 0.05 * 2**attempt) * (0.8 + 0.4 * random.random())
            if time.monotonic() - started + delay > budget_s:
                log.warning("%s: the database stayed unavailable for %.1fs: %r", what, budget_s, exc)
                raise LedgerUnavailable(UNAVAILABLE) from exc
            log.info("%s: transient database error, retrying in %.2fs: %r", what, delay, exc)
            await asyncio.sleep(delay)


def async_url(url: str) -> str:
    """Turn any PostgreSQL URL into one for SQLAlchemy's asyncpg driver.

    Accepts `postgres://`, `postgresql://` and `postgresql+<driver>://`; maps libpq's `sslmode` to
    asyncpg's `ssl`. A `host=` query parameter (a Unix socket directory) is kept.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"} and not parts.scheme.startswith("postgresql+"):
        raise ValueError(f"not a PostgreSQL URL (scheme {parts.scheme!r}); expected postgresql://...")
    query = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        query.append(("ssl", value) if key == "sslmode" else (key, value))
    return urlunsplit(("postgresql+asyncpg", parts.netloc, parts.path, urlencode(query), parts.fragment))


IDLE_TRANSACTION_TIMEOUT_S = 10.0


def make_engine(
    url: str,
    *,
    pool_size: int = 10,
    max_overflow: int = 10,
    idle_transaction_timeout_s: float = IDLE_TRANSACTION_TIMEOUT_S,
) -> AsyncEngine:
    """An async engine with a pool sized for one service process.

    No pre-ping on checkout (it costs three round trips per transaction on the hot path): after a database
    restart the first statement on each stale connection fails, SQLAlchemy then invalidates the pool, and
    the caller's retry (consumer redelivery, kube-scheduler's retry) runs on fresh connections.

    PostgreSQL ends a session that sits inside a transaction for `idle_transaction_timeout_s` (0: never): a
    process that stalls mid-transaction (stopped, swapped out, cut off) would otherwise hold its row and
    advisory locks for as long as its TCP connection lives, and every other service would queue behind it
    (the outbox relays share one lock). Its transaction rolls back; what it published meanwhile carries
    event ids that JetStream and the consumers deduplicate.
    """
    settings = {"idle_in_transaction_session_timeout": str(int(idle_transaction_timeout_s * 1000))}
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=1800,
        connect_args={"server_settings": settings},
    )
