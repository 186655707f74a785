"""No overcommit, whatever races: 4 OS processes x 8 reservers at the same two GPUs on real Postgres, each
reserving on its own or through its process's group commit (as the extender's binds do), and once with lock waits
cut short (as on a loaded machine, where PostgreSQL's `lock_timeout` ends some of them: the reservers retry as the
extender does, and every answer they end with is still true)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import GpuInfo, InventoryEvent, QuotaEvent
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations, gpus
from shared.ledger.rules import gpu_charges
from tests.foundation import race_worker

PROCESSES, ACTORS, ATTEMPTS = 4, 8, 25
GPUS = [("GPU-race-0", 0), ("GPU-race-1", 1)]
SHORT_LOCK_S = 0.02  # shorter than a reservation holds its namespace's quota lock while 16 actors queue for it


@pytest.mark.parametrize(
    ("grouped", "lock_s"),
    [(False, None), (True, None), (False, SHORT_LOCK_S)],
    ids=["one-by-one", "group-commit", "lock-timeouts"],
)
async def test_racing_reservers_never_overcommit_and_answer_truthfully(
    engine: AsyncEngine, database_url: str, grouped: bool, lock_s: float | None
) -> None:
    ledger = Ledger(engine, prefix="race")
    await ledger.record(
        InventoryEvent(
            node="node-r",
            gpus=[GpuInfo(uuid=u, index=i, memory_mib=16384, memory_total_mib=16384) for u, i in GPUS],
        )
    )
    await ledger.record(QuotaEvent(namespace="b", memory_mib=20 * 1024))

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
        futures = [
            pool.submit(race_worker.run, database_url, seed, ACTORS, ATTEMPTS, GPUS, grouped, lock_s)
            for seed in range(PROCESSES)
        ]
        results = [f.result(timeout=240) for f in futures]

    reserved = {a for r in results for a in r["reserved"]}
    refused = {a for r in results for a in r["refused"]}
    released = {a for r in results for a in r["released"]}
    assert len(reserved) > 20 and len(refused) > 5, "the race must both succeed and refuse many times"
    if lock_s is not None:  # PostgreSQL really ended lock waits, and the reservers rode them out
        assert sum(r["lock_timeouts"] for r in results) > 0
    if grouped:  # the actors' reservations really went in shared transactions
        assert 0 < sum(r["batches"] for r in results) < len(reserved) + len(refused)

    async with engine.connect() as conn:
        rows = {str(r.id): r.state for r in (await conn.execute(select(allocations.c.id, allocations.c.state)))}
        # every reported success is in the ledger, every reported failure is not
        assert reserved <= set(rows)
        assert not (refused & set(rows))
        assert {a for a, s in rows.items() if s == "released"} == released
        # no GPU holds more than it has, and its counters equal the sum of its live parts
        for gpu in (await conn.execute(select(gpus))).all():
            assert 0 <= gpu.allocated_memory_mib <= gpu.memory_mib
            assert 0 <= gpu.allocated_compute <= gpu.compute_units
        live_parts = (
            await conn.execute(
                select(allocation_parts)
                .join(allocations, allocations.c.id == allocation_parts.c.allocation_id)
                .where(allocations.c.state.in_(("reserved", "bound", "assigned")))
            )
        ).all()
        expected: dict[str, list[int]] = {}
        by_alloc: dict = {}
        for p in live_parts:
            by_alloc.setdefault(p.allocation_id, []).append(p)
        for parts in by_alloc.values():
            for gpu_uuid, (m, c) in gpu_charges(parts).items():
                acc = expected.setdefault(gpu_uuid, [0, 0])
                acc[0] += m
                acc[1] += c
        for gpu in (await conn.execute(select(gpus))).all():
            assert [gpu.allocated_memory_mib, gpu.allocated_compute] == expected.get(gpu.uuid, [0, 0])
        # the namespace quota held too
        used_b = (
            await conn.execute(
                select(func.coalesce(func.sum(allocations.c.memory_mib), 0)).where(
                    allocations.c.namespace == "b", allocations.c.state.in_(("reserved", "bound", "assigned"))
                )
            )
        ).scalar_one()
        assert used_b <= 20 * 1024


async def test_the_database_itself_refuses_an_overcommitting_write(engine: AsyncEngine) -> None:
    ledger = Ledger(engine, prefix="race")
    await ledger.record(
        InventoryEvent(node="n", gpus=[GpuInfo(uuid="G", index=0, memory_mib=1024, memory_total_mib=1024)])
    )
    import pytest
    import sqlalchemy.exc

    with pytest.raises(sqlalchemy.exc.IntegrityError, match="ck_gpus_memory_fits"):
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE gpus SET allocated_memory_mib = 2048 WHERE uuid = 'G'"))
