"""PostgreSQL failover, against a real primary and its synchronous standby (`devstack.ha.PostgresPair`).

Services are given a multi-host URL (`postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write`) and find
the writable server by themselves, before and after a failover. A write whose COMMIT outcome is unknown when
the primary dies is retried without being doubled, whichever way the commit went: reservations are keyed by pod
UID (the extender's retry, and kube-scheduler's retry of the bind, get the pod's reservation back), events by id
(a relay that publishes again after its delete was lost in the failover publishes ids the stream drops).
A failover endpoint that still leads to the old server (a managed service's DNS name, for a while) costs retries,
never a wrong answer or a connection stuck on a read-only server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import asyncpg
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import with_database
from devstack.ha import MovingEndpoint, PostgresPair
from shared.events.bus import BusNames, EventBus
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent, QuotaEvent
from shared.ledger import migrate
from shared.ledger.db import (
    LedgerUnavailable,
    async_url,
    database_hosts,
    is_transient,
    make_engine,
    on_read_only_server,
    retry_transient,
)
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, applied_events, outbox, quotas
from shared.ledger.outbox import OutboxRelay
from shared.ledger.reservations import Reservation, ReservationRequest
from shared.settings import with_password

NODE = "node-ha"
T = TypeVar("T")
DB = "gpushare_failover"


@pytest.fixture(scope="module")
async def pair() -> AsyncIterator[PostgresPair]:
    """A primary with a synchronous standby, and a migrated database on it (reached through the multi-host URL:
    the migrations themselves take it)."""
    servers = PostgresPair(Path(tempfile.mkdtemp(prefix="gpushare-pair-")))
    await asyncio.to_thread(servers.start)
    try:
        admin = await asyncpg.connect(servers.url())
        await admin.execute(f'CREATE DATABASE "{DB}"')
        await admin.close()
        await asyncio.to_thread(migrate.upgrade, servers.url(DB))
        yield servers
    finally:
        await asyncio.to_thread(servers.stop)


@pytest.fixture
async def healthy(pair: PostgresPair) -> AsyncIterator[PostgresPair]:
    """The pair with a synchronous standby again after the test (a failover test leaves the old primary lost)."""
    yield pair
    await pair.rejoin()


@pytest.fixture
async def ha_engine(healthy: PostgresPair) -> AsyncIterator[AsyncEngine]:
    """An engine on the multi-host URL, the ledger emptied first."""
    engine = make_engine(healthy.url(DB), pool_size=4)
    async with engine.begin() as conn:
        await conn.execute(
            text("TRUNCATE allocation_parts, allocations, gpus, nodes, outbox, applied_events, quotas CASCADE")
        )
    yield engine
    await engine.dispose()


async def _ledger(engine: AsyncEngine, prefix: str = "ha") -> Ledger:
    ledger = Ledger(engine, prefix=prefix)
    await ledger.record(
        InventoryEvent(
            node=NODE, gpus=[GpuInfo(uuid="GPU-ha0", index=0, memory_mib=16 * 1024, memory_total_mib=16 * 1024)]
        )
    )
    async with engine.begin() as conn:
        await conn.execute(outbox.delete())
    return ledger


def _request(pod_uid: str, gib: int = 2) -> ReservationRequest:
    part = AllocationPart(container="main", container_index=0, gpu_uuid="GPU-ha0", gpu_index=0, memory_mib=gib * 1024)
    return ReservationRequest(pod_uid=pod_uid, namespace="a", pod_name=pod_uid, node=NODE, parts=(part,))


async def _admin(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(url)


async def _wait_sync_rep(primary_url: str, timeout_s: float = 30.0) -> None:
    """Until a client backend on the primary waits for the synchronous standby (its COMMIT is flushed locally)."""
    conn = await _admin(primary_url)
    try:
        for _ in range(int(timeout_s * 10)):
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND datname = $1", DB
            )
            if waiting:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("no COMMIT waited for the standby")
    finally:
        await conn.close()


async def _cut_replication(pair: PostgresPair) -> None:
    """The standby stops streaming (its walreceiver ends and is not restarted): commits on the primary wait."""
    assert pair.standby is not None
    conn = await _admin(pair.standby.url())
    try:
        await conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
        await conn.execute("SELECT pg_reload_conf()")
        for _ in range(300):
            if await conn.fetchval("SELECT count(*) FROM pg_stat_wal_receiver") == 0:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("the standby's walreceiver did not stop")
    finally:
        await conn.close()


async def _live(engine: AsyncEngine, pod_uid: str) -> list[uuid.UUID]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(allocations.c.id).where(allocations.c.pod_uid == pod_uid, allocations.c.ended_at.is_(None))
        )
        return [r.id for r in rows]


async def _staged(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(outbox))).scalar_one())


# ------------------------------------------------------------------------------------------------------ URLs


def test_a_multi_host_url_becomes_sqlalchemys_form_of_it() -> None:
    url = "postgresql://svc@db-0:5432,db-1,[::1]:6432/gpushare?target_session_attrs=read-write&sslmode=require"
    assert async_url(url) == (
        "postgresql+asyncpg://svc@/gpushare?host=db-0%3A5432&host=db-1%3A5432&host=%5B%3A%3A1%5D%3A6432"
        "&target_session_attrs=read-write&ssl=require"
    )
    assert database_hosts(url) == ["db-0:5432", "db-1:5432", "[::1]:6432"]
    # the password from GPUSHARE_DATABASE_PASSWORD goes to the user, whatever the hosts
    assert with_password(url, "p/w").startswith("postgresql://svc:p%2Fw@db-0:5432,db-1,[::1]:6432/gpushare?")
    with pytest.raises(ValueError, match="empty host"):
        async_url("postgresql://svc@db-0,,db-1/gpushare")


async def test_the_multi_host_url_finds_the_primary_whichever_host_comes_first(healthy: PostgresPair) -> None:
    """asyncpg tries the hosts in order and keeps the first `target_session_attrs=read-write` accepts; the
    standby listed first is passed over."""
    assert healthy.standby is not None
    for order in ((healthy.standby, healthy.primary), (healthy.primary, healthy.standby)):
        url = f"postgresql://postgres@{order[0].host},{order[1].host}/{DB}?target_session_attrs=read-write"
        engine = make_engine(url, pool_size=1)
        try:
            async with engine.connect() as conn:
                port = (await conn.execute(text("SELECT inet_server_port()"))).scalar_one()
                in_recovery = (await conn.execute(text("SELECT pg_is_in_recovery()"))).scalar_one()
        finally:
            await engine.dispose()
        assert (port, in_recovery) == (healthy.primary.port, False)


# ------------------------------------------------------------------------------ a COMMIT of unknown outcome

# The writer's retry budget here: the test's own steps (waiting for the walsender, the kill, the standby's replay,
# the promotion) all run inside it, and on the loaded CI machine they once took longer than the extender's 5 s
# (`LEDGER_BUDGET_S`), so the writer gave up before the promotion. Past its budget the product answers
# LedgerUnavailable and kube-scheduler retries (tests/foundation/test_commit_hold.py); what these tests check is
# what the retry finds once the standby is promoted.
FAILOVER_BUDGET_S = 60.0


async def _commit_reaches_the_standby_then_the_primary_dies(pair: PostgresPair, write: Callable[[], Awaitable[T]]) -> T:
    """Run `write()` (which retries transient failures) so that its COMMIT reaches the standby but its
    acknowledgement never reaches the writer: the standby's WAL receiver is stopped, so the COMMIT waits for
    its confirmation; the primary is killed meanwhile; the receiver resumes with the commit record already in
    its socket and replays it; the standby is promoted. Returns what `write()` returned in the end."""
    assert pair.standby is not None
    standby = await _admin(pair.standby.url())
    receiver = await standby.fetchval("SELECT pid FROM pg_stat_wal_receiver")
    os.kill(receiver, signal.SIGSTOP)  # the standby receives (into its socket) but confirms nothing
    try:
        attempt = asyncio.create_task(write())
        await _wait_sync_rep(pair.primary.url())
        primary = await _admin(pair.primary.url())
        commit_lsn = await primary.fetchval("SELECT pg_current_wal_flush_lsn()::text")
        for _ in range(300):  # the walsender (its own process) sends the commit record a moment after the flush
            sent = "SELECT coalesce(bool_or(sent_lsn >= $1::text::pg_lsn), false) FROM pg_stat_replication"
            if await primary.fetchval(sent, commit_lsn):
                break
            await asyncio.sleep(0.02)
        await primary.close()
        pair.kill9_primary()
    finally:
        os.kill(receiver, signal.SIGCONT)
    for _ in range(300):  # the commit record was in the walreceiver's socket: it lands on the standby
        if await standby.fetchval("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", commit_lsn):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the standby never received the COMMIT: this test needs it to have")
    await standby.close()
    await pair.promote_standby()
    return await attempt  # retried through the outage, answered by the new primary


async def test_a_reservation_committed_before_the_primary_died_is_not_doubled(
    healthy: PostgresPair, ha_engine: AsyncEngine
) -> None:
    """The COMMIT reached the standby, its acknowledgement never reached the extender: the primary died while
    the reservation waited for the standby's confirmation. The extender's retry, on the promoted standby, gets
    the pod's reservation back (created=False): one live allocation, one `reserved` event."""
    ledger = await _ledger(ha_engine)
    group: GroupCommit[ReservationRequest, Reservation] = GroupCommit(ledger.reserve_many, what="reserve")
    request = _request("pod-committed")
    got = await _commit_reaches_the_standby_then_the_primary_dies(
        healthy, lambda: retry_transient(lambda: group.submit(request), budget_s=FAILOVER_BUDGET_S, what="reserve")
    )
    assert isinstance(got, Reservation)
    assert not got.created, "the first attempt's commit survived the failover: the retry found it"
    assert got.allocation_id == request.allocation_id
    # kube-scheduler, told nothing, retries the bind: a new request for the same pod gets the same reservation
    again = await retry_transient(lambda: group.submit(_request("pod-committed")), budget_s=10, what="reserve")
    assert isinstance(again, Reservation) and again.allocation_id == request.allocation_id and not again.created
    assert await _live(ha_engine, "pod-committed") == [request.allocation_id]
    assert await _staged(ha_engine) == 1, "one reserved event, staged by the transaction that committed"


async def test_an_event_applied_before_the_primary_died_is_not_applied_again(
    healthy: PostgresPair, ha_engine: AsyncEngine
) -> None:
    """A consumer's transaction (its claim on the event id and the effect) committed on the standby, the
    acknowledgement lost with the primary: the consumer's in-place retry finds the claim on the promoted
    standby and applies nothing (events are keyed by id)."""
    ledger = await _ledger(ha_engine)
    event = QuotaEvent(namespace="q-unknown", memory_mib=4096)
    again = await _commit_reaches_the_standby_then_the_primary_dies(
        healthy,
        lambda: retry_transient(lambda: ledger.record_once(event, "test"), budget_s=FAILOVER_BUDGET_S, what="x"),
    )
    assert again is None, "the retry found the event applied"
    async with ha_engine.connect() as conn:
        claims = await conn.execute(select(func.count()).select_from(applied_events))
        assert claims.scalar_one() == 1
        assert (await conn.execute(select(quotas.c.memory_mib).where(quotas.c.namespace == "q-unknown"))).all() == [
            (4096,)
        ]
    assert await _staged(ha_engine) == 1, "the event staged once"


async def test_a_reservation_lost_with_the_primary_is_made_once_on_the_new_one(
    healthy: PostgresPair, ha_engine: AsyncEngine
) -> None:
    """The COMMIT never reached the standby (it was not streaming): the transaction dies with the primary. The
    extender cannot tell this from the case above; its retry makes the reservation on the promoted standby,
    once."""
    pair = healthy
    ledger = await _ledger(ha_engine)
    group: GroupCommit[ReservationRequest, Reservation] = GroupCommit(ledger.reserve_many, what="reserve")
    request = _request("pod-lost")
    await _cut_replication(pair)
    first = asyncio.create_task(group.submit(request))
    await _wait_sync_rep(pair.primary.url())
    pair.kill9_primary()
    with pytest.raises(Exception) as unknown:
        await first
    assert is_transient(unknown.value), unknown.value
    await pair.promote_standby()

    got = await retry_transient(lambda: group.submit(request), budget_s=30, what="reserve")
    assert isinstance(got, Reservation) and got.created and got.allocation_id == request.allocation_id
    again = await retry_transient(lambda: group.submit(_request("pod-lost")), budget_s=10, what="reserve")
    assert isinstance(again, Reservation) and not again.created and again.allocation_id == request.allocation_id
    assert await _live(ha_engine, "pod-lost") == [request.allocation_id]
    assert await _staged(ha_engine) == 1


async def test_a_relay_whose_delete_was_lost_publishes_ids_the_stream_drops(
    healthy: PostgresPair, ha_engine: AsyncEngine, nats_url: str, bus_names: BusNames
) -> None:
    """The relay published a batch and its DELETE's COMMIT died with the primary (not replicated): the rows are
    back in the outbox on the promoted standby and are published again, with the same event ids, which
    JetStream's dedup window drops. The stream holds each event once."""
    pair = healthy
    ledger = await _ledger(ha_engine, bus_names.prefix)
    for i in range(5):
        await ledger.reserve(_request(f"pod-relay-{i}", gib=1))
    assert await _staged(ha_engine) == 5
    bus = await EventBus.connect(nats_url, bus_names, name="gpushare-test")
    try:
        relay = OutboxRelay(ha_engine, bus)
        await _cut_replication(pair)
        flush = asyncio.create_task(relay.flush())
        await _wait_sync_rep(pair.primary.url())  # published, deleted, waiting to commit the delete
        pair.kill9_primary()
        with pytest.raises(Exception) as unknown:
            await flush
        assert is_transient(unknown.value), unknown.value
        await pair.promote_standby()
        assert await retry_transient(relay.flush, budget_s=30, what="relay") == 5, "the rows came back"
        assert await _staged(ha_engine) == 0
        info = await bus.js.stream_info(bus_names.stream)
        assert info.state.messages == 5, "the republished events were dropped as repeats"
    finally:
        await bus.delete_streams()
        await bus.close()


# --------------------------------------------------------------------------- a failover endpoint that lags


@pytest.fixture
async def endpoint(healthy: PostgresPair) -> AsyncIterator[MovingEndpoint]:
    """A failover endpoint that leads to the standby, as a managed service's DNS name may for a while."""
    assert healthy.standby is not None
    moving = await MovingEndpoint(("127.0.0.1", healthy.standby.port)).start()
    yield moving
    await moving.stop()


async def _write(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO nodes (name) VALUES (:n) ON CONFLICT DO NOTHING"), {"n": "n-endpoint"})


async def test_a_connection_that_reached_a_read_only_server_is_dropped(
    healthy: PostgresPair, endpoint: MovingEndpoint
) -> None:
    """Without `target_session_attrs`, a pool fills with connections to wherever the endpoint led. A write
    refused as read-only is transient and empties the pool, so once the endpoint leads to the primary the
    next write succeeds; before, the pooled connection to the standby kept failing every write."""
    engine = make_engine(with_database(f"postgresql://postgres@{endpoint.host}/x", DB), pool_size=1, max_overflow=0)
    try:
        with pytest.raises(Exception) as refused:
            await _write(engine)
        assert on_read_only_server(refused.value) and is_transient(refused.value), refused.value
        endpoint.move(("127.0.0.1", healthy.primary.port))
        await _write(engine)
    finally:
        await engine.dispose()


async def test_no_writable_host_yet_is_retried_until_the_endpoint_leads_to_the_primary(
    healthy: PostgresPair, endpoint: MovingEndpoint
) -> None:
    """With `target_session_attrs=read-write`, connecting through an endpoint that leads to a standby fails
    with "none of the hosts match": transient (the failover is under way), retried, and answered once the
    endpoint moved. Before, it was raised at once (a bind refused, a consumer's event parked after 5 tries)."""
    url = f"postgresql://postgres@{endpoint.host}/{DB}?target_session_attrs=read-write"
    engine = make_engine(url, pool_size=1)
    try:
        with pytest.raises(LedgerUnavailable):
            await retry_transient(lambda: _write(engine), budget_s=0.5, what="test")
        moved = asyncio.get_running_loop().call_later(0.5, endpoint.move, ("127.0.0.1", healthy.primary.port))
        await retry_transient(lambda: _write(engine), budget_s=15, what="test")
        moved.cancel()
    finally:
        await engine.dispose()
