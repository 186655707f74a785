"""A reserver process for the race test: hammers the ledger and reports what it was told."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable

from shared.events.catalogue import AllocationPart
from shared.ledger.db import make_engine
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import InsufficientCapacity, QuotaExceeded, Reservation, ReservationRequest

Reserve = Callable[[ReservationRequest], Awaitable[Reservation]]


async def _actor(
    ledger: Ledger, reserve: Reserve, gpus: list[tuple[str, int]], rng: random.Random, attempts: int, out: dict
) -> None:
    held: list[tuple[uuid.UUID, str]] = []
    for _ in range(attempts):
        if held and rng.random() < 0.25:
            allocation_id, pod_uid = held.pop(rng.randrange(len(held)))
            if await ledger.release(allocation_id, pod_uid, "node-r", "race test release"):
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
            result = await reserve(request)
        except (InsufficientCapacity, QuotaExceeded):
            out["refused"].append(str(request.allocation_id))
        else:
            assert result.created
            out["reserved"].append(str(result.allocation_id))
            held.append((result.allocation_id, pod_uid))


async def _main(
    database_url: str, seed: int, actors: int, attempts: int, gpus: list[tuple[str, int]], grouped: bool
) -> dict:
    engine = make_engine(database_url, pool_size=actors, max_overflow=0)
    ledger = Ledger(engine, prefix="race", source=f"race-{seed}")
    # grouped: the process's actors reserve through one group commit, as the extender's binds do
    group = GroupCommit(ledger.reserve_many, what="race")
    reserve: Reserve = group.submit if grouped else ledger.reserve
    out: dict = {"reserved": [], "refused": [], "released": []}
    try:
        await asyncio.gather(
            *(_actor(ledger, reserve, gpus, random.Random(seed * 1000 + i), attempts, out) for i in range(actors))
        )
    finally:
        await engine.dispose()
    out["batches"] = group.batches
    return out


def run(
    database_url: str, seed: int, actors: int, attempts: int, gpus: list[tuple[str, int]], grouped: bool = False
) -> dict:
    """Process entry point."""
    return asyncio.run(_main(database_url, seed, actors, attempts, gpus, grouped))
