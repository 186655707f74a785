"""Transient database failures (refused connections, a full pool) are retried with backoff, then reported in
one short sentence; statement errors are not retried. Against a real PostgreSQL: a role allowed one
connection plays the server that says "too many clients"."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.ledger.db import UNAVAILABLE, LedgerUnavailable, is_transient, make_engine, retry_transient


def _as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{role}:{role}@{host}", parts.path, parts.query, parts.fragment))


@pytest.fixture
async def one_connection_engine(database_url: str) -> AsyncIterator[tuple[AsyncEngine, str]]:
    """An engine for a role that PostgreSQL allows a single connection (a second one is refused)."""
    role = f"limited_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{role}' CONNECTION LIMIT 1")
        await admin.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}")
        await admin.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
        url = _as_role(database_url, role)
        engine = make_engine(url, pool_size=2, max_overflow=0)
        yield engine, url
        await engine.dispose()
    finally:
        await admin.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def _select_one(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT 1"))).scalar_one())


async def test_refused_connections_are_retried_then_reported_briefly(
    one_connection_engine: tuple[AsyncEngine, str],
) -> None:
    engine, url = one_connection_engine
    holder = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))  # takes the only connection
    try:
        with pytest.raises(LedgerUnavailable) as err:
            await retry_transient(lambda: _select_one(engine), budget_s=0.6, what="test")
        assert str(err.value) == UNAVAILABLE, "one sentence, no driver text"
        assert "too many connections" in str(err.value.__cause__), "the cause stays for the log"

        async def free_soon() -> None:
            await asyncio.sleep(0.3)
            await holder.close()

        freeing = asyncio.create_task(free_soon())
        assert await retry_transient(lambda: _select_one(engine), budget_s=5, what="test") == 1
        await freeing
    finally:
        if not holder.is_closed():
            await holder.close()


async def test_statement_errors_are_not_retried(engine: AsyncEngine) -> None:
    calls = 0

    async def duplicate() -> None:
        nonlocal calls
        calls += 1
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TEMP TABLE t (k int PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO t VALUES (1), (1)"))

    with pytest.raises(IntegrityError):
        await retry_transient(duplicate, budget_s=5, what="test")
    assert calls == 1
    assert not is_transient(ValueError("x")) and is_transient(ConnectionRefusedError())


def test_outages_of_the_database_or_the_bus_are_transient_and_errors_of_the_work_are_not() -> None:
    import nats.errors

    from shared.transient import is_transient_failure

    def raised_from(cause: BaseException) -> RuntimeError:
        try:
            raise RuntimeError("handler failed") from cause
        except RuntimeError as exc:
            return exc

    for exc in (
        LedgerUnavailable(UNAVAILABLE),
        ConnectionRefusedError(),
        FileNotFoundError(2, "no socket"),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionClosedError(),
        raised_from(ConnectionResetError()),
    ):
        assert is_transient_failure(exc), exc
    for exc in (ValueError("bad"), KeyError("x"), raised_from(ValueError("bad")), nats.errors.BadSubjectError()):
        assert not is_transient_failure(exc), exc
