"""Leader election over a Lease (`shared.kube.leases`): the pure rules, then the shell against a real API server.

The rules mirror client-go's `tools/leaderelection/leaderelection.go` (`tryAcquireOrRenew`, `isLeaseValid`,
`release`) and `resourcelock/leaselock.go` (the Lease spec fields): a lease binds others for its duration after
they last saw it change (their own clock), the holder renews, an expired or released lease is taken with
`leaseTransitions + 1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from shared.kube.leases import (
    Action,
    ElectionConfig,
    ElectionTiming,
    LeaderElector,
    LeaseRecord,
    Observation,
    decide,
    lease_valid,
    observe,
    released,
    standby_wait,
    still_leading,
)
from tests.waiting import eventually

T = ElectionTiming(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)
WALL = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def held(by: str, *, transitions: int = 0, renewed: datetime = WALL) -> LeaseRecord:
    return LeaseRecord(holder=by, duration_s=15, acquired_at=WALL, renewed_at=renewed, transitions=transitions)


# ------------------------------------------------------------------------------------------------ pure rules


def test_no_lease_is_created_held_by_me() -> None:
    d = decide(None, Observation(), "a", now=100.0, wall=WALL, timing=T)
    assert d.action is Action.CREATE and d.record == LeaseRecord("a", 15, WALL, WALL, 0) and not d.took_over


def test_another_holders_lease_binds_for_its_duration_after_it_was_last_seen_changing() -> None:
    current = held("b", renewed=WALL - timedelta(hours=5))  # the holder's clock says nothing to us
    seen = observe(None, current, now=100.0)
    assert decide(current, seen, "a", now=114.9, wall=WALL, timing=T).action is Action.STAND_BY
    d = decide(current, seen, "a", now=115.0, wall=WALL, timing=T)
    assert d.action is Action.ACQUIRE and d.took_over
    assert d.record == LeaseRecord("a", 15, WALL, WALL, transitions=1)


def test_each_renewal_seen_restarts_the_standbys_clock_and_a_repeat_does_not() -> None:
    first = observe(None, held("b"), now=100.0)
    assert observe(first, held("b"), now=110.0) is first  # nothing changed: the clock keeps running
    renewed = observe(first, held("b", renewed=WALL + timedelta(seconds=2)), now=110.0)
    assert renewed.since == 110.0
    assert lease_valid(renewed, 124.0) and not lease_valid(renewed, 125.0)


def test_a_released_lease_is_taken_at_once_without_counting_a_failover() -> None:
    gone = released(held("b", transitions=3), WALL)
    assert gone == LeaseRecord("", 1, WALL, WALL, 3)
    d = decide(gone, observe(None, gone, now=100.0), "a", now=100.0, wall=WALL, timing=T)
    assert d.action is Action.ACQUIRE and not d.took_over and d.record is not None and d.record.transitions == 4


def test_the_holder_renews_keeping_when_it_acquired_and_the_transitions() -> None:
    mine = held("a", transitions=2)
    later = WALL + timedelta(seconds=30)
    d = decide(mine, observe(None, mine, now=0.0), "a", now=1.0, wall=later, timing=T)
    assert d.action is Action.RENEW and d.record == LeaseRecord("a", 15, WALL, later, 2)


def test_the_leader_leads_until_the_renew_deadline_after_its_last_renewal() -> None:
    assert not still_leading(None, 5.0, T)
    assert still_leading(100.0, 109.9, T) and not still_leading(100.0, 110.0, T)


def test_a_standby_waits_a_retry_period_with_client_go_jitter() -> None:
    assert standby_wait(T, 0.0) == 2.0 and standby_wait(T, 0.999) == pytest.approx(4.4, abs=0.01)


@pytest.mark.parametrize(
    ("timing", "problem"),
    [((10, 10, 2), "longer than the renew deadline"), ((15, 2, 2), "retry period"), ((0, 1, 1), "positive")],
)
def test_timings_client_go_refuses_are_refused_with_the_reason(timing: tuple[float, ...], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ElectionTiming(*timing)


def test_the_spec_round_trips_as_microtime() -> None:
    record = held("a", transitions=4, renewed=WALL + timedelta(microseconds=5))
    spec = record.spec()
    assert spec["renewTime"] == "2026-12-01T12:00:00.000005Z" and spec["acquireTime"] == "2026-12-01T12:00:00.000000Z"
    assert LeaseRecord.from_lease({"spec": spec}) == record


# ------------------------------------------------------------------------------------------------ the shell

# short, with room for a busy API server
FAST = ElectionTiming(lease_duration_s=6, renew_deadline_s=5, retry_period_s=0.5)


class Candidate:
    """One elector with duties that record when they run."""

    def __init__(self, api: ApiClient, name: str, identity: str) -> None:
        self.changes: list[str] = []
        self.elector = LeaderElector(
            api,
            ElectionConfig(name, namespace="default", identity=identity, timing=FAST),
            on_change=lambda leading, change: self.changes.append(change),
        )
        self.duties_running = False
        self.duties_stopped_at: float | None = None
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def duties(self, ended: asyncio.Event) -> None:
        self.duties_running = True
        try:
            await ended.wait()
        finally:
            self.duties_running = False
            self.duties_stopped_at = time.monotonic()

    def start(self) -> Candidate:
        self.task = asyncio.create_task(self.elector.run(self.stop, self.duties))
        return self

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 10)


async def _lease(api: ApiClient, name: str) -> client.V1Lease:
    return await client.CoordinationV1Api(api).read_namespaced_lease(name, "default")


async def test_one_of_two_leads_and_a_clean_stop_hands_over_within_a_retry_period(kube: ApiClient) -> None:
    name = f"lease-{uuid.uuid4().hex[:6]}"
    a, b = Candidate(kube, name, "a").start(), Candidate(kube, name, "b").start()
    try:
        await eventually(lambda: a.elector.is_leader or b.elector.is_leader, what="a leader", within=10)
        await asyncio.sleep(2 * FAST.retry_period_s)
        leader, standby = (a, b) if a.elector.is_leader else (b, a)
        assert not standby.elector.is_leader and leader.duties_running and not standby.duties_running
        # the loser of the race to create the lease reads it again only after a jittered wait (up to 2.2 retry periods)
        await eventually(
            lambda: standby.elector.holder == leader.elector.identity, what="the standby to name the holder", within=10
        )
        await leader.close()
        stopped = time.monotonic()
        assert leader.changes == ["acquired", "released"] and not leader.duties_running
        assert (await _lease(kube, name)).spec.holder_identity in (None, "", standby.elector.identity)
        # the elector leads once its write of the lease returns; it starts the duties on its next turn of the loop
        await eventually(
            lambda: standby.elector.is_leader and standby.duties_running,
            what="the standby to lead and run its duties",
            within=10,
            interval=0.05,
        )
        handover = time.monotonic() - stopped
        assert standby.changes == ["acquired"]  # a released lease: no failover
        assert handover < FAST.lease_duration_s, f"took {handover:.1f}s: the lease was waited out, not released"
        assert (await _lease(kube, name)).spec.lease_transitions == 1
    finally:
        await a.close()
        await b.close()


async def test_a_leader_cut_off_stands_down_before_the_standby_takes_over(
    kube: ApiClient, control_plane, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The leader loses the API server (its client points nowhere): it stops its duties at the renew deadline by
    its own clock, and the standby takes the expired lease only after that (a failover: `took_over`)."""
    name = f"lease-{uuid.uuid4().hex[:6]}"
    a = Candidate(kube, name, "a").start()
    await eventually(lambda: a.elector.is_leader, what="a to lead", within=10)
    b = Candidate(kube, name, "b").start()
    try:
        await asyncio.sleep(1.0)
        conf = control_plane.client_configuration()
        conf.host = "https://127.0.0.1:9"  # nothing listens: every call fails at once
        a.elector.api = ApiClient(configuration=conf)
        await eventually(lambda: b.elector.is_leader, what="b to take over", within=4 * FAST.lease_duration_s)
        took_over = time.monotonic()
        assert a.duties_stopped_at is not None and a.duties_stopped_at < took_over
        assert a.changes[-1] == "lost" and b.changes[-1] == "took_over", (a.changes, b.changes)
        assert not a.elector.is_leader
        await eventually(lambda: b.duties_running, what="b's duties to start", within=5)
        await a.elector.api.close()
        a.elector.api = kube
    finally:
        await a.close()
        await b.close()


async def test_a_lease_the_api_server_refuses_is_reported_once_and_nobody_leads(
    kube: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal (here: the Lease's namespace does not exist; in a cluster, typically a missing RBAC rule) is a
    warning naming the API server's answer, said once and not every retry period, and the replica stays standby."""
    config = ElectionConfig("lease-x", namespace=f"missing-{uuid.uuid4().hex[:6]}", identity="a", timing=FAST)
    elector = LeaderElector(kube, config)
    stop = asyncio.Event()
    with caplog.at_level("DEBUG", logger="shared.kube.leases"):
        task = asyncio.create_task(elector.run(stop))
        await asyncio.sleep(4 * FAST.retry_period_s * 2.2)
        stop.set()
        await asyncio.wait_for(task, 10)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "404" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert not elector.is_leader and elector.failure
