"""Group commit: callers queued during a transaction share the next one, and each still gets its own verdict.

`GroupCommit` alone (pure asyncio), then `Ledger.reserve_many` on real PostgreSQL: the regular batch in one
transaction with one staged event per pod, and the irregular ones (a GPU without room for everyone, a pod that
already holds a reservation, a pod twice, a namespace quota) answered pod by pod; `Ledger.mark_bound_many` and
`Ledger.mark_assigned_many` against `apply_transition` from every state; an allocation ended by racing callers is
one event.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import AllocationPart, AssignedEvent, GpuInfo, InventoryEvent, QuotaEvent
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, gpus, outbox
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, Reservation, ReservationRequest
from shared.ledger.rules import AllocationState

# ---- GroupCommit -------------------------------------------------------------------------------------------


async def test_items_queued_during_a_batch_go_together_in_the_next() -> None:
    seen: list[list[int]] = []
    release = asyncio.Event()

    async def run(items: list[int]) -> list[int | BaseException]:
        seen.append(items)
        if len(seen) == 1:
            await release.wait()  # the first batch is "in flight" while the others queue
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]

    group: GroupCommit[int, int] = GroupCommit(run, what="test")
    first = asyncio.create_task(group.submit(0))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(group.submit(i)) for i in range(1, 6)]
    await asyncio.sleep(0)
    release.set()
    assert await first == 0
    answers = await asyncio.gather(*rest, return_exceptions=True)
    assert seen == [[0], [1, 2, 3, 4, 5]]
    assert answers[1] == 20 and answers[3] == 40
    assert [str(a) for a in answers if isinstance(a, ValueError)] == ["odd 1", "odd 3", "odd 5"]
    assert group.batches == 2


async def test_a_failed_batch_reaches_each_of_its_callers_and_the_next_batch_still_runs() -> None:
    calls = 0

    async def run(items: list[str]) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("database went away")
        return [i.upper() for i in items]

    group: GroupCommit[str, str] = GroupCommit(run, what="test")
    with pytest.raises(ConnectionError):
        await group.submit("a")
    assert await group.submit("b") == "B"


async def test_a_caller_cancelled_before_its_batch_is_left_out() -> None:
    seen: list[list[str]] = []
    release = asyncio.Event()

    async def run(items: list[str]) -> list[str]:
        seen.append(items)
        await release.wait()
        return items

    group: GroupCommit[str, str] = GroupCommit(run, what="test")
    first = asyncio.create_task(group.submit("first"))
    await asyncio.sleep(0)
    gone = asyncio.create_task(group.submit("gone"))
    kept = asyncio.create_task(group.submit("kept"))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    assert await first == "first" and await kept == "kept"
    assert seen == [["first"], ["kept"]]


async def test_batches_are_capped() -> None:
    seen: list[int] = []

    async def run(items: list[int]) -> list[int]:
        seen.append(len(items))
        await asyncio.sleep(0)
        return items

    group: GroupCommit[int, int] = GroupCommit(run, what="test", max_batch=4)
    assert await asyncio.gather(*(group.submit(i) for i in range(10))) == list(range(10))
    assert max(seen) <= 4 and sum(seen) == 10


async def test_a_lingering_group_takes_the_callers_that_come_one_after_another_into_one_batch() -> None:
    """Callers that come one at a time, each after the previous one's batch would have ended: without a linger,
    a batch each; with one, those that come within it share the first batch, and a later one starts the next."""
    for linger_s, expected in ((0.0, [1, 1, 1]), (1.0, [3])):  # a long linger: a loaded machine is slow
        seen: list[list[int]] = []

        async def run(items: list[int]) -> list[int]:
            seen.append(items)  # noqa: B023 (each round's own list)
            return items

        group: GroupCommit[int, int] = GroupCommit(run, what="test", linger_s=linger_s)
        calls = []
        for i in range(3):
            calls.append(asyncio.create_task(group.submit(i)))
            await asyncio.sleep(0.01)  # the previous batch, if one started, has ended by now
        assert await asyncio.gather(*calls) == [0, 1, 2]
        assert [len(b) for b in seen] == expected, linger_s
    assert await asyncio.wait_for(group.submit(3), 10.0) == 3 and [len(b) for b in seen] == [3, 1]


# ---- Ledger.reserve_many -----------------------------------------------------------------------------------

NODE = "node-g"


async def _ledger(engine: AsyncEngine, gpus_gib: tuple[int, ...] = (16, 16)) -> Ledger:
    ledger = Ledger(engine, prefix="gc")
    await ledger.record(
        InventoryEvent(
            node=NODE,
            gpus=[
                GpuInfo(uuid=f"GPU-g{i}", index=i, memory_mib=g * 1024, memory_total_mib=g * 1024)
                for i, g in enumerate(gpus_gib)
            ],
        )
    )
    async with engine.begin() as conn:
        await conn.execute(outbox.delete())
    return ledger


def _request(gib: int, gpu: int = 0, *, namespace: str = "a", pod_uid: str | None = None) -> ReservationRequest:
    uid = pod_uid or f"pod-{uuid.uuid4().hex[:8]}"
    part = AllocationPart(
        container="main", container_index=0, gpu_uuid=f"GPU-g{gpu}", gpu_index=gpu, memory_mib=gib * 1024
    )
    return ReservationRequest(pod_uid=uid, namespace=namespace, pod_name=uid, node=NODE, parts=(part,))


async def _allocated(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return dict((await conn.execute(select(gpus.c.uuid, gpus.c.allocated_memory_mib))).all())


async def _staged(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(outbox))).scalar_one())


async def test_a_regular_batch_is_one_transaction_with_one_event_per_pod(engine: AsyncEngine) -> None:
    ledger = await _ledger(engine)
    requests = [_request(2, gpu=i % 2) for i in range(6)]
    answers = await ledger.reserve_many(requests)
    assert all(isinstance(a, Reservation) and a.created for a in answers)
    assert [a.allocation_id for a in answers] == [r.allocation_id for r in requests]  # type: ignore[union-attr]
    assert await _allocated(engine) == {"GPU-g0": 6 * 1024, "GPU-g1": 6 * 1024}
    assert await _staged(engine) == 6
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(allocations))).scalar_one() == 6


async def test_a_gpu_without_room_for_everyone_fails_only_the_pods_that_do_not_fit(engine: AsyncEngine) -> None:
    ledger = await _ledger(engine)
    requests = [_request(6), _request(4, gpu=1), _request(6), _request(6)]  # GPU-g0 has 16 GiB: the 3rd fits
    answers = await ledger.reserve_many(requests)
    assert [type(a).__name__ for a in answers] == ["Reservation", "Reservation", "Reservation", "InsufficientCapacity"]
    refused = answers[3]
    assert isinstance(refused, InsufficientCapacity) and "has 4096 MiB free, pod needs 6144 MiB" in str(refused)
    assert await _allocated(engine) == {"GPU-g0": 12 * 1024, "GPU-g1": 4 * 1024}
    assert await _staged(engine) == 3


async def test_a_pod_that_already_holds_a_reservation_gets_it_back(engine: AsyncEngine) -> None:
    ledger = await _ledger(engine)
    held = await ledger.reserve(_request(2, pod_uid="pod-held"))
    answers = await ledger.reserve_many([_request(2, pod_uid="pod-held"), _request(3)])
    again, fresh = answers
    assert isinstance(again, Reservation) and not again.created and again.allocation_id == held.allocation_id
    assert isinstance(fresh, Reservation) and fresh.created
    assert await _allocated(engine) == {"GPU-g0": 5 * 1024, "GPU-g1": 0}
    assert await _staged(engine) == 2  # the first reservation's event and the new one's


async def test_a_pod_twice_in_one_batch_is_reserved_once(engine: AsyncEngine) -> None:
    ledger = await _ledger(engine)
    first, second = await ledger.reserve_many([_request(2, pod_uid="pod-twice"), _request(2, pod_uid="pod-twice")])
    assert isinstance(first, Reservation) and first.created
    assert isinstance(second, Reservation) and not second.created and second.allocation_id == first.allocation_id
    assert await _allocated(engine) == {"GPU-g0": 2 * 1024, "GPU-g1": 0}


async def test_a_namespace_quota_is_checked_pod_by_pod(engine: AsyncEngine) -> None:
    ledger = await _ledger(engine)
    await ledger.record(QuotaEvent(namespace="q", memory_mib=5 * 1024))
    answers = await ledger.reserve_many(
        [_request(2, namespace="q"), _request(2, namespace="q"), _request(2, namespace="q"), _request(8)]
    )
    assert [type(a).__name__ for a in answers] == ["Reservation", "Reservation", "QuotaExceeded", "Reservation"]
    assert isinstance(answers[2], QuotaExceeded) and "namespace q GPU memory quota" in str(answers[2])
    assert await _allocated(engine) == {"GPU-g0": 12 * 1024, "GPU-g1": 0}


async def test_racing_group_commits_fill_a_gpu_exactly(engine: AsyncEngine, database_url: str) -> None:
    """Three processes' worth of group commits (three ledgers, each its own engine) race 1 GiB pods at one
    16 GiB GPU: exactly 16 are told yes, everyone else is told why not, and the counters agree."""
    from shared.ledger.db import make_engine

    await _ledger(engine, gpus_gib=(16,))
    engines = [make_engine(database_url, pool_size=4) for _ in range(3)]
    try:
        groups = [GroupCommit(Ledger(e, prefix="gc").reserve_many, what="race") for e in engines]
        requests = [_request(1) for _ in range(60)]
        answers = await asyncio.gather(
            *(groups[i % 3].submit(r) for i, r in enumerate(requests)), return_exceptions=True
        )
    finally:
        for e in engines:
            await e.dispose()
    granted = [a for a in answers if isinstance(a, Reservation)]
    refused = [a for a in answers if isinstance(a, InsufficientCapacity)]
    assert len(granted) == 16 and len(refused) == 44, answers
    assert await _allocated(engine) == {"GPU-g0": 16 * 1024}
    assert await _staged(engine) == 16
    assert sum(g.batches for g in groups) < 60


# ---- Ledger.mark_bound_many ---------------------------------------------------------------------------------


async def _row(engine: AsyncEngine, allocation_id: uuid.UUID) -> tuple:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(allocations.c.state, allocations.c.bound_at).where(allocations.c.id == allocation_id)
            )
        ).one()
    return (row.state, row.bound_at is not None)


async def _in_state(ledger: Ledger, state: str) -> Reservation:
    """A 1 GiB reservation on GPU 0 moved to `state` through the ledger's own events."""
    from shared.events.catalogue import BoundEvent, ReleasedEvent

    r = await ledger.reserve(_request(1))
    if state == "failed":
        await ledger.mark_failed(r.allocation_id, r.pod_uid, NODE, "test")
    elif state in ("bound", "assigned", "released"):
        await ledger.record(BoundEvent(allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=NODE))
        if state == "assigned":
            await ledger.record(_assigned(r))
        if state == "released":
            await ledger.record(ReleasedEvent(allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=NODE, reason="t"))
    return r


def _assigned(r: Reservation, node: str = NODE) -> AssignedEvent:
    return AssignedEvent(
        allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=node, container="main", gpu_uuids=["GPU-g0"]
    )


async def test_bound_in_a_batch_does_what_one_bound_event_does_from_every_state(engine: AsyncEngine) -> None:
    """For each state an allocation can be in, the batched statement and `apply_transition` (what replay runs)
    leave the same row and report the same change."""
    from shared.events.catalogue import BoundEvent
    from shared.ledger.ledger import apply_event

    ledger = await _ledger(engine, gpus_gib=(64,))
    states = ["reserved", "bound", "assigned", "failed", "released"]
    batched = [await _in_state(ledger, s) for s in states]
    single = [await _in_state(ledger, s) for s in states]
    changed = await ledger.mark_bound_many([(r.allocation_id, r.pod_uid, NODE) for r in batched])
    expected = []
    for r in single:
        async with engine.begin() as conn:
            expected.append(
                await apply_event(conn, BoundEvent(allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=NODE))
            )
    assert changed == expected == [True, False, False, False, False]
    for b, s in zip(batched, single, strict=True):
        assert await _row(engine, b.allocation_id) == await _row(engine, s.allocation_id)


async def test_an_allocation_named_twice_in_a_bound_batch_is_stamped_as_its_one_staged_event_says(
    engine: AsyncEngine,
) -> None:
    """A pod seen bound twice within one batch (the binder's background marks): only the first mark is staged, so the
    row must carry the first mark's time too, or a replay of the stream would stamp another `bound_at` than the
    live ledger holds (found by the DRA rebuild test in a fresh-clone CI on a loaded machine)."""
    ledger = await _ledger(engine, gpus_gib=(256,))
    rs = [await ledger.reserve(_request(1)) for _ in range(200)]
    t0 = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
    firsts = [t0 + timedelta(seconds=i) for i in range(len(rs))]
    seconds = [t + timedelta(milliseconds=10) for t in firsts]
    bindings = [(r.allocation_id, r.pod_uid, NODE) for r in rs]
    changed = await ledger.mark_bound_many(bindings + bindings, at=firsts + seconds)
    assert changed == [True] * len(rs) + [False] * len(rs)
    async with engine.connect() as conn:
        stamped = dict(
            (
                await conn.execute(
                    select(allocations.c.id, allocations.c.bound_at).where(
                        allocations.c.id.in_([r.allocation_id for r in rs])
                    )
                )
            ).all()
        )
        staged = (await conn.execute(select(func.count()).select_from(outbox))).scalar()
    assert [stamped[r.allocation_id] for r in rs] == firsts
    assert staged is not None and staged >= len(rs)


async def test_racing_bound_batches_move_each_allocation_once(engine: AsyncEngine, database_url: str) -> None:
    """Two binders' group commits race `bound` for the same 40 allocations: each moves exactly once."""
    from shared.ledger.db import make_engine

    ledger = await _ledger(engine, gpus_gib=(64,))
    held = [await ledger.reserve(_request(1)) for _ in range(40)]
    engines = [make_engine(database_url, pool_size=4) for _ in range(2)]
    try:
        groups = [GroupCommit(Ledger(e, prefix="gc").mark_bound_many, what="bound") for e in engines]
        answers = await asyncio.gather(*(g.submit((r.allocation_id, r.pod_uid, NODE)) for r in held for g in groups))
    finally:
        for e in engines:
            await e.dispose()
    assert sum(answers) == 40
    for r in held:
        assert await _row(engine, r.allocation_id) == ("bound", True)
    # ... and the stream hears of each binding once: a `bound` that moved nothing stages no event (a second one
    # would show the step twice in accounting's timeline)
    async with engine.connect() as conn:
        staged = (await conn.execute(select(func.count()).where(outbox.c.subject.like("gc.bound.%")))).scalar_one()
    assert staged == 40


async def test_the_binders_grouped_reads_answer_each_reservation_with_its_own_facts(engine: AsyncEngine) -> None:
    from services.binder.reads import BindFacts, bind_facts_many

    ledger = await _ledger(engine)
    first = await ledger.reserve(_request(2, gpu=0))
    second = await ledger.reserve(_request(2, gpu=1))
    await ledger.mark_failed(second.allocation_id, second.pod_uid, NODE, "test")
    unknown = uuid.uuid4()
    answers = await bind_facts_many(
        engine,
        [(first.allocation_id, ["GPU-g0"]), (second.allocation_id, ["GPU-g1", "GPU-gone"]), (unknown, ["GPU-g0"])],
    )
    assert answers == [
        BindFacts("reserved", {"GPU-g0": 16 * 1024}),
        BindFacts("failed", {"GPU-g1": 16 * 1024}),
        BindFacts(None, {}),
    ]


# ---- Ledger.mark_assigned_many ------------------------------------------------------------------------------


async def _assigned_row(engine: AsyncEngine, allocation_id: uuid.UUID) -> tuple:
    from shared.ledger.models import allocation_parts

    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(allocations.c.state, allocations.c.assigned_at).where(allocations.c.id == allocation_id)
            )
        ).one()
        parts = (
            await conn.execute(
                select(allocation_parts.c.assigned_at).where(allocation_parts.c.allocation_id == allocation_id)
            )
        ).all()
    return (row.state, row.assigned_at is not None, [p.assigned_at is not None for p in parts])


async def test_assigned_in_a_batch_does_what_one_assigned_event_does_from_every_state(engine: AsyncEngine) -> None:
    """For each state an allocation can be in, the batched statements leave the same row as `apply_transition`
    (what replay runs) after the gateway's check: a live allocation on the event's node is assigned, anything
    else is refused and left as it was."""
    from shared.ledger.ledger import apply_event

    ledger = await _ledger(engine, gpus_gib=(64,))
    states = ["reserved", "bound", "assigned", "failed", "released"]
    batched = [await _in_state(ledger, s) for s in states]
    single = [await _in_state(ledger, s) for s in states]
    answers = await ledger.mark_assigned_many([_assigned(r) for r in batched])
    assert answers[:3] == [None, None, None]
    assert answers[3] == f"allocation {batched[3].allocation_id} is failed on {NODE}"
    assert answers[4] == f"allocation {batched[4].allocation_id} is released on {NODE}"
    for r in single[:3]:  # what the gateway lets through to `apply_transition`
        async with engine.begin() as conn:
            await apply_event(conn, _assigned(r))
    for b, s in zip(batched, single, strict=True):
        assert await _assigned_row(engine, b.allocation_id) == await _assigned_row(engine, s.allocation_id)
    # another node's agent, an allocation the ledger never had: refused, nothing written
    other = await _in_state(ledger, "bound")
    ghost = Reservation(uuid.uuid4(), "ghost", NODE, AllocationState.RESERVED, (), created=True)
    answers = await ledger.mark_assigned_many([_assigned(other, node="elsewhere"), _assigned(ghost)])
    assert answers == [
        f"allocation {other.allocation_id} is bound on {NODE}",
        f"the ledger has no allocation {ghost.allocation_id}",
    ]
    assert await _assigned_row(engine, other.allocation_id) == ("bound", False, [False])


async def test_a_batch_of_assigned_commands_is_one_transaction_staging_each_event_once(engine: AsyncEngine) -> None:
    """Every container of a pod and a second pod in one call: one commit, one staged event per command; the same
    command sent again (an agent's retry after a lost reply) is applied once and staged once."""
    from shared.events.catalogue import AssignedEvent

    ledger = await _ledger(engine, gpus_gib=(64,))
    commits = 0

    def committed() -> None:
        nonlocal commits
        commits += 1

    ledger.on_commit = committed
    r1 = await ledger.reserve(_request(1))
    r2 = await ledger.reserve(_request(2))
    async with engine.begin() as conn:
        await conn.execute(outbox.delete())
    commits = 0
    events = [
        AssignedEvent(allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=NODE, container="main", gpu_uuids=["x"])
        for r in (r1, r2)
    ]
    assert await ledger.mark_assigned_many([events[0], events[1], events[0]]) == [None, None, None]
    assert commits == 1 and await _staged(engine) == 2
    assert await ledger.mark_assigned_many([events[1]]) == [None]  # sent again while the outbox holds it
    assert await _staged(engine) == 2
    for r in (r1, r2):
        assert await _assigned_row(engine, r.allocation_id) == ("assigned", True, [True])


# ---- ending an allocation -----------------------------------------------------------------------------------


async def test_an_allocation_ended_by_racing_callers_is_one_event(engine: AsyncEngine) -> None:
    """Several callers end the same allocation at once (the binder's pod watch, its claim watch, a reconciliation
    pass; a release and a failure): one of them ends it, gives its capacity back once and stages one event; the
    others write nothing and stage nothing. Ending an allocation the ledger does not hold stages nothing either."""
    ledger = await _ledger(engine)
    r = await ledger.reserve(_request(4))
    async with engine.begin() as conn:
        await conn.execute(outbox.delete())
    enders = [ledger.release(r.allocation_id, r.pod_uid, NODE, f"caller {i}") for i in range(8)]
    enders.append(ledger.mark_failed(r.allocation_id, r.pod_uid, NODE, "binding failed"))
    changed = await asyncio.gather(*enders)
    assert sum(changed) == 1
    assert await _staged(engine) == 1
    assert (await _allocated(engine))["GPU-g0"] == 0
    assert not await ledger.release(uuid.uuid4(), "nobody", NODE, "unknown allocation")
    assert await _staged(engine) == 1
