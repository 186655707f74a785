"""Migrations upgrade from empty to head and downgrade back to empty."""

from __future__ import annotations

import asyncpg
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from migrations.schema import METADATA
from shared.ledger import migrate
from shared.ledger.db import async_url, make_engine
from tests.conftest import RUN_ID, _run, create_database, drop_database

EXPECTED = {"nodes", "gpus", "allocations", "allocation_parts", "quotas", "applied_events", "usage_samples", "outbox"}


async def _tables(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows}
    finally:
        await conn.close()


def test_round_trip_from_empty_to_head_and_back(pg_server_url: str) -> None:
    name = f"gpushare_mig_{RUN_ID}"
    url = create_database(pg_server_url, name)
    try:
        assert EXPECTED <= _run(_tables(url))
        assert "alembic_version" in _run(_tables(url))
        migrate.downgrade(url, "base")
        assert _run(_tables(url)) - {"alembic_version"} == set()
        migrate.upgrade(url)
        assert EXPECTED <= _run(_tables(url))
    finally:
        drop_database(pg_server_url, name)


async def test_the_table_definitions_match_the_migrated_schema(database_url: str) -> None:
    """Autogenerate, comparing the ledger's and accounting's tables with a database at head, proposes nothing:
    the migrations create exactly the tables the code defines (wherever each is defined)."""
    engine = make_engine(database_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda sync: compare_metadata(MigrationContext.configure(sync, opts={"compare_type": True}), METADATA)
            )
    finally:
        await engine.dispose()
    assert diff == []
    assert EXPECTED <= {t for m in METADATA for t in m.tables}


def test_head_revision_is_known() -> None:
    assert migrate.head_revision()


def test_async_url_accepts_plain_postgres_urls() -> None:
    assert async_url("postgresql://u@h:5432/db").startswith("postgresql+asyncpg://u@h:5432/db")
    assert async_url("postgres://u:p@h/db?sslmode=require") == "postgresql+asyncpg://u:p@h/db?ssl=require"
    assert "host=%2Ftmp" in async_url("postgresql://postgres@/db?host=/tmp")
