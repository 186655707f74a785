"""Database connections: plain `postgresql://` URLs in, an async SQLAlchemy engine out."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sqlalchemy import event
from sqlalchemy.engine import Engine, ExceptionContext
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from shared.ledger.commit_watch import CommitWatch, watch_of
from shared.ledger.deadlines import CommitsRefused, CommitUnconfirmed, Deadlines, LedgerCannotCommit

log = logging.getLogger(__name__)

T = TypeVar("T")

UNAVAILABLE = "the GPU ledger is unavailable right now (database unreachable or out of connections)"


class LedgerUnavailable(Exception):
    """The database stayed unreachable (or refused connections) for the whole retry budget."""


READ_ONLY_SQLSTATE = "25006"  # read_only_sql_transaction: a write sent to a standby
GAVE_UP_WAITING_SQLSTATES = {"55P03", "57014"}  # lock_timeout, statement_timeout (`deadlines`)
NO_WRITABLE_HOST = "none of the hosts match the target attribute requirement"  # asyncpg, target_session_attrs


def on_read_only_server(exc: BaseException) -> bool:
    """Whether `exc` says the connection reached a server that takes no writes: a write failed there
    (SQLSTATE 25006, a standby, or a primary being demoted), or none of the URL's hosts was writable when
    connecting (`target_session_attrs=read-write`). Both pass once a primary is elected and reachable; a
    connection made to such a server is of no use for the ledger and is dropped (`make_engine`)."""
    return any(
        getattr(e, "sqlstate", None) == READ_ONLY_SQLSTATE or NO_WRITABLE_HOST in str(e).lower() for e in _chain(exc)
    )


def gave_up_waiting(exc: BaseException) -> bool:
    """Whether `exc` is PostgreSQL ending a statement at its deadline (`lock_timeout`, `statement_timeout`)."""
    return any(getattr(e, "sqlstate", None) in GAVE_UP_WAITING_SQLSTATES for e in _chain(exc))


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps (SQLAlchemy's `orig`, the adapter's `__cause__`), a few levels deep."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(out) < 5:
        out.append(current)
        current = getattr(current, "orig", None) or current.__cause__
    return out


def unavailable_reason(exc: BaseException) -> str:
    """What to tell a caller about a transient failure: why the ledger cannot commit when that is known, else
    the short general sentence (the driver's text belongs in the log)."""
    for e in _chain(exc):
        if isinstance(e, LedgerCannotCommit):
            return str(e)
    if gave_up_waiting(exc):
        return "the GPU ledger is busy: a statement waited longer than its deadline for a lock another holds"
    return UNAVAILABLE


def is_transient(exc: BaseException) -> bool:
    """A database failure that may pass on its own: lost or refused connections, "too many clients", a full
    pool, a restart in progress, a failover in progress (no writable server yet, or a connection that reached
    a standby), a deadlock PostgreSQL broke by aborting this transaction. Constraint violations and other
    statement errors are not. A COMMIT that missed its deadline (its outcome is settled by the retry), one refused
    while the ledger cannot commit, and a statement PostgreSQL ended at its deadline may pass too."""
    if isinstance(exc, LedgerCannotCommit) or gave_up_waiting(exc):
        return True
    if isinstance(exc, PoolTimeout | InterfaceError | OperationalError | ConnectionError | OSError | TimeoutError):
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated or on_read_only_server(exc):
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


async def retry_transient(
    fn: Callable[[], Awaitable[T]],
    *,
    budget_s: float,
    what: str,
    transient: Callable[[BaseException], bool] = is_transient,
) -> T:
    """Await `fn()`, retrying transient database failures (or what `transient` says passes: NATS's too, with
    `shared.transient.is_transient_failure`) with capped exponential backoff for `budget_s` seconds; then raise
    `LedgerUnavailable` saying why (`unavailable_reason`), at once while the ledger's COMMITs are known to be held
    (`CommitsRefused`: the commit watch's probe, not this caller, sees when they pass). Other errors are raised at
    once."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not transient(exc):
                raise
            if isinstance(exc, CommitsRefused):  # known to be held: waiting out the budget would only delay the answer
                log.info("%s: %s", what, exc)
                raise LedgerUnavailable(str(exc)) from exc
            attempt += 1
            delay = min(2.0, 0.05 * 2**attempt) * (0.8 + 0.4 * random.random())
            if time.monotonic() - started + delay > budget_s:
                log.warning("%s: the database stayed unavailable for %.1fs: %r", what, budget_s, exc)
                raise LedgerUnavailable(unavailable_reason(exc)) from exc
            log.info("%s: transient error, retrying in %.2fs: %r", what, delay, exc)
            await asyncio.sleep(delay)


def async_url(url: str) -> str:
    """Turn any PostgreSQL URL into one for SQLAlchemy's asyncpg driver.

    Accepts `postgres://`, `postgresql://` and `postgresql+<driver>://`; maps libpq's `sslmode` to
    asyncpg's `ssl`. A `host=` query parameter (a Unix socket directory) is kept. A multi-host URL, libpq's
    `postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write`, becomes SQLAlchemy's form of it
    (`postgresql+asyncpg://user@/db?host=h1:5432&host=h2:5432&...`; a host without a port gets 5432): asyncpg
    then tries the hosts in order and keeps the first that `target_session_attrs` accepts (read-write: the
    primary), on every new connection, so a pool finds the new primary after a failover by itself.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"} and not parts.scheme.startswith("postgresql+"):
        raise ValueError(f"not a PostgreSQL URL (scheme {parts.scheme!r}); expected postgresql://...")
    query = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        query.append(("ssl", value) if key == "sslmode" else (key, value))
    netloc = parts.netloc
    userinfo, _, hostlist = netloc.rpartition("@")
    if "," in hostlist:
        hosts = [_with_port(h) for h in hostlist.split(",")]
        netloc = f"{userinfo}@" if userinfo else ""
        query = [("host", h) for h in hosts] + query
    return urlunsplit(("postgresql+asyncpg", netloc, parts.path, urlencode(query), parts.fragment))


def database_hosts(url: str) -> list[str]:
    """The `host:port` entries of a (multi-host) PostgreSQL URL, in order (for logs and error messages)."""
    hostlist = urlsplit(url).netloc.rpartition("@")[2]
    return [_with_port(h) for h in hostlist.split(",")] if hostlist else []


def _with_port(host: str) -> str:
    """`host:port`, with PostgreSQL's 5432 when no port is given (an IPv6 literal keeps its brackets)."""
    host = host.strip()
    if not host:
        raise ValueError("a multi-host PostgreSQL URL has an empty host between its commas")
    if host.startswith("["):
        return host if "]:" in host else f"{host}:5432"
    return host if ":" in host else f"{host}:5432"


IDLE_TRANSACTION_TIMEOUT_S = 10.0


def make_engine(
    url: str,
    *,
    pool_size: int = 10,
    max_overflow: int = 10,
    idle_transaction_timeout_s: float = IDLE_TRANSACTION_TIMEOUT_S,
    deadlines: Deadlines | None = None,
) -> AsyncEngine:
    """An async engine with a pool sized for one service process, every wait on it bounded by `deadlines`.

    No pre-ping on checkout (it costs three round trips per transaction on the hot path): after a database
    restart the first statement on each stale connection fails, SQLAlchemy then invalidates the pool, and
    the caller's retry (consumer redelivery, kube-scheduler's retry) runs on fresh connections. A statement
    refused because the server has become read-only (a failover moved the primary elsewhere, and the URL's
    endpoint still leads to the old one) counts as such a disconnect too: the pool is emptied and new
    connections look for the writable server again (`target_session_attrs=read-write` in the URL makes them
    pass over standbys).

    PostgreSQL ends a session that sits inside a transaction for `idle_transaction_timeout_s` (0: never): a
    process that stalls mid-transaction (stopped, swapped out, cut off) would otherwise hold its row and
    advisory locks for as long as its TCP connection lives, and every other service would queue behind it
    (the outbox relays share one lock). Its transaction rolls back; what it published meanwhile carries
    event ids that JetStream and the consumers deduplicate.

    Connecting, taking a connection from the pool, waiting for a lock, a statement and a COMMIT each have a
    deadline (`deadlines`, default `Deadlines()`: the table there). COMMITs go through the engine's
    `CommitWatch` (`watch_of(engine)`), which also knows whether the ledger can commit now.
    """
    deadlines = deadlines or Deadlines()
    watch = CommitWatch(deadlines)
    settings = {
        "idle_in_transaction_session_timeout": str(int(idle_transaction_timeout_s * 1000)),
        **deadlines.server_settings(),
    }
    engine = create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=1800,
        pool_timeout=deadlines.checkout_s,
        connect_args={
            "server_settings": settings,
            "timeout": deadlines.connect_s,
            "command_timeout": deadlines.client_statement_s,
            "connection_class": watch.connection_class,
        },
    )
    watch.attach(engine)
    event.listen(engine.sync_engine, "handle_error", _explain)
    watch.attach_reader(_reader(engine))
    return engine


def reading(engine: AsyncEngine) -> AsyncConnection:
    """A connection of `engine`'s pool for reads alone (`async with reading(engine) as conn:`), in autocommit.

    Through `engine.connect()` SQLAlchemy's asyncpg adapter sends BEGIN before the first statement and ROLLBACK
    when the connection goes back to the pool: three round trips for a one-statement read (0.55 ms of the
    caller's CPU against 0.34 in a loop of one-row reads). Under READ COMMITTED, the ledger's level, each
    statement takes its own snapshot inside a transaction or not, so a read loses nothing. Never write through
    it (each statement would commit on its own), nor lock rows (a row lock ends with its statement); a read that
    needs one view of several statements needs a REPEATABLE READ transaction, which READ COMMITTED never gave.
    """
    return _reader(engine).connect()


def _reader(engine: AsyncEngine) -> AsyncEngine:
    """`engine` in autocommit (the same pool), made once per engine."""
    sync = engine.sync_engine
    reader: AsyncEngine | None = sync.__dict__.get("_gpushare_reader")
    if reader is None:
        reader = engine.execution_options(isolation_level="AUTOCOMMIT")
        sync.__dict__["_gpushare_reader"] = reader
    return reader


def _explain(context: ExceptionContext) -> BaseException | None:
    """SQLAlchemy's error hook. A connection of no further use is dropped: one on a read-only server (with the
    rest of the pool), one whose COMMIT missed its deadline or whose statement the client gave up on (alone). A
    statement PostgreSQL ended at its deadline while the ledger's COMMITs are held says so (`CommitsRefused`):
    the lock it waited for belongs to a held transaction."""
    original = context.original_exception
    if on_read_only_server(original):
        context.is_disconnect = True
    elif isinstance(original, CommitUnconfirmed | TimeoutError):
        context.is_disconnect = True
        context.invalidate_pool_on_disconnect = False
    elif gave_up_waiting(original):
        return held_instead(original, context.engine)
    return None


def held_instead(exc: BaseException, engine: AsyncEngine | Engine) -> CommitsRefused | None:
    """`CommitsRefused` in place of a statement that gave up waiting while `engine`'s COMMITs are held (None
    otherwise)."""
    watch = watch_of(engine)
    if watch is None or watch.blocked is None or not watch.holding:
        return None
    refused = CommitsRefused(watch.blocked.reason)
    refused.__cause__ = exc
    return refused
