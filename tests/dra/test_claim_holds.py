"""GiB quotas at claim creation, against real PostgreSQL: `claim_holds.admit_claim` counts a namespace's live
allocations and the holds of its claims not allocated yet under the namespace's quota lock, so racing creations
cannot pass together; a refusal names the quota, what is held and what is left; an allocated claim counts once;
holds end with their claims. (Through the real kube-apiserver and webhook: tests/dra/test_claim_quota.py.)"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.catalogue import AllocationPart, InventoryEvent, QuotaEvent
from shared.ledger.claim_holds import (
    ClaimHold,
    admit_claim,
    end_holds,
    has_quota,
    holds_older_than,
    largest_dra_gpu_mib,
    quota_message,
)
from shared.ledger.ledger import Ledger
from shared.ledger.models import claim_holds
from shared.ledger.quotas import Usage, namespace_usage
from shared.ledger.reservations import QuotaExceeded, ReservationRequest
from shared.settings import MemoryUnit
from tests.dra.objects import gpu
from tests.dra.test_ledger import GPUS, NODE, claim_event

GIB = MemoryUnit.GIB


def hold(mib: int = 1024, *, namespace: str = "team", compute: int = 0, name: str = "") -> ClaimHold:
    uid = str(uuid.uuid4())
    return ClaimHold(uid, namespace, name or f"c-{uid[:6]}", mib, compute, pod_name="p")


async def _holds(engine: AsyncEngine, namespace: str = "team") -> list[str]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(claim_holds.c.claim_uid).where(claim_holds.c.namespace == namespace))).all()
    return [r.claim_uid for r in rows]


async def test_a_namespace_without_a_quota_takes_no_hold(engine: AsyncEngine) -> None:
    admitted = await admit_claim(engine, hold(), GIB)
    assert not admitted.held and await _holds(engine) == []
    assert not await has_quota(engine, "team")


async def test_holds_count_until_the_quota_is_full_and_the_refusal_says_what_is_held_and_left(
    engine: AsyncEngine,
) -> None:
    ledger = Ledger(engine, prefix="t")
    await ledger.record(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))  # type: ignore[arg-type]
    await ledger.record(QuotaEvent(namespace="team", memory_mib=4096))
    assert await has_quota(engine, "team")
    first, second = hold(2048), hold(1024)
    assert (await admit_claim(engine, first, GIB)).held and (await admit_claim(engine, second, GIB)).held
    assert (await admit_claim(engine, first, GIB)).held  # the same claim again (a retried call): still one hold
    assert len(await _holds(engine)) == 2
    with pytest.raises(QuotaExceeded) as refused:
        await admit_claim(engine, hold(2048, name="big"), GIB)
    message = str(refused.value)
    for words in ("quota is 4 GiB", "3 GiB held", "0 GiB by allocated", "3 GiB by 2 claim(s) not allocated yet"):
        assert words in message, message
    assert "1 GiB left" in message and "claim big of pod p asks 2 GiB" in message and "PUT /v1/quotas/team" in message
    # a dry run judges and records nothing
    assert not (await admit_claim(engine, hold(1024), GIB, dry_run=True)).held
    assert len(await _holds(engine)) == 2
    # a claim that ends gives its quota back
    assert await end_holds(engine, [first.claim_uid, "no-such-claim"]) == [True, False]
    assert (await admit_claim(engine, hold(2048), GIB)).held


async def test_an_allocated_claim_counts_once_and_the_extender_path_sees_the_holds(engine: AsyncEngine) -> None:
    ledger = Ledger(engine, prefix="t")
    await ledger.record(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))  # type: ignore[arg-type]
    await ledger.record(QuotaEvent(namespace="team", memory_mib=8192))
    event = claim_event("4Gi")
    held = ClaimHold(event.claim_uid, "team", event.claim_name, 4096, 0)
    assert (await admit_claim(engine, held, GIB)).held
    async with engine.connect() as conn:
        assert await namespace_usage(conn, "team") == Usage(0, 0, 4096, 0, 1)
    await ledger.reserve_claim(event)  # allocated: it counts through its allocation, not twice
    async with engine.connect() as conn:
        assert await namespace_usage(conn, "team") == Usage(4096, 0, 0, 0, 0)
    assert (await admit_claim(engine, hold(4096), GIB)).held  # 4 allocated + 4 waiting = the quota
    part = AllocationPart(container="c", container_index=0, gpu_uuid=GPUS[1].uuid, gpu_index=1, memory_mib=1024)
    with pytest.raises(QuotaExceeded, match="1 DRA claim"):
        await ledger.reserve(ReservationRequest(pod_uid="x", namespace="team", pod_name="x", node=NODE, parts=(part,)))


async def test_fifty_claims_created_at_once_where_ten_fit_admit_exactly_ten(engine: AsyncEngine) -> None:
    ledger = Ledger(engine, prefix="t")
    await ledger.record(QuotaEvent(namespace="team", memory_mib=10 * 1024))
    results = await asyncio.gather(*(admit_claim(engine, hold(1024), GIB) for _ in range(50)), return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(admitted) == 10 and all(a.held for a in admitted)
    assert len(refused) == 40 and all(isinstance(r, QuotaExceeded) for r in refused), refused[:3]
    assert len(await _holds(engine)) == 10


async def test_reconciliation_finds_old_holds_and_a_whole_gpu_is_the_largest_dra_gpu(engine: AsyncEngine) -> None:
    ledger = Ledger(engine, prefix="t")
    assert await largest_dra_gpu_mib(engine) == 0
    await ledger.record(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))  # type: ignore[arg-type]
    await ledger.record(InventoryEvent(node="dp", gpus=[gpu("dp", 0, 80)]))  # type: ignore[arg-type]
    assert await largest_dra_gpu_mib(engine) == 16384  # the 80 GiB GPU is on a device-plugin node
    await ledger.record(QuotaEvent(namespace="team", memory_mib=8192))
    old, new = hold(), hold()
    await admit_claim(engine, old, GIB)
    await admit_claim(engine, new, GIB)
    async with engine.begin() as conn:
        await conn.execute(
            update(claim_holds)
            .where(claim_holds.c.claim_uid == old.claim_uid)
            .values(admitted_at=claim_holds.c.admitted_at - timedelta(minutes=5))
        )
    assert await holds_older_than(engine, 60) == {old.claim_uid: ("team", old.claim_name)}


def test_the_message_names_compute_when_compute_is_what_does_not_fit() -> None:
    usage = Usage(1024, 60, 0, 20, 1)
    message = quota_message(hold(1024, compute=30), usage, (None, 100), GIB)
    assert message is not None and "compute quota is 100%" in message and "80% held" in message
    assert "20% left" in message and "asks 30%" in message
    assert quota_message(hold(1024, compute=20), usage, (None, 100), GIB) is None
    assert "1536 MiB" in (quota_message(hold(1536), usage, (2048, None), GIB) or "")
