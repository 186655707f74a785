"""Alembic environment: runs migrations over the project's async (asyncpg) engine."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from migrations.schema import METADATA
from shared.ledger.db import async_url
from shared.ledger.migrate import services_from
from shared.ledger.schema_version import record_step

config = context.config
target_metadata = list(METADATA)


def _record(ctx, step, heads, run_args) -> None:  # type: ignore[no-untyped-def]
    """After each upgrade step, in its transaction: record it in `schema_revisions` (what services it supports)."""
    if not step.is_upgrade or step.is_stamp:
        return
    script = step.up_revision
    down = step.down_revision_ids[0] if step.down_revision_ids else None
    record_step(ctx.connection, script.revision, down, services_from(script.module, down))


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection, target_metadata=target_metadata, compare_type=True, on_version_apply=_record
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(async_url(config.get_main_option("sqlalchemy.url") or ""))
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    """Connect and migrate (offline SQL generation is not supported)."""
    asyncio.run(_run_async())


run_migrations_online()
