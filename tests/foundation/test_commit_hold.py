"""A COMMIT held for a synchronous standby that is not there, against real replicated servers
(`devstack.ha.PostgresPair`: a primary with `synchronous_standby_names` naming its standby, the standby stopped).

PostgreSQL holds every COMMIT that writes until a standby confirms it, and `statement_timeout` does not cover that
wait. What must hold (issue 40): the caller hears in time why (the extender's reservation, the node agents'
gateway), the group-commit worker is free for the next batch, the held write is neither lost nor made visible
behind the standby's back (no cancel request: PostgreSQL would end the wait with "the transaction has already
committed locally"), a process with no traffic notices too (`/readyz` 503 with the reason, a metric, a log line),
and once the standby is back everything recovers by itself and the retry settles the held write: one live
allocation, one `reserved` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import free_port
from devstack.ha import PostgresPair
from services.binder.gateway import LedgerGateway
from services.binder.metrics import BinderMetrics
from services.extender.bind import LEDGER_BUDGET_S
from shared.events.bus import EventBus
from shared.events.catalogue import HealthEvent
from shared.http import install_common
from shared.ledger.commit_watch import SYNCHRONOUS_STANDBY, CommitWatch, watch_of
from shared.ledger.db import LedgerUnavailable, make_engine, retry_transient
from shared.ledger.deadlines import Deadlines
from shared.ledger.group_commit import GroupCommit
from shared.ledger.reservations import Reservation, ReservationRequest
from shared.runtime import Listen, ServiceRuntime
from shared.settings import Settings
from tests.foundation.test_pg_failover import (
    DB,
    NODE,
    _ledger,
    _live,
    _request,
    _staged,
    _wait_sync_rep,
    ha_engine,
    healthy,
    pair,
)
from tests.waiting import eventually

__all__ = ["ha_engine", "healthy", "pair"]  # test_pg_failover's fixtures: the replicated servers, an engine on them

HELD = "waiting for a synchronous standby"
COMMIT_S = Deadlines().commit_s  # the default deadline: what a service runs with
FOR_EVER_S = 60.0


@pytest.fixture
async def engine_on_pair(pair: PostgresPair, ha_engine: AsyncEngine) -> AsyncIterator[AsyncEngine]:
    """test_pg_failover's engine on the pair (default deadlines, the ledger emptied); the standby running again
    afterwards, the engine's commit probe stopped."""
    try:
        yield ha_engine
    finally:
        await pair.start_standby()
        watch = watch_of(ha_engine)
        assert watch is not None
        await watch.close()


async def _sync_rep_waiters(pair: PostgresPair) -> int:
    conn = await asyncpg.connect(pair.primary.url())
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND datname = $1", DB
            )
        )
    finally:
        await conn.close()


async def test_a_held_commit_is_answered_in_time_naming_the_standby_and_settled_once_it_is_back(
    pair: PostgresPair, engine_on_pair: AsyncEngine
) -> None:
    ledger = await _ledger(engine_on_pair)
    group: GroupCommit[ReservationRequest, Reservation] = GroupCommit(ledger.reserve_many, what="reserve")
    request = _request("pod-held")
    pair.stop_standby()

    started = time.monotonic()
    with pytest.raises(LedgerUnavailable) as err:
        await asyncio.wait_for(
            retry_transient(lambda: group.submit(request), budget_s=LEDGER_BUDGET_S, what="reserve"), FOR_EVER_S
        )
    assert time.monotonic() - started < COMMIT_S + 5, "the bind is answered after the COMMIT deadline"
    assert HELD in str(err.value) and "synchronous_standby_names = 'pg1'" in str(err.value), str(err.value)

    started = time.monotonic()
    with pytest.raises(LedgerUnavailable) as next_err:
        await asyncio.wait_for(
            retry_transient(lambda: group.submit(_request("pod-next")), budget_s=LEDGER_BUDGET_S, what="reserve"),
            FOR_EVER_S,
        )
    assert time.monotonic() - started < 1.0, "the worker is free: the next pod hears at once"
    assert str(next_err.value) == str(err.value)

    assert await _live(engine_on_pair, "pod-held") == [], "the held reservation is not visible without the standby"
    assert await _sync_rep_waiters(pair) >= 1, "... nor lost: the primary holds it for the standby"

    await pair.start_standby()
    watch = watch_of(engine_on_pair)
    assert watch is not None
    await eventually(lambda: watch.can_commit, what="the watch sees commits complete again", within=FOR_EVER_S)
    got = await retry_transient(lambda: group.submit(_request("pod-held")), budget_s=10, what="reserve")
    assert got.allocation_id == request.allocation_id and not got.created, "the held COMMIT went through"
    assert await _live(engine_on_pair, "pod-held") == [request.allocation_id]
    assert await _staged(engine_on_pair) == 1, "one reserved event"
    nxt = await retry_transient(lambda: group.submit(_request("pod-next")), budget_s=10, what="reserve")
    assert nxt.created, "the pod refused meanwhile is reserved now"


async def test_a_caller_cancelled_while_its_commit_is_held_does_not_commit_it_behind_the_standbys_back(
    pair: PostgresPair, engine_on_pair: AsyncEngine
) -> None:
    """A cancelled wait (a service stopping, a caller giving up) must not cancel the server's wait: PostgreSQL
    would end it by committing locally, a reservation no standby has. The write stays held, and commits (once)
    when the standby is back."""
    ledger = await _ledger(engine_on_pair)
    request = _request("pod-cancelled")
    pair.stop_standby()
    task = asyncio.create_task(ledger.reserve(request))
    await _wait_sync_rep(pair.primary.url())
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

    async def made_visible() -> bool:
        return await _live(engine_on_pair, "pod-cancelled") != []

    with pytest.raises(TimeoutError):  # a cancel request makes it visible within milliseconds
        await eventually(made_visible, what="the held reservation visible without the standby", within=3.0)
    assert await _sync_rep_waiters(pair) >= 1

    await pair.start_standby()
    await eventually(made_visible, what="the reservation committed once the standby confirmed", within=FOR_EVER_S)
    assert await _live(engine_on_pair, "pod-cancelled") == [request.allocation_id]


async def test_the_node_agents_gateway_answers_in_time_naming_the_standby(
    pair: PostgresPair, engine_on_pair: AsyncEngine, bus: EventBus
) -> None:
    """A node agent's command while COMMITs are held gets a retryable answer that says why, well within the agent's
    request timeout (5 s), once the ledger knows it cannot commit; after the standby is back it is applied."""
    ledger = await _ledger(engine_on_pair)
    gateway = LedgerGateway(ledger, bus, metrics=BinderMetrics())
    health = HealthEvent(node=NODE, gpu_uuid="GPU-ha0", healthy=True, reason="probe")
    pair.stop_standby()
    first = await asyncio.wait_for(gateway.command(NODE, health.model_dump_json()), FOR_EVER_S)
    assert not first.ok and first.retryable and HELD in first.error, first
    started = time.monotonic()
    later = await asyncio.wait_for(gateway.command(NODE, health.model_dump_json()), FOR_EVER_S)
    assert time.monotonic() - started < 1.0
    assert not later.ok and later.retryable and HELD in later.error, later

    await pair.start_standby()
    watch = watch_of(engine_on_pair)
    assert watch is not None
    await eventually(lambda: watch.can_commit, what="commits complete again", within=FOR_EVER_S)
    applied = await gateway.command(NODE, health.model_dump_json())
    assert applied.ok, applied


def _app() -> FastAPI:
    app = FastAPI()
    install_common(app, ready=lambda: True)  # the service itself is ready: only the ledger is not
    return app


async def test_readiness_metrics_and_log_say_the_ledger_cannot_commit_and_recover_by_themselves(
    pair: PostgresPair, engine_on_pair: AsyncEngine, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A service with no traffic at all: its probe finds the held COMMIT, `/readyz` answers 503 with the reason, the
    metric says 0, one log line says why; once the standby is back all three recover without anyone's help."""
    caplog.set_level(logging.WARNING, logger="shared.ledger.commit_watch")
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        database_url=pair.url(DB), nats_url=nats_url, stream_name=f"GPUSHARE_H{tag}", subject_prefix=f"gsh{tag}"
    )
    port = free_port()
    registry = CollectorRegistry()
    runtime: list[ServiceRuntime] = []

    async def service() -> None:
        async with ServiceRuntime("accounting", settings, listen=Listen("127.0.0.1", port)) as rt:
            registry.register(rt.ledger_metrics())
            runtime.append(rt)
            await rt.serve(_app())

    task = asyncio.create_task(service())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:

            async def readyz() -> tuple[int, dict]:
                try:
                    answer = await http.get("/readyz")
                except httpx.TransportError:
                    return 0, {}
                return answer.status_code, answer.json()

            await eventually(lambda: _status(readyz, 200), what="/readyz 200 once started", within=FOR_EVER_S)
            pair.stop_standby()
            _, body = await eventually(
                lambda: _status(readyz, 503), what="/readyz 503 while COMMITs are held", within=FOR_EVER_S
            )
            assert HELD in body["reason"], body
            assert "gpushare_ledger_can_commit 0.0" in generate_latest(registry).decode()
            assert f'gpushare_ledger_cannot_commit_seconds{{reason="{SYNCHRONOUS_STANDBY}"}}' in (
                generate_latest(registry).decode()
            )
            said = [r.getMessage() for r in caplog.records if "cannot commit" in r.getMessage()]
            assert len(said) == 1 and HELD in said[0], said

            await pair.start_standby()
            await eventually(lambda: _status(readyz, 200), what="/readyz 200 again", within=FOR_EVER_S)
            assert "gpushare_ledger_can_commit 1.0" in generate_latest(registry).decode()
            assert any("commits again" in r.getMessage() for r in caplog.records)
    finally:
        if runtime:
            runtime[0].stop.set()
        await asyncio.wait_for(task, FOR_EVER_S)


async def _status(readyz, code: int):  # type: ignore[no-untyped-def]
    status, body = await readyz()
    return (status, body) if status == code else None


def test_the_watch_of_an_engine_is_its_own() -> None:
    first = make_engine("postgresql://u@127.0.0.1:1/x")
    second = make_engine("postgresql://u@127.0.0.1:1/x")
    one, two = watch_of(first), watch_of(second)
    assert isinstance(one, CommitWatch) and isinstance(two, CommitWatch) and one is not two
    assert one.connection_class.watch is one and two.connection_class.watch is two
