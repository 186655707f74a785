"""A reserver process for the race test: hammers the ledger and reports what it was told.

Failures that pass (a lock PostgreSQL gave up waiting for after `lock_timeout`, on a loaded machine) are retried as
the extender's bind retries them (`retry_transient`, services/extender/bind.py); an answer is what the retries end
with."""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shared.events.catalogue import AllocationPart
from shared.ledger.db import gave_up_waiting, make_engine, retry_transient
from shared.ledger.deadlines import Deadlines
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, Reservation, ReservationRequest

T = TypeVar("T")
Reserve = Callable[[ReservationRequest], Awaitable[Reservation]]
PATIENCE_S = 60.0  # how long an actor retries a failure that passes; past it the failure ends the test


async def _answer(call: Callable[[], Awaitable[T]], out: dict, what: str) -> T:
    """What `call()` ends with, retried as the extender's bind retries (`retry_transient`); the statements
    PostgreSQL ended at their lock deadline on the way are counted in `out["lock_timeouts"]`."""

    async def counted() -> T:
        try:
            return await call()
        except Exception as exc:
            if gave_up_waiting(exc):
                out["lock_timeouts"] += 1
            raise

    return await retry_transient(counted, budget_s=PATIENCE_S, what=what)


async def _actor(
    ledger: Ledger, reserve: Reserve, gpus: list[tuple[str, int]], rng: random.Random, attempts: int, out: dict
) -> None:
    held: list[tuple[uuid.UUID, str]] = []
    for _ in range(attempts):
        if held and rng.random() < 0.25:
            allocation_id, pod_uid = held.pop(rng.randrange(len(held)))
            release = functools.partial(ledger.release, allocation_id, pod_uid, "node-r", "race test release")
            if await _answer(release, out, "race release"):
                out["released"].append(str(allocation_id))
            continue
        chosen = rng.sample(gpus, k=rng.choice([1, 1, 1, 2]))
        pod_uid = f"pod-{uuid.uuid4()}"
        memory = rng.choice([1024, 2048, 4096])
        parts = tuple(
            AllocationPart(
                container="main",
                container_index=0,
                gpu_uuid=u,
                gpu_index=i,
                memory_mib=memory,
                compute=rng.choice([0, 10, 30]),
            )
            for u, i in sorted(chosen)
        )
        request = ReservationRequest(
            pod_uid=pod_uid, namespace=rng.choice(["a", "b"]), pod_name=pod_uid, node="node-r", parts=parts
        )
        try:
            result = await _answer(functools.partial(reserve, request), out, "race reserve")
        except (InsufficientCapacity, QuotaExceeded):
            out["refused"].append(str(request.allocation_id))
        else:
            assert result.created
            out["reserved"].append(str(result.allocation_id))
            held.append((result.allocation_id, pod_uid))


async def _main(
    database_url: str,
    seed: int,
    actors: int,
    attempts: int,
    gpus: list[tuple[str, int]],
    grouped: bool,
    lock_s: float | None,
) -> dict:
    deadlines = Deadlines() if lock_s is None else Deadlines(lock_s=lock_s)
    engine = make_engine(database_url, pool_size=actors, max_overflow=0, deadlines=deadlines)
    ledger = Ledger(engine, prefix="race", source=f"race-{seed}")
    # grouped: the process's actors reserve through one group commit, as the extender's binds do
    group = GroupCommit(ledger.reserve_many, what="race")
    reserve: Reserve = group.submit if grouped else ledger.reserve
    out: dict = {"reserved": [], "refused": [], "released": [], "lock_timeouts": 0}
    try:
        await asyncio.gather(
            *(_actor(ledger, reserve, gpus, random.Random(seed * 1000 + i), attempts, out) for i in range(actors))
        )
    finally:
        await engine.dispose()
    out["batches"] = group.batches
    return out


def run(
    database_url: str,
    seed: int,
    actors: int,
    attempts: int,
    gpus: list[tuple[str, int]],
    grouped: bool = False,
    lock_s: float | None = None,
) -> dict:
    """Process entry point; `lock_s` shortens PostgreSQL's `lock_timeout` (None: the services' default)."""
    return asyncio.run(_main(database_url, seed, actors, attempts, gpus, grouped, lock_s))
