"""Secrets never reach the logs, and accounting's bearer-token check is constant-time and correct."""

from __future__ import annotations

import ast
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from shared.logging import redact
from tests.reliability.harness import REPO, ServiceProcess, run_gpushare

DB_PASSWORD = "Pw-" + uuid.uuid4().hex  # trust auth on the embedded server ignores it; the logs must too
ADMIN_TOKEN = "tok-" + uuid.uuid4().hex
WRONG_TOKEN = "bad-" + uuid.uuid4().hex


def with_password(url: str, password: str) -> str:
    """The same PostgreSQL URL with a password in its user info."""
    parts = urlsplit(url)
    user = parts.username or "postgres"
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


def test_redact_masks_every_secret_shape() -> None:
    line = (
        f"connect postgresql://gpushare:{DB_PASSWORD}@db:5432/x Authorization: Bearer {ADMIN_TOKEN} "
        f"token={ADMIN_TOKEN} password: {DB_PASSWORD}"
    )
    out = redact(line)
    assert DB_PASSWORD not in out and ADMIN_TOKEN not in out
    assert "postgresql://gpushare:***@db:5432/x" in out


@pytest.mark.parametrize("level", ["DEBUG", "INFO"])
def test_migrate_never_logs_the_database_password(database_url: str, level: str) -> None:
    url = with_password(database_url, DB_PASSWORD)
    done = run_gpushare("migrate", "--database-url", url, "--log-level", level)
    assert done.returncode == 0, done.stderr[-2000:]
    assert DB_PASSWORD not in done.stdout + done.stderr


def test_a_failing_connection_does_not_leak_the_password() -> None:
    url = f"postgresql://gpushare:{DB_PASSWORD}@127.0.0.1:9/nowhere"
    done = run_gpushare("migrate", "--database-url", url, "--log-level", "DEBUG")
    assert done.returncode != 0
    assert DB_PASSWORD not in done.stdout + done.stderr, done.stderr[-2000:]


def test_ledger_rebuild_never_logs_the_database_password(database_url: str, nats_url: str) -> None:
    url = with_password(database_url, DB_PASSWORD)
    tag = uuid.uuid4().hex[:8]
    done = run_gpushare(
        "ledger",
        "rebuild",
        "--database-url",
        url,
        "--nats-url",
        nats_url,
        "--stream-name",
        f"GPUSHARE_SEC{tag}",
        "--subject-prefix",
        f"gssec{tag}",
        "--log-level",
        "DEBUG",
    )
    assert DB_PASSWORD not in done.stdout + done.stderr


@pytest.fixture(scope="module")
def accounting(database_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tag = uuid.uuid4().hex[:8]
    svc = ServiceProcess(
        "accounting",
        ["accounting", "--host", "127.0.0.1"],
        env={
            "GPUSHARE_DATABASE_URL": with_password(database_url, DB_PASSWORD),
            "GPUSHARE_NATS_URL": nats_url,
            "GPUSHARE_ADMIN_TOKEN": ADMIN_TOKEN,
            "GPUSHARE_STREAM_NAME": f"GPUSHARE_SEC{tag}",
            "GPUSHARE_SUBJECT_PREFIX": f"gssec{tag}",
            "GPUSHARE_LOG_LEVEL": "DEBUG",
        },
        log_dir=tmp_path_factory.mktemp("accounting-logs"),
    ).start()
    try:
        svc.wait_ready()
        yield svc
    finally:
        svc.stop()


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Basic dXNlcjpwdw=="}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": f"Bearer {WRONG_TOKEN}"}, 403),
        ({"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"}, 403),
        ({"Authorization": f"Bearer {ADMIN_TOKEN}x"}, 403),
        ({"Authorization": f"Bearer {ADMIN_TOKEN}"}, 200),
    ],
    ids=["none", "basic", "empty-bearer", "wrong", "prefix", "longer", "right"],
)
def test_quota_changes_need_the_right_bearer_token(
    accounting: ServiceProcess, headers: dict[str, str], status: int
) -> None:
    ns = f"sec-{uuid.uuid4().hex[:6]}"
    reply = httpx.put(f"{accounting.base_url}/v1/quotas/{ns}", json={"memory_mib": 1024}, headers=headers, timeout=10)
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    if status != 200:
        assert reply.json().get("error")
        deleted = httpx.delete(f"{accounting.base_url}/v1/quotas/{ns}", headers=headers, timeout=10)
        assert deleted.status_code == status


def test_accounting_logs_hold_no_token_or_password(accounting: ServiceProcess) -> None:
    for token in (ADMIN_TOKEN, WRONG_TOKEN):
        httpx.put(
            f"{accounting.base_url}/v1/quotas/logcheck",
            json={"memory_mib": 1},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
    logs = accounting.all_logs()
    assert "refused a quota change" in logs, "the wrong-token attempt should be logged"
    assert ADMIN_TOKEN not in logs and WRONG_TOKEN not in logs and DB_PASSWORD not in logs


def _token_comparisons(path: Path) -> list[str]:
    """Source lines that compare something token-like with == or !=."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
            text = ast.unparse(node).lower()
            if "token" in text or "secret" in text or "authorization" in text:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_token_checks_are_constant_time() -> None:
    sources = sorted((REPO / "services").rglob("*.py"))
    users = [p for p in sources if "admin_token" in p.read_text() and "authorization" in p.read_text().lower()]
    assert users, "no service checks the admin token against an Authorization header"
    for path in users:
        assert "hmac.compare_digest" in path.read_text(), f"{path} reads the admin token without hmac.compare_digest"
    plain = [line for p in sources for line in _token_comparisons(p)]
    assert not plain, "token compared with ==/!= (not constant-time):\n" + "\n".join(plain)


async def test_nats_tokens_and_passwords_in_urls_are_masked_in_every_log_line(tmp_path: Path) -> None:
    """A NATS token is the URL's whole user info (nats://TOKEN@host): no colon, but a secret all the same."""
    import io
    import logging

    from devstack.embedded import EmbeddedNats
    from shared.events.bus import BusNames, EventBus
    from shared.logging import JsonFormatter, TextFormatter
    from tests.waiting import eventually

    token = "tok" + uuid.uuid4().hex
    (tmp_path / "nats.conf").write_text(f"authorization {{ token: {token} }}\n")
    server = EmbeddedNats(tmp_path / "data", config=tmp_path / "nats.conf")
    url = server.start().replace("nats://", f"nats://{token}@")
    lines = io.StringIO()
    handlers = []
    for formatter in (JsonFormatter(), TextFormatter()):
        handler = logging.StreamHandler(lines)
        handler.setFormatter(formatter)
        handlers.append(handler)
        logging.getLogger().addHandler(handler)
    try:
        bus = await EventBus.connect(url, BusNames(stream="GPUSHARE_TOK", prefix="gstok"), name="test-token")
        logging.getLogger("test").warning("connecting to %s and nats://user:%s@host:4222", url, DB_PASSWORD)
        server.stop()  # the bus logs the lost connection with its URL

        async def disconnection_logged() -> bool:
            # a write makes the client notice a dead connection even when the server's close went unseen
            with contextlib.suppress(Exception):
                await bus.nc.flush(timeout=0.5)
            return "lost the NATS connection" in lines.getvalue()

        await eventually(disconnection_logged, what="the disconnection logged")
        await bus.close()
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
        server.stop()
    text = lines.getvalue()
    assert token not in text and DB_PASSWORD not in text, text
    assert "nats://***@127.0.0.1" in text and "nats://user:***@host" in text
