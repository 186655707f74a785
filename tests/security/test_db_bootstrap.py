"""The shipped PostgreSQL bootstrap, on a fresh server: the init script makes gpushare_migrate (not a superuser),
which migrates the schema, creates the services' roles and gives them their passwords."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest

from devstack.embedded import EmbeddedPostgres, with_database, with_user
from shared.ledger import migrate
from shared.ledger.roles import set_passwords
from tests.reliability.harness import REPO

INIT = REPO / "k8s" / "base" / "postgres-init.sh"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    data = Path(tempfile.mkdtemp(prefix="gpushare-pg-bootstrap-"))
    pg = EmbeddedPostgres(data / "data", cleanup="delete")
    try:
        yield pg.start()
    finally:
        pg.stop()
        shutil.rmtree(data, ignore_errors=True)


def _psql_env(url: str) -> dict[str, str]:
    parts = urlsplit(url)
    socket_dir = parse_qs(parts.query)["host"][0]
    bindir = Path(shutil.which("pg_ctl") or "").parent
    return {
        **os.environ,
        "PGHOST": socket_dir,
        "POSTGRES_USER": parts.username or "postgres",
        "GPUSHARE_MIGRATE_PASSWORD": "bootstrap-pw",
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
    }


async def test_init_script_then_migrate_as_the_schema_owner(server: str) -> None:
    done = await asyncio.to_thread(
        subprocess.run, ["sh", "-c", f". {INIT}"], env=_psql_env(server), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    owner = with_user(with_database(server, "gpushare"), "gpushare_migrate")
    conn = await asyncpg.connect(owner)
    try:
        me = await conn.fetchrow("SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user")
        assert (me["rolsuper"], me["rolcreaterole"]) == (False, True)
    finally:
        await conn.close()
    await asyncio.to_thread(migrate.upgrade, owner)  # as gpushare_migrate: creates and grants the roles
    await set_passwords(owner, {"gpushare_binder": "binder-pw"})
    admin = await asyncpg.connect(with_database(server, "gpushare"))
    try:
        tables_owner = await admin.fetchval("SELECT tableowner FROM pg_tables WHERE tablename = 'allocations'")
        binder = await admin.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'gpushare_binder'")
    finally:
        await admin.close()
    assert tables_owner == "gpushare_migrate"
    assert binder.startswith("SCRAM-SHA-256$")
