"""Services refuse the shipped placeholder secrets (change-me...), naming the setting, unless development says so;
`gpushare migrate` gives the service roles their passwords as SCRAM verifiers."""

from __future__ import annotations

import base64

import asyncpg
import pytest

from shared.ledger.roles import scram_verifier
from tests.reliability.harness import run_gpushare

UNREACHABLE_DB = "postgresql://gpushare_extender@127.0.0.1:9/gpushare"
UNREACHABLE_NATS = "nats://127.0.0.1:9"


@pytest.mark.parametrize(
    ("command", "env", "named"),
    [
        (["extender"], {"GPUSHARE_DATABASE_PASSWORD": "change-me-extender"}, "GPUSHARE_DATABASE_PASSWORD"),
        (["binder"], {"GPUSHARE_DATABASE_URL": "postgresql://b:change-me@127.0.0.1:9/g"}, "GPUSHARE_DATABASE_URL"),
        (["accounting"], {"GPUSHARE_ADMIN_TOKEN": "change-me-admin-token"}, "GPUSHARE_ADMIN_TOKEN"),
        (
            ["node-agent", "--node", "n1"],
            {"GPUSHARE_NATS_PASSWORD": "change-me-node-agent", "GPUSHARE_NATS_USER": "gpushare-node-agent"},
            "GPUSHARE_NATS_PASSWORD",
        ),
        (
            ["node-agent", "--node", "n1"],
            {"GPUSHARE_NATS_URL": "nats://change-me-token@127.0.0.1:9"},
            "GPUSHARE_NATS_URL",
        ),
        (["migrate"], {"GPUSHARE_DB_PASSWORD_BINDER": "change-me-binder"}, "GPUSHARE_DB_PASSWORD_BINDER"),
    ],
    ids=["extender-db", "binder-db-url", "accounting-token", "agent-nats-password", "agent-nats-token", "migrate"],
)
def test_a_placeholder_secret_stops_the_service_naming_the_setting(
    command: list[str], env: dict[str, str], named: str
) -> None:
    base = {"GPUSHARE_DATABASE_URL": UNREACHABLE_DB, "GPUSHARE_NATS_URL": UNREACHABLE_NATS}
    done = run_gpushare(*command, env={**base, **env}, timeout_s=60)
    assert done.returncode != 0
    assert "refusing to start" in done.stderr and named in done.stderr and "change-me" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    for secret in env.values():
        if "change-me-" in secret and "@" not in secret:
            assert secret not in done.stderr  # the setting is named, the value is not repeated


def test_the_development_flag_lets_a_placeholder_through_with_a_warning(database_url: str) -> None:
    env = {"GPUSHARE_ALLOW_DEV_SECRETS": "true", "GPUSHARE_ADMIN_TOKEN": "change-me-admin-token"}
    done = run_gpushare("migrate", "--database-url", database_url, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "GPUSHARE_ADMIN_TOKEN" in done.stderr and "development only" in done.stderr


async def test_migrate_sets_the_service_roles_passwords_as_scram_verifiers(database_url: str) -> None:
    env = {"GPUSHARE_DB_PASSWORD_EXTENDER": "Extender-pw-1", "GPUSHARE_DB_PASSWORD_ACCOUNTING": "Acc'pw;2"}
    done = run_gpushare("migrate", "--database-url", database_url, "--log-level", "DEBUG", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Extender-pw-1" not in done.stderr + done.stdout and "Acc'pw;2" not in done.stderr + done.stdout
    conn = await asyncpg.connect(database_url)
    try:
        stored = {
            r["rolname"]: r["rolpassword"]
            for r in await conn.fetch("SELECT rolname, rolpassword FROM pg_authid WHERE rolname LIKE 'gpushare_%'")
        }
        await conn.execute("SET password_encryption = 'scram-sha-256'")
        await conn.execute("DROP ROLE IF EXISTS gpushare_scram_probe")
        await conn.execute("CREATE ROLE gpushare_scram_probe PASSWORD 'Acc''pw;2'")
        reference = await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'gpushare_scram_probe'")
        await conn.execute("DROP ROLE gpushare_scram_probe")
    finally:
        await conn.close()
    for role, password in (("gpushare_extender", "Extender-pw-1"), ("gpushare_accounting", "Acc'pw;2")):
        verifier = stored[role]
        assert verifier.startswith("SCRAM-SHA-256$4096:"), verifier
        iterations, salt = verifier.split("$")[1].split(":")
        assert scram_verifier(password, salt=base64.b64decode(salt), iterations=int(iterations)) == verifier
    # ours agrees with PostgreSQL's own hashing of the same password and salt
    iterations, salt = reference.split("$")[1].split(":")
    assert scram_verifier("Acc'pw;2", salt=base64.b64decode(salt), iterations=int(iterations)) == reference


def test_the_database_password_setting_joins_the_url_quoted() -> None:
    """The manifests give each service its role in the URL and its password from a Secret."""
    from urllib.parse import unquote, urlsplit

    from pydantic import SecretStr

    from shared.settings import Settings

    url = "postgresql://gpushare_binder@postgres:5432/gpushare?sslmode=verify-full"
    settings = Settings(database_url=SecretStr(url), database_password=SecretStr("p@ss/w:rd"))
    joined = settings.require_database_url()
    parts = urlsplit(joined)
    assert (parts.username, parts.hostname) == ("gpushare_binder", "postgres")
    assert unquote(parts.password or "") == "p@ss/w:rd"
    assert parts.path == "/gpushare" and parts.query == "sslmode=verify-full"
    kept = Settings(database_url=SecretStr("postgresql://u:own@h/d"), database_password=SecretStr("other"))
    assert kept.require_database_url() == "postgresql://u:own@h/d"
    with pytest.raises(SystemExit, match="needs a user"):
        Settings(database_url=SecretStr("postgresql://h/d"), database_password=SecretStr("x")).require_database_url()
