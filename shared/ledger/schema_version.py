"""Which ledger schemas a build runs on: its own head, or a newer schema that still supports it.

A service reads the database's revision (alembic's `alembic_version`) before it starts:

- at this build's head: it runs;
- older (a revision of this build's history, or no schema at all): it does not start, and says which command
  fixes it (`gpushare migrate`);
- newer (a revision this build does not know): it runs when that schema still supports this build. Each
  migration records, in `schema_revisions`, the oldest revision whose services run on the schema it leaves
  (`services_from`: by default the revision before it, so a build runs on a schema one migration newer than
  its own; a migration may name an older one when every migration in between only adds, which
  tests/foundation/test_migration_rules.py checks). A build older than that does not start, and says so.

Migrations are additive across one release (expand, then contract in the next; docs/operations.md,
"Upgrades"): the previous release's services keep running while the new release's migration runs and its
pods roll out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, DateTime, MetaData, String, Table, Text, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

MIGRATE_COMMAND = "gpushare migrate"
HOW_TO_MIGRATE = (
    f"run `{MIGRATE_COMMAND}` with the new release (Kubernetes: its gpushare-migrate-<version> Job; "
    "`helm upgrade` runs it first)"
)
UNDEFINED_TABLE = "42P01"
INSUFFICIENT_PRIVILEGE = "42501"

metadata = MetaData()

schema_revisions = Table(
    "schema_revisions",
    metadata,
    Column("revision", Text, primary_key=True),
    Column("down_revision", Text),
    Column("services_from", Text, nullable=False),
    Column("applied_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
"""Each applied migration, and the oldest revision whose services run on the schema it leaves."""

alembic_version = Table("alembic_version", MetaData(), Column("version_num", String(32), primary_key=True))
"""alembic's own table, as alembic creates it (read only here; not in `metadata`: the migrations do not make it)."""


@dataclass(frozen=True)
class SchemaState:
    """What the database says about its schema."""

    revision: str | None  # alembic_version's; None: no gpushare schema (or one this role may not read)
    services_from: str | None = None  # schema_revisions' entry for `revision`, when there is one
    unreadable: str | None = None  # why the revision could not be read, when it could not


@dataclass(frozen=True)
class Verdict:
    """Whether a build runs on a schema, and the sentence that says why (logs, /readyz)."""

    runs: bool
    reason: str


def judge(state: SchemaState, history: Sequence[str]) -> Verdict:
    """Whether the build whose migrations are `history` (oldest first, its head last) runs on `state` (pure)."""
    head = history[-1]
    at = state.revision
    if at is None:
        if state.unreadable:
            return Verdict(
                False,
                f"the ledger schema predates {head}, the revision this build needs ({state.unreadable}): "
                f"{HOW_TO_MIGRATE}",
            )
        return Verdict(False, f"the database has no gpushare schema yet (this build needs {head}): {HOW_TO_MIGRATE}")
    if at == head:
        return Verdict(True, f"the ledger schema is at {head}, this build's revision")
    if at in history:
        return Verdict(False, f"the ledger schema is at {at}, older than this build needs ({head}): {HOW_TO_MIGRATE}")
    if state.services_from is not None and state.services_from in history:
        return Verdict(
            True,
            f"the ledger schema is at {at}, newer than this build ({head}); it supports services from "
            f"{state.services_from} on, so this one runs on it: upgrade it to the release that ships {at}",
        )
    supported = (
        f"it supports services from {state.services_from} on"
        if state.services_from
        else "no record says it supports this build"
    )
    return Verdict(
        False,
        f"the ledger schema is at {at}, newer than this build ({head}), and {supported}: run the release that "
        f"ships {at} (or newer)",
    )


def _sqlstate(exc: DBAPIError) -> str | None:
    return getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)


async def read_state(conn: AsyncConnection, history: Sequence[str]) -> SchemaState:
    """The database's schema revision and, for a revision this build does not know, what it supports."""
    try:
        revision = (await conn.execute(select(alembic_version.c.version_num))).scalar_one_or_none()
    except DBAPIError as exc:
        state = _sqlstate(exc)
        await conn.rollback()
        if state == UNDEFINED_TABLE:
            return SchemaState(None)
        if state == INSUFFICIENT_PRIVILEGE:
            return SchemaState(None, unreadable="this service's role may not read alembic_version yet")
        raise
    if revision is None or revision in history:
        return SchemaState(revision)
    services_from = (
        await conn.execute(select(schema_revisions.c.services_from).where(schema_revisions.c.revision == revision))
    ).scalar_one_or_none()
    return SchemaState(revision, services_from)


def record_step(connection: Any, revision: str, down_revision: str | None, services_from: str) -> None:
    """Record an applied migration in `schema_revisions` (from the migration environment, in its transaction;
    nothing before the table exists)."""
    exists = connection.execute(text("SELECT to_regclass('schema_revisions') IS NOT NULL")).scalar_one()
    if not exists:
        return
    connection.execute(
        text(
            "INSERT INTO schema_revisions (revision, down_revision, services_from) "
            "VALUES (:revision, :down_revision, :services_from) ON CONFLICT (revision) DO UPDATE SET "
            "down_revision = EXCLUDED.down_revision, services_from = EXCLUDED.services_from, applied_at = now()"
        ),
        {"revision": revision, "down_revision": down_revision, "services_from": services_from},
    )
