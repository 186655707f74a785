"""Least privilege in PostgreSQL: each service's role holds exactly what its code needs, does its job with it,
and is refused the rest.

The needs are read from the sources (`tests/security/sql_usage.py`); the grants from PostgreSQL's catalogs after
the migrations. A statement that needs a privilege no migration grants, or a grant no code uses, fails here.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import with_user
from services.accounting.projections import Projector
from services.binder.reads import node_snapshot
from services.extender.view import ClusterView
from shared.events.bus import EventBus
from shared.events.catalogue import (
    AllocationPart,
    GpuInfo,
    HealthEvent,
    InventoryEvent,
    QuotaEvent,
    RefusedEvent,
    UsageEvent,
    UsageSample,
)
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.ledger.reservations import ReservationRequest
from tests.security.sql_usage import raw_sql_needs, service_needs

SERVICES = {"gpushare_extender": "extender", "gpushare_binder": "binder", "gpushare_accounting": "accounting"}
# UPDATE grants this release's code no longer uses and the previous release's services still do: they run on the new
# schema while an upgrade rolls out (docs/operations.md, "Migrations are additive across one release"), so the grant
# is revoked by a contracting migration of the release after this one. Each entry must still be granted and unused
# here, so none outlives its reason.
RETIRING_UPDATES: dict[str, dict[str, set[str]]] = {
    # 0.2.0's claim record set them with an UPDATE after the INSERT; now the INSERT writes them
    "gpushare_binder": {"allocations": {"claim_uid", "claim_name"}},
}
TABLE_PRIVILEGES = {"SELECT", "INSERT", "DELETE", "TRUNCATE"}


def as_role(url: str, role: str) -> str:
    """The same database as another user (the embedded server trusts local connections)."""
    return with_user(url, role)


async def granted(conn: asyncpg.Connection, role: str) -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    """(table privileges, UPDATE columns per table) of `role` in the public schema, from the catalogs."""
    rows = await conn.fetch(
        "SELECT c.relname, a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
        "WHERE c.relnamespace = 'public'::regnamespace AND a.grantee = $1::regrole",
        role,
    )
    tables = {(r["relname"], r["privilege_type"]) for r in rows}
    cols = await conn.fetch(
        "SELECT c.relname, att.attname, a.privilege_type FROM pg_attribute att JOIN pg_class c ON c.oid = att.attrelid,"
        " aclexplode(att.attacl) a WHERE c.relnamespace = 'public'::regnamespace AND a.grantee = $1::regrole",
        role,
    )
    assert all(r["privilege_type"] == "UPDATE" for r in cols), [tuple(r) for r in cols]
    updates: dict[str, set[str]] = {}
    for r in cols:
        updates.setdefault(r["relname"], set()).add(r["attname"])
    return tables, updates


@pytest.mark.parametrize("role", sorted(SERVICES))
async def test_each_role_holds_exactly_what_its_code_needs(database_url: str, role: str) -> None:
    needs = service_needs(SERVICES[role])
    want_tables = {(t, p) for t, p in needs if p in TABLE_PRIVILEGES}
    want_updates: dict[str, set[str]] = {}
    for t, p in needs:
        if p.startswith("UPDATE:"):
            want_updates.setdefault(t, set()).add(p.removeprefix("UPDATE:"))
    conn = await asyncpg.connect(database_url)
    try:
        have_tables, have_updates = await granted(conn, role)
    finally:
        await conn.close()
    for table, columns in RETIRING_UPDATES.get(role, {}).items():
        assert columns <= have_updates.get(table, set()), f"{role}: {table} {columns} revoked: drop the entry"
        assert not columns & want_updates.get(table, set()), f"{role}: {table} {columns} used again: drop the entry"
        have_updates[table] -= columns
        if not have_updates[table]:
            del have_updates[table]
    assert have_tables == want_tables, (
        f"{role}: granted but unused {sorted(have_tables - want_tables)}; used but not granted "
        f"{sorted(want_tables - have_tables)}"
    )
    assert have_updates == want_updates, f"{role}: UPDATE columns granted {have_updates}, used {want_updates}"
    locked = {t for t, p in needs if p == "LOCK"}
    assert all(have_updates.get(t) for t in locked), f"{role} locks rows of {locked} without UPDATE on them"


@pytest.mark.parametrize(
    ("sql", "needs"),
    [
        ("INSERT INTO t (a) VALUES ($1)", {("t", "INSERT")}),
        (
            "INSERT INTO t (a) SELECT * FROM unnest($1::int[]) ON CONFLICT (a) DO NOTHING",
            {("t", "INSERT"), ("t", "SELECT")},
        ),
        (
            "UPDATE t AS x SET a = COALESCE(x.a, $1), b = CASE WHEN x.c = 1 THEN 2 ELSE x.b END FROM u WHERE x.i = u.i",
            {("t", "UPDATE:a"), ("t", "UPDATE:b"), ("t", "SELECT"), ("u", "SELECT")},
        ),
        ("DELETE FROM t", {("t", "DELETE")}),
        ("DELETE FROM t WHERE seq IN (SELECT seq FROM t LIMIT 1) RETURNING seq", {("t", "DELETE"), ("t", "SELECT")}),
        (
            "SELECT a FROM t JOIN u ON t.a = u.a WHERE t.a = ANY($1) FOR UPDATE",
            {(x, p) for x in "tu" for p in ("SELECT", "LOCK")},
        ),
        ("SELECT pg_advisory_xact_lock($1)", set()),
    ],
)
def test_raw_driver_sql_reads_as_postgresql_checks_it(sql: str, needs: set[tuple[str, str]]) -> None:
    assert raw_sql_needs(sql, {"t", "u"}) == needs


def test_the_node_agent_reaches_no_sql_and_has_no_role() -> None:
    assert service_needs("node_agent") == set()


async def test_there_is_no_node_agent_role_and_no_public_table_access(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        roles = {r["rolname"] for r in await conn.fetch("SELECT rolname FROM pg_roles WHERE rolname LIKE 'gpushare%'")}
        public = await conn.fetch(
            "SELECT c.relname FROM pg_class c, aclexplode(c.relacl) a "
            "WHERE c.relnamespace = 'public'::regnamespace AND a.grantee = 0"
        )
    finally:
        await conn.close()
    assert set(SERVICES) <= roles and not any("node" in r for r in roles), roles
    assert public == []


REFUSED = {
    "gpushare_extender": [
        "UPDATE gpus SET memory_mib = memory_mib + 1",  # raise a GPU's capacity
        "UPDATE quotas SET memory_mib = NULL",  # lift a quota
        "INSERT INTO quotas (namespace) VALUES ('mine')",
        "DELETE FROM allocations",
        "UPDATE allocations SET state = 'released'",
        "TRUNCATE outbox",
        "SELECT * FROM acc_timeline",
    ],
    "gpushare_binder": [
        "UPDATE quotas SET memory_mib = NULL",
        "DELETE FROM quotas",
        "DELETE FROM allocations",
        "UPDATE allocations SET memory_mib = 0",  # shrink what an allocation holds
        "UPDATE allocations SET namespace = 'other'",  # move usage to another namespace's quota
        "TRUNCATE gpus",
        "SELECT * FROM usage_samples",
    ],
    "gpushare_accounting": [
        "UPDATE gpus SET allocated_memory_mib = 0",
        "INSERT INTO allocations (id, pod_uid, namespace, pod_name, node, state, memory_mib, reserved_at) "
        "VALUES (gen_random_uuid(), 'u', 'n', 'p', 'x', 'reserved', 1, now())",
        "DELETE FROM allocations",
        "UPDATE allocations SET state = 'released'",
        "DELETE FROM acc_timeline",  # history: pruning touches samples, refusals and old claims only
        "TRUNCATE acc_timeline",
    ],
}


@pytest.mark.parametrize("role", sorted(REFUSED))
async def test_each_role_is_refused_what_it_must_not_do(database_url: str, role: str) -> None:
    conn = await asyncpg.connect(as_role(database_url, role))
    try:
        for sql in REFUSED[role]:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                async with conn.transaction():
                    await conn.execute(sql)
    finally:
        await conn.close()


async def test_a_node_agent_cannot_log_in(database_url: str) -> None:
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
        await asyncpg.connect(as_role(database_url, "gpushare_node_agent"))


# ---------------------------------------------------------------------------------------------------------------
# Each role does its service's job with the service's own code.


@pytest.fixture
async def roles(engine: AsyncEngine, database_url: str) -> AsyncIterator[dict[str, AsyncEngine]]:
    """An engine per service role (the `engine` fixture emptied the tables as the owner)."""
    engines = {svc: make_engine(as_role(database_url, role), pool_size=2) for role, svc in SERVICES.items()}
    yield engines
    for e in engines.values():
        await e.dispose()


def gpu(node: str, i: int = 0) -> GpuInfo:
    return GpuInfo(uuid=f"GPU-{node}-{i}", index=i, model="T4", memory_mib=16384, memory_total_mib=16384)


async def test_each_role_does_its_job(roles: dict[str, AsyncEngine], bus: EventBus) -> None:
    prefix = bus.names.prefix
    node = f"n-{uuid.uuid4().hex[:6]}"
    binder = Ledger(roles["binder"], prefix=prefix, source="binder")
    extender = Ledger(roles["extender"], prefix=prefix, source="extender")
    accounting = Ledger(roles["accounting"], prefix=prefix, source="accounting")
    # binder: the gateway's commands for a node agent, and the life cycle
    await binder.record(InventoryEvent(node=node, gpus=[gpu(node)]))
    await binder.record(HealthEvent(node=node, gpu_uuid=f"GPU-{node}-0", healthy=True))
    # accounting: a quota (which the extender then reserves against)
    await accounting.record(QuotaEvent(namespace="team", memory_mib=8192))
    # extender: a reservation under the quota, and its view of everything
    part = AllocationPart(container="main", container_index=0, gpu_uuid=f"GPU-{node}-0", gpu_index=0, memory_mib=4096)
    request = ReservationRequest(pod_uid="pod-1", namespace="team", pod_name="p", node=node, parts=(part,))
    reservation = await extender.reserve(request)
    assert reservation.created
    view = ClusterView()
    await view.reload(roles["extender"])
    assert node in view.nodes and view.quotas["team"]
    await binder.mark_bound(reservation.allocation_id, "pod-1", node)
    await binder.mark_assigned(reservation.allocation_id, "pod-1", node, "main", [f"GPU-{node}-0"])
    snapshot = await node_snapshot(roles["binder"], node, 0, now=datetime.now(UTC))
    assert [c.pod_uid for c in snapshot.containers] == ["pod-1"]
    await binder.release(reservation.allocation_id, "pod-1", node, "done")
    await binder.retire_node(node)
    # every writer relays the shared outbox
    for svc in ("extender", "binder", "accounting"):
        await OutboxRelay(roles[svc], bus).flush()
    # accounting: the read models
    projector = Projector(roles["accounting"])
    usage = UsageEvent(node=node, samples=[UsageSample(gpu_uuid=f"GPU-{node}-0", pod_uid="pod-1", used_memory_mib=1)])
    refused = RefusedEvent(pod_uid="pod-2", namespace="team", pod_name="q", summary="full")
    for event in (usage, refused):
        assert await projector.handle(event)
