"""A service starts only on a ledger schema it runs on: its own, or one migration newer that says it still
supports it. On an older schema it waits, not ready, and says which command fixes it; once migrated, it starts.
Against a real PostgreSQL (the schema's states are made by the real migrations) and a real NATS server."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from devstack.embedded import free_port, with_user
from shared.http import install_common
from shared.ledger import migrate
from shared.ledger.db import make_engine
from shared.ledger.schema_version import SchemaState, Verdict, judge, read_state
from shared.runtime import Backoff, Listen, ServiceRuntime
from shared.settings import Settings
from tests.conftest import RUN_ID, create_database, drop_database
from tests.waiting import eventually

HISTORY = ("0001_a", "0002_b", "0003_c")
BEFORE_THIS_SCHEMA_CHECK = "0007_service_roles"  # the previous release's head: its roles may not read the revision


@pytest.mark.parametrize(
    ("state", "runs", "said"),
    [
        (SchemaState("0003_c"), True, ["0003_c, this build's revision"]),
        (SchemaState("0002_b"), False, ["at 0002_b, older than this build needs (0003_c)", "`gpushare migrate`"]),
        (SchemaState(None), False, ["no gpushare schema", "`gpushare migrate`"]),
        (SchemaState(None, unreadable="may not read"), False, ["predates 0003_c", "`gpushare migrate`"]),
        (SchemaState("0004_d", services_from="0003_c"), True, ["newer than this build (0003_c)", "from 0003_c on"]),
        (SchemaState("0004_d", services_from="0002_b"), True, ["supports services from 0002_b on"]),
        (SchemaState("0005_e", services_from="0004_d"), False, ["newer than this build", "ships 0005_e"]),
        (SchemaState("0005_e"), False, ["no record says it supports this build"]),
    ],
)
def test_judge(state: SchemaState, runs: bool, said: list[str]) -> None:
    verdict = judge(state, HISTORY)
    assert verdict.runs is runs
    for part in said:
        assert part in verdict.reason, verdict.reason


@pytest.fixture
def schema_db(pg_server_url: str) -> Iterator[str]:
    """A database of its own, migrated to head (the test moves it)."""
    name = f"gpushare_schema_{RUN_ID}_{uuid.uuid4().hex[:6]}"
    url = create_database(pg_server_url, name)
    yield url
    drop_database(pg_server_url, name)


async def _state(url: str) -> SchemaState:
    engine = make_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return await read_state(conn, migrate.history())
    finally:
        await engine.dispose()


async def _sql(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def _verdict(state: SchemaState) -> Verdict:
    return judge(state, migrate.history())


async def test_each_migration_records_what_it_supports(schema_db: str) -> None:
    conn = await asyncpg.connect(schema_db)
    try:
        rows = {r["revision"]: r for r in await conn.fetch("SELECT * FROM schema_revisions")}
    finally:
        await conn.close()
    head = migrate.head_revision()
    assert head in rows, "the migration that creates the table records itself"
    history = migrate.history()
    assert rows[head]["down_revision"] == history[-2]
    assert rows[head]["services_from"] in history[:-1], "the previous build runs on this schema"


async def test_the_states_a_service_finds(schema_db: str) -> None:
    head = migrate.head_revision()
    as_extender = with_user(schema_db, "gpushare_extender")
    assert _verdict(await _state(schema_db)).runs
    assert _verdict(await _state(as_extender)).runs, "the service's own role reads the revision"

    # one migration newer, supporting this build: runs; a schema that no longer supports it: does not
    await _sql(
        schema_db,
        "UPDATE alembic_version SET version_num = '9998_next'",
        "INSERT INTO schema_revisions (revision, down_revision, services_from) "
        f"VALUES ('9998_next', '{head}', '{head}')",
    )
    newer = await _state(as_extender)
    assert newer == SchemaState("9998_next", services_from=head) and _verdict(newer).runs
    await _sql(schema_db, "UPDATE schema_revisions SET services_from = '9998_next' WHERE revision = '9998_next'")
    assert not _verdict(await _state(as_extender)).runs
    await _sql(schema_db, f"UPDATE alembic_version SET version_num = '{head}'")

    # the previous release's schema: the owner reads an older revision, the service's role may not read it
    await asyncio.to_thread(migrate.downgrade, schema_db, BEFORE_THIS_SCHEMA_CHECK)
    older = await _state(schema_db)
    assert older == SchemaState(BEFORE_THIS_SCHEMA_CHECK)
    assert "older than this build needs" in _verdict(older).reason
    unreadable = await _state(as_extender)
    assert unreadable.revision is None and unreadable.unreadable
    assert "gpushare migrate" in _verdict(unreadable).reason

    await _sql(schema_db, "DROP TABLE alembic_version")
    assert "no gpushare schema" in _verdict(await _state(schema_db)).reason


def _ready_app() -> FastAPI:
    app = FastAPI()
    install_common(app)
    return app


async def test_a_service_on_an_older_schema_waits_says_why_and_starts_once_migrated(
    schema_db: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.runtime")
    await asyncio.to_thread(migrate.downgrade, schema_db, BEFORE_THIS_SCHEMA_CHECK)
    port = free_port()
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        database_url=with_user(schema_db, "gpushare_binder"),
        nats_url=nats_url,
        stream_name=f"GPUSHARE_S{tag}",
        subject_prefix=f"gss{tag}",
    )
    started = asyncio.Event()

    async def service() -> None:
        async with ServiceRuntime(
            "binder", settings, listen=Listen("127.0.0.1", port), backoff=Backoff(0.2, 1.0)
        ) as rt:
            started.set()
            rt.stop.set()
            await rt.serve(_ready_app())

    task = asyncio.create_task(service())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

            async def says_why() -> bool:
                try:
                    answer = await http.get("/readyz")
                except httpx.TransportError:
                    return False
                return answer.status_code == 503 and "gpushare migrate" in answer.json().get("reason", "")

            await eventually(says_why, what="/readyz: not ready, saying to run gpushare migrate", within=60)
            assert (await http.get("/healthz")).status_code == 200, "alive while it waits"
            reason = (await http.get("/readyz")).json()["reason"]
            assert reason.startswith("waiting for the ledger schema: the ledger schema predates"), reason
            await eventually(
                lambda: sum("waiting for the ledger schema" in r.getMessage() for r in caplog.records) >= 2,
                what="one log line per attempt",
            )
            assert not started.is_set()
            await asyncio.to_thread(migrate.upgrade, schema_db)
            await asyncio.wait_for(started.wait(), 60)
        await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"the ledger schema is at {migrate.head_revision()}, this build's revision" in m for m in lines)
    waits = [m for m in lines if "waiting for the ledger schema" in m]
    assert "run `gpushare migrate`" in waits[0] and "Traceback" not in "\n".join(lines)
