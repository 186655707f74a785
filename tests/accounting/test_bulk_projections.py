"""Bulk projections (issue 18): a batch applied at once has exactly the effects of its events applied one by one.

The reference is the one-by-one path as it was (`sequential.py`), run against the same real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting import projection_plan, projections
from services.accounting.projections import Applied, Projector
from services.accounting.tables import CONSUMER, pending, timeline, usage_samples
from shared.events.catalogue import (
    AllocationPart,
    AssignedEvent,
    BoundEvent,
    Event,
    ExchangedEvent,
    FailedEvent,
    HealthEvent,
    RefusedEvent,
    ReleasedEvent,
    ReservedEvent,
    TerminatingEvent,
    UsageEvent,
    UsageSample,
)
from shared.ledger.db import make_engine
from shared.ledger.models import applied_events

from . import sequential

BASE = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
PODS = ("pod-0", "pod-1", "pod-2")
ALLOCATIONS = tuple(uuid.uuid5(uuid.NAMESPACE_OID, f"allocation-{i}") for i in range(5))
SWAPPED = (0, 1)  # allocations reserved before each scenario: exchanges name only these (their pod is known)


def pod_of(i: int) -> str:
    return PODS[i % len(PODS)]


def reserved(i: int, at: datetime, **kw: Any) -> ReservedEvent:
    part = AllocationPart(container="main", container_index=0, gpu_uuid="GPU-0", gpu_index=0, memory_mib=1024)
    return ReservedEvent(
        allocation_id=ALLOCATIONS[i],
        pod_uid=pod_of(i),
        namespace="ns",
        pod_name=pod_of(i),
        node="node-0",
        parts=[part],
        occurred_at=at,
        **kw,
    )


def refused(pod: str, at: datetime, summary: str = "no fit", **kw: Any) -> RefusedEvent:
    return RefusedEvent(
        pod_uid=pod,
        namespace="ns",
        pod_name=pod,
        summary=summary,
        reasons={"node-0": summary},
        occurred_at=at,
        **kw,
    )


# --- what the read models hold, in insertion order ---------------------------------------------------------


async def _reset(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE acc_timeline, acc_pending, usage_samples RESTART IDENTITY"))
        await conn.execute(applied_events.delete().where(applied_events.c.consumer == CONSUMER))


async def _snapshot(engine: AsyncEngine) -> dict[str, Any]:
    async with engine.connect() as conn:
        rows = {
            "timeline": (await conn.execute(select(timeline).order_by(timeline.c.id))).all(),
            "pending": (await conn.execute(select(pending).order_by(pending.c.pod_uid))).all(),
            "usage": (await conn.execute(select(usage_samples).order_by(usage_samples.c.id))).all(),
            "claims": (
                await conn.execute(
                    select(applied_events.c.event_id)
                    .where(applied_events.c.consumer == CONSUMER)
                    .order_by(applied_events.c.event_id)
                )
            )
            .scalars()
            .all(),
        }
    # ids are serial: drop them (the rows' order says enough)
    rows["timeline"] = [tuple(r)[1:] for r in rows["timeline"]]
    rows["usage"] = [tuple(r)[1:] for r in rows["usage"]]
    rows["pending"] = [tuple(r) for r in rows["pending"]]
    return rows


async def _one_by_one(engine: AsyncEngine, events: list[Event]) -> list[Applied]:
    out = []
    for event in events:
        async with engine.begin() as conn:
            out.append(await sequential.apply(conn, event))
    return out


async def _in_batches(engine: AsyncEngine, batches: list[list[Event]]) -> list[Applied]:
    out = []
    for batch in batches:
        async with engine.begin() as conn:
            out += await projections.apply_many(conn, batch)
    return out


SETUP: list[Event] = [reserved(i, BASE - timedelta(hours=1)) for i in SWAPPED]


async def _compare(engine: AsyncEngine, batches: list[list[Event]]) -> None:
    """The same events one by one (the old path) and in these batches (bulk): same rows, same results."""
    delivered = [e for batch in batches for e in batch]
    await _reset(engine)
    await _one_by_one(engine, SETUP)
    expected = await _one_by_one(engine, delivered)
    expected_rows = await _snapshot(engine)
    await _reset(engine)
    await _one_by_one(engine, SETUP)
    got = await _in_batches(engine, batches)
    assert await _snapshot(engine) == expected_rows
    assert got == expected


# --- random scenarios -------------------------------------------------------------------------------------

times = st.integers(0, 6).map(lambda k: BASE + timedelta(seconds=k))
allocs = st.integers(0, len(ALLOCATIONS) - 1)


def _life(cls: type, **extra: Any) -> st.SearchStrategy[Event]:
    return st.builds(
        lambda i, at: cls(allocation_id=ALLOCATIONS[i], pod_uid=pod_of(i), node="node-0", occurred_at=at, **extra),
        allocs,
        times,
    )


events = st.one_of(
    st.builds(reserved, allocs, times),
    _life(BoundEvent),
    _life(AssignedEvent, container="main", gpu_uuids=["GPU-0"]),
    _life(TerminatingEvent),
    _life(ReleasedEvent, reason="pod deleted"),
    _life(FailedEvent, reason="node gone"),
    st.builds(
        lambda flip, at: ExchangedEvent(
            node="node-0",
            first_allocation_id=ALLOCATIONS[SWAPPED[flip]],
            first_container="main",
            second_allocation_id=ALLOCATIONS[SWAPPED[1 - flip]],
            second_container="main",
            occurred_at=at,
        ),
        st.integers(0, 1),
        times,
    ),
    st.builds(refused, st.sampled_from(PODS), times, st.sampled_from(["no fit", "too big", "quota"])),
    st.builds(
        lambda n, at: UsageEvent(
            node="node-0",
            samples=[
                UsageSample(gpu_uuid=f"GPU-{k}", pod_uid=PODS[k % len(PODS)], used_memory_mib=100 * k) for k in range(n)
            ],
            occurred_at=at,
        ),
        st.integers(0, 2),
        times,
    ),
    st.builds(lambda at: HealthEvent(node="node-0", gpu_uuid="GPU-0", healthy=False, occurred_at=at), times),
)


@st.composite
def scenarios(draw: st.DrawFn) -> list[list[Event]]:
    """Events, delivered with copies (redeliveries) in any order, cut into batches."""
    pool = draw(st.lists(events, min_size=1, max_size=12))
    picks = draw(st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=30))
    cuts = draw(st.lists(st.booleans(), min_size=len(picks), max_size=len(picks)))
    batches: list[list[Event]] = [[]]
    for pick, cut in zip(picks, cuts, strict=True):
        batches[-1].append(pool[pick])
        if cut:
            batches.append([])
    return [b for b in batches if b]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=scenarios())
def test_bulk_equals_one_by_one_on_random_sequences(database_url: str, batches: list[list[Event]]) -> None:
    async def run() -> None:
        engine = make_engine(database_url, pool_size=1)
        try:
            await _compare(engine, batches)
        finally:
            await engine.dispose()

    asyncio.run(run())


# --- hand-written cases -----------------------------------------------------------------------------------


async def test_refused_then_reserved_in_one_batch_leaves_nothing_pending(engine: AsyncEngine) -> None:
    await _reset(engine)
    t = BASE
    batch: list[Event] = [
        refused("pod-2", t, "first"),
        reserved(2, t + timedelta(seconds=1)),  # clears the refusal before it
        refused("pod-2", t + timedelta(seconds=2), "again"),  # a later refusal stays (the pod was moved back)
        refused("pod-0", t + timedelta(seconds=3), "late"),
        reserved(0, t + timedelta(seconds=4)),
        refused("pod-0", t + timedelta(seconds=2), "stale"),  # older than the reservation: ignored
    ]
    async with engine.begin() as conn:
        results = await projections.apply_many(conn, batch)
    assert [r.new for r in results] == [True] * 6
    rows = (await _snapshot(engine))["pending"]
    assert [(r[0], r[4]) for r in rows] == [("pod-2", "again")]
    await _compare(engine, [batch])


async def test_reserved_then_refused_later_keeps_the_refusal(engine: AsyncEngine) -> None:
    batch: list[Event] = [reserved(2, BASE), refused("pod-2", BASE + timedelta(seconds=5), "evicted, no fit")]
    await _compare(engine, [batch])
    assert [(r[0], r[4]) for r in (await _snapshot(engine))["pending"]] == [("pod-2", "evicted, no fit")]


async def test_duplicates_and_redeliveries_change_nothing(engine: AsyncEngine) -> None:
    first = reserved(3, BASE)
    bound = BoundEvent(
        allocation_id=ALLOCATIONS[3], pod_uid=pod_of(3), node="node-0", occurred_at=BASE + timedelta(seconds=2)
    )
    usage = UsageEvent(node="node-0", samples=[UsageSample(gpu_uuid="GPU-1", used_memory_mib=512)], occurred_at=BASE)
    batch: list[Event] = [first, first, bound, usage, bound, usage, first]
    await _reset(engine)
    async with engine.begin() as conn:
        results = await projections.apply_many(conn, batch)
    assert [r.new for r in results] == [True, False, True, True, False, False, False]
    assert results[2].latencies == [("reserved_to_bound", 2.0)]
    before = await _snapshot(engine)
    assert len(before["timeline"]) == 2 and len(before["usage"]) == 1 and len(before["claims"]) == 2
    async with engine.begin() as conn:  # the whole batch redelivered
        again = await projections.apply_many(conn, batch)
    assert not any(r.new for r in again)
    assert await _snapshot(engine) == before
    await _compare(engine, [batch, batch])


async def test_a_redelivery_after_its_claim_was_pruned_changes_nothing(engine: AsyncEngine) -> None:
    batch: list[Event] = [reserved(4, BASE), refused("pod-1", BASE + timedelta(seconds=1))]
    await _reset(engine)
    async with engine.begin() as conn:
        await projections.apply_many(conn, batch)
    before = await _snapshot(engine)
    async with engine.begin() as conn:  # the dedupe horizon passed: claims are gone, the rows stay
        await conn.execute(applied_events.delete().where(applied_events.c.consumer == CONSUMER))
        results = await projections.apply_many(conn, batch)
    assert all(r.new for r in results)  # claimed again, but every effect is idempotent by itself
    after = await _snapshot(engine)
    assert {k: v for k, v in after.items() if k != "claims"} == {k: v for k, v in before.items() if k != "claims"}


async def test_mixed_kinds_through_the_projector(engine: AsyncEngine) -> None:
    """Latencies, counts and `applied` through `Projector.handle_many`, as the consumer calls it."""
    await _reset(engine)
    i = 2
    alloc, pod = ALLOCATIONS[i], pod_of(i)
    t = BASE
    batch: list[Event] = [
        refused(pod, t),
        reserved(i, t + timedelta(seconds=1)),
        BoundEvent(allocation_id=alloc, pod_uid=pod, node="node-0", occurred_at=t + timedelta(seconds=3)),
        AssignedEvent(
            allocation_id=alloc,
            pod_uid=pod,
            node="node-0",
            container="main",
            gpu_uuids=["GPU-0", "GPU-1"],
            occurred_at=t + timedelta(seconds=4),
        ),
        AssignedEvent(
            allocation_id=alloc,
            pod_uid=pod,
            node="node-0",
            container="side",
            gpu_uuids=["GPU-2"],
            occurred_at=t + timedelta(seconds=5),
        ),
        UsageEvent(node="node-0", samples=[UsageSample(gpu_uuid="GPU-0", pod_uid=pod, used_memory_mib=9)]),
        HealthEvent(node="node-0", gpu_uuid="GPU-0", healthy=True),  # not projected
        TerminatingEvent(allocation_id=alloc, pod_uid=pod, node="node-0", occurred_at=t + timedelta(seconds=6)),
        ReleasedEvent(allocation_id=alloc, pod_uid=pod, node="node-0", occurred_at=t + timedelta(seconds=7)),
    ]
    seen: list[tuple[str, float]] = []
    projector = Projector(engine, on_latency=lambda name, s: seen.append((name, s)))
    assert await projector.handle_many(batch) == 8
    assert await projector.handle_many(batch) == 0
    assert projector.applied == 8
    assert seen == [("reserved_to_bound", 2.0), ("bound_to_assigned", 1.0)]  # the second container: no latency
    rows = await _snapshot(engine)
    assert [r[4] for r in rows["timeline"]] == ["reserved", "bound", "assigned", "assigned", "terminating", "released"]
    assert rows["timeline"][2][6] == "container main: GPU-0, GPU-1"
    assert rows["pending"] == []
    await _compare(engine, [batch])


async def test_an_exchange_names_the_pods_it_finds(engine: AsyncEngine) -> None:
    """The pod of each side comes from the allocation's earliest step, also one of the same batch; "" if none."""
    await _reset(engine)
    unknown = uuid.uuid4()
    batch: list[Event] = [
        reserved(3, BASE),
        ExchangedEvent(
            node="node-0",
            first_allocation_id=ALLOCATIONS[3],
            first_container="a",
            second_allocation_id=unknown,
            second_container="b",
            occurred_at=BASE + timedelta(seconds=1),
        ),
    ]
    async with engine.begin() as conn:
        await projections.apply_many(conn, batch)
    rows = (await _snapshot(engine))["timeline"]
    assert [(r[1], r[2], r[4]) for r in rows] == [
        (ALLOCATIONS[3], pod_of(3), "reserved"),
        (ALLOCATIONS[3], pod_of(3), "exchanged"),
        (unknown, "", "exchanged"),
    ]


# --- the planner alone ------------------------------------------------------------------------------------

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=8)  # (refusal?, at)


@given(initial=st.none() | st.integers(0, 5), sequence=ops)
def test_pending_net_effect_is_the_sequence(initial: int | None, sequence: list[tuple[bool, int]]) -> None:
    """One delete then one upsert per pod (`Pending`) does what the pod's refusals and reservations do in order,
    from any stored row."""

    def at(k: int) -> datetime:
        return BASE + timedelta(seconds=k)

    stored = None if initial is None else ("stored", at(initial))
    state = stored
    net = projection_plan.Pending()
    for n, (is_refusal, k) in enumerate(sequence):
        if is_refusal:
            if state is None or state[1] <= at(k):
                state = (f"op{n}", at(k))
            net.upsert({"summary": f"op{n}", "refused_at": at(k)})
        else:
            if state is not None and state[1] <= at(k):
                state = None
            net.delete(at(k))
    result = stored
    if result is not None and net.delete_upto is not None and result[1] <= net.delete_upto:
        result = None
    if net.row is not None and (result is None or result[1] <= net.row["refused_at"]):
        result = (net.row["summary"], net.row["refused_at"])
    assert result == state


def test_claims_skip_usage_and_unprojected_events_and_repeats() -> None:
    r = reserved(0, BASE)
    usage = UsageEvent(node="node-0", samples=[UsageSample(gpu_uuid="GPU-0", used_memory_mib=1)])
    health = HealthEvent(node="node-0", gpu_uuid="GPU-0", healthy=True)
    ref = refused("pod-0", BASE)
    assert projection_plan.claims([r, usage, health, ref, r]) == [r.event_id, ref.event_id]
