"""Schema migrations, run programmatically (no alembic.ini needed), and which revisions this build knows."""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path
from types import ModuleType

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(database_url: str) -> Config:
    """An alembic configuration pointing at the project's migrations and the given database."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def head_revision() -> str:
    """The newest migration revision shipped with this build."""
    script = ScriptDirectory.from_config(alembic_config("postgresql://unused/unused"))
    head = script.get_current_head()
    assert head is not None
    return head


@cache
def history() -> tuple[str, ...]:
    """Every migration revision shipped with this build, oldest first (its head last)."""
    script = ScriptDirectory.from_config(alembic_config("postgresql://unused/unused"))
    return tuple(reversed([r.revision for r in script.walk_revisions()]))


def services_from(module: ModuleType, down_revision: str | None) -> str:
    """The oldest revision whose services run on the schema a migration leaves: its `services_from`, by default
    the revision before it (the previous build runs on a schema one migration newer than its own)."""
    declared = getattr(module, "services_from", None)
    return declared or down_revision or module.revision


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database up to `revision` (blocking; do not call from a running event loop)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Migrate the database down to `revision` (`base` removes every table)."""
    command.downgrade(alembic_config(database_url), revision)


async def upgrade_async(database_url: str, revision: str = "head") -> None:
    """`upgrade` for async callers (alembic runs its own event loop, so it goes to a thread)."""
    await asyncio.to_thread(upgrade, database_url, revision)


async def downgrade_async(database_url: str, revision: str = "base") -> None:
    """`downgrade` for async callers."""
    await asyncio.to_thread(downgrade, database_url, revision)
