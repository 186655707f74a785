"""Every wait of a service on the ledger ends at its deadline (`shared/ledger/deadlines.py`), against a real
PostgreSQL: a connection from a full pool, a lock another session holds, a statement on a server session that
answers nothing (stopped with SIGSTOP, as a hung machine would be), and a COMMIT that does not come back. The
caller then hears a short reason, the connection of unknown state is dropped, and a COMMIT whose outcome was
unknown is settled by the retry: one live allocation, one `reserved` event.

The commit a synchronous standby holds is reproduced with real replicated servers in `test_commit_hold.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import asyncpg
import httpx
import psutil
import pytest
from fastapi import FastAPI
from sqlalchemy import event, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent
from shared.http import install_common
from shared.ledger.commit_watch import watch_of
from shared.ledger.db import LedgerUnavailable, is_transient, make_engine, retry_transient
from shared.ledger.deadlines import CommitsRefused, CommitUnconfirmed, Deadlines
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, outbox
from shared.ledger.reservations import Reservation, ReservationRequest
from tests.waiting import eventually

SHORT = Deadlines(connect_s=0.5, checkout_s=0.5, lock_s=0.5, statement_s=1.0, commit_s=1.0)
FOR_EVER_S = 10.0  # a wait this long has no deadline (every deadline here is about a second)
NODE = "node-deadlines"


@pytest.fixture
async def short(engine: AsyncEngine, database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine with deadlines of about a second on the emptied ledger, one GPU in it."""
    eng = make_engine(database_url, pool_size=2, max_overflow=0, deadlines=SHORT)
    await Ledger(eng, prefix="dl").record(
        InventoryEvent(
            node=NODE,
            gpus=[
                GpuInfo(uuid=f"GPU-dl{i}", index=i, memory_mib=16 * 1024, memory_total_mib=16 * 1024) for i in (0, 1)
            ],
        )
    )
    yield eng
    watch = watch_of(eng)
    assert watch is not None
    await watch.close()
    await eng.dispose()


def _request(pod_uid: str, gpu: int = 0) -> ReservationRequest:
    part = AllocationPart(container="main", container_index=0, gpu_uuid=f"GPU-dl{gpu}", gpu_index=gpu, memory_mib=1024)
    return ReservationRequest(pod_uid=pod_uid, namespace="dl", pod_name=pod_uid, node=NODE, parts=(part,))


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The server process `pid` stopped (SIGSTOP) for the block, continued afterwards whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _our_backend(pid: int) -> None:
    """Skip unless `pid` is a PostgreSQL process of this machine that this test may stop (a server the suite was
    pointed at elsewhere cannot be)."""
    try:
        name = psutil.Process(pid).name()
        os.kill(pid, 0)
    except (psutil.Error, PermissionError):
        pytest.skip("the test's PostgreSQL runs elsewhere: its sessions cannot be stopped from here")
    if "postgres" not in name:
        pytest.skip(f"pid {pid} is not a local PostgreSQL process ({name})")


async def _select_one(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT 1"))).scalar_one())


async def test_a_connection_from_a_full_pool_is_waited_for_until_the_checkout_deadline(short: AsyncEngine) -> None:
    async with short.connect() as first, short.connect() as second:  # the whole pool, held
        await first.execute(text("SELECT 1"))
        await second.execute(text("SELECT 1"))
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable) as err:
            await asyncio.wait_for(retry_transient(lambda: _select_one(short), budget_s=0.1, what="t"), FOR_EVER_S)
        assert time.monotonic() - started < SHORT.checkout_s + 3
        assert "unavailable" in str(err.value)


async def test_a_lock_held_by_another_session_is_waited_for_until_the_lock_deadline(
    short: AsyncEngine, database_url: str
) -> None:
    """A session (another process, stalled) holds the GPU's row: a reservation on that GPU gives up after the lock
    deadline with a short reason, and a retry once the lock is gone succeeds."""
    holder = await asyncpg.connect(database_url)
    try:
        await holder.execute("BEGIN")
        await holder.execute("SELECT * FROM gpus WHERE uuid = 'GPU-dl0' FOR UPDATE")
        ledger = Ledger(short, prefix="dl")
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable) as err:
            await asyncio.wait_for(
                retry_transient(lambda: ledger.reserve(_request("pod-locked")), budget_s=0.2, what="reserve"),
                FOR_EVER_S,
            )
        assert time.monotonic() - started < SHORT.lock_s * 2 + 3
        assert "waited longer than its deadline for a lock" in str(err.value)
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    got = await ledger.reserve(_request("pod-locked"))
    assert got.created


async def test_a_statement_the_server_never_answers_is_given_up_at_the_client_deadline(short: AsyncEngine) -> None:
    """The server session stops answering (SIGSTOP: its own statement_timeout cannot fire either): the client gives
    up after its statement deadline, the failure reads as transient, and that connection is not used again."""
    async with short.connect() as conn:
        pid = int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())
        _our_backend(pid)
        started = time.monotonic()
        with stopped(pid), pytest.raises(Exception) as err:
            await asyncio.wait_for(conn.execute(text("SELECT 2")), FOR_EVER_S)
        assert time.monotonic() - started < SHORT.client_statement_s + 3
        assert is_transient(err.value), repr(err.value)
    assert await _select_one(short) == 1, "a fresh connection answers"
    async with short.connect() as conn:
        assert int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()) != pid


async def test_a_commit_that_does_not_come_back_is_settled_by_the_retry(short: AsyncEngine) -> None:
    """The server session of a reservation stops as its COMMIT is sent: the extender's group commit answers after the
    COMMIT deadline that the outcome is unknown, naming what the server says of the session, and is free for the
    next batch; reads go on. The session, continued, commits (the client closed its connection without cancelling
    anything), and the retry of the same pod gets that reservation back: one live allocation, one `reserved`
    event."""
    watch = watch_of(short)
    assert watch is not None
    ledger = Ledger(short, prefix="dl")
    group: GroupCommit[ReservationRequest, Reservation] = GroupCommit(ledger.reserve_many, what="reserve")
    stopped_pids: list[int] = []

    def stop_before_commit(conn) -> None:  # type: ignore[no-untyped-def]
        if not stopped_pids:  # SQLAlchemy's "commit" event runs just before the COMMIT is sent
            pid = conn.connection.driver_connection.get_server_pid()
            stopped_pids.append(pid)
            os.kill(pid, signal.SIGSTOP)

    request = _request("pod-unknown")
    event.listen(short.sync_engine, "commit", stop_before_commit)
    try:
        started = time.monotonic()
        with pytest.raises(CommitUnconfirmed) as unknown:
            await asyncio.wait_for(group.submit(request), FOR_EVER_S)
        took = time.monotonic() - started
        _our_backend(stopped_pids[0])
        assert took < SHORT.commit_s * 2 + 3, took
        # the session never read the COMMIT: idle in its transaction (waiting on ClientRead, or not yet)
        assert str(unknown.value).startswith(
            "the ledger's commit did not finish within 1s (the server lists its session as idle in transaction"
        ), str(unknown.value)
        assert is_transient(unknown.value)
        assert watch.unconfirmed == 1
        # only that session is stuck (holding its GPU's row): the watch's probe commits, a batch for the other GPU
        # goes
        await eventually(lambda: watch.can_commit, what="the probe commits", within=FOR_EVER_S)
        other = await asyncio.wait_for(group.submit(_request("pod-next", gpu=1)), FOR_EVER_S)
        assert other.created
        assert await _select_one(short) == 1
    finally:
        event.remove(short.sync_engine, "commit", stop_before_commit)
        for pid in stopped_pids:
            os.kill(pid, signal.SIGCONT)

    async def settled() -> Reservation:
        return await retry_transient(lambda: group.submit(_request("pod-unknown")), budget_s=5, what="reserve")

    again = await eventually(settled, what="the retry is answered", within=FOR_EVER_S)
    assert again.allocation_id == request.allocation_id and not again.created, "the first COMMIT went through"
    async with short.connect() as conn:
        live = await conn.execute(
            select(func.count()).where(allocations.c.pod_uid == "pod-unknown", allocations.c.ended_at.is_(None))
        )
        assert live.scalar_one() == 1
        staged = await conn.execute(
            select(func.count()).select_from(outbox).where(outbox.c.subject.like("%.reserved.%"))
        )
        assert staged.scalar_one() == 2, "one reserved event per reservation (pod-unknown, pod-next)"


def test_the_one_knob_sets_every_deadline() -> None:
    d = Deadlines.from_seconds(2)
    assert (d.connect_s, d.checkout_s, d.lock_s, d.commit_s, d.statement_s) == (2, 2, 2, 2, 12)
    assert d.server_settings() == {"lock_timeout": "2000", "statement_timeout": "12000"}
    assert d.client_statement_s == 17
    with pytest.raises(ValueError, match="commit deadline must be positive"):
        Deadlines(commit_s=0)


async def test_a_request_whose_write_the_ledger_cannot_commit_is_answered_503_saying_why() -> None:
    app = FastAPI()
    install_common(app)
    why = "the ledger's commit is waiting for a synchronous standby: none of synchronous_standby_names = 'x' confirmed"

    @app.put("/quota")
    async def put_quota() -> None:
        raise CommitsRefused(why)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        answer = await http.put("/quota")
    assert (answer.status_code, answer.json()) == (503, {"error": why})
