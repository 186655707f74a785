"""GiB quotas at admission: the quota a gpushare ResourceClaim takes when it is created, and gives back with it.

Kubernetes enforces its own ResourceQuota when an object is created; gpushare's GiB quotas on the DRA path are
enforced at the same moment. gpushare admission (the extender's validating webhook for ResourceClaims of the
`gpushare-gpu` class) calls `admit_claim` with what the claim asks (`shared.dra.claim_demand`): in one transaction
under the namespace's quota lock (`quotas.lock_quota`, the lock every reservation in the namespace takes), it adds
up what the namespace holds (`namespace_usage`: live allocations, and the holds of claims not allocated yet) and
records the claim's hold, or refuses with a message naming the quota, what is held and what is left. Two creations
at the same moment serialise on the lock: the second sees the first one's hold.

A hold counts while its claim holds no live allocation; an allocated claim counts through its allocation (which
kube-scheduler made within what the claim asks), so a claim is never counted twice. The binder records claim
allocations without checking the quota again (`reservations.reserve(check_quota=False)`): the claim took its
quota when it was created, as a Kubernetes object does. A hold ends when its claim is deleted (`end_holds`, the
binder's claim watch) or when no claim with its UID exists some time after admission (`stale_holds`: a creation
that failed after the webhook answered, e.g. a name taken, or a retried generated name).

Namespaces without a quota take no hold (nothing to count). Holds are not ledger history (no events): they mirror
objects Kubernetes keeps, and the binder's reconciliation derives them again from the claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import and_, delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.ledger.db import reading
from shared.ledger.models import claim_holds, gpus, nodes, quotas
from shared.ledger.quotas import Usage, lock_quota, namespace_usage
from shared.ledger.reservations import QuotaExceeded
from shared.settings import MemoryUnit


@dataclass(frozen=True)
class ClaimHold:
    """What one claim asks, as admission counts it against its namespace's quota."""

    claim_uid: str
    namespace: str
    claim_name: str
    memory_mib: int
    compute: int
    pod_name: str = ""  # the pod the claim was made for (a template's claim), for messages


def _amount(mib: int, unit: MemoryUnit) -> str:
    """MiB as a person reads them: whole units of `unit` when they are, else MiB."""
    if unit.mib > 1 and mib % unit.mib == 0:
        return f"{mib // unit.mib} {unit.value}"
    return f"{mib} MiB"


def quota_message(hold: ClaimHold, usage: Usage, quota: tuple[int | None, int | None], unit: MemoryUnit) -> str | None:
    """Why `hold` does not fit its namespace's quota given `usage`, naming the quota, what is held and what is
    left, and what to do (None when it fits; pure)."""
    limit_memory, limit_compute = quota
    what = f"claim {hold.claim_name or hold.claim_uid}" + (f" of pod {hold.pod_name}" if hold.pod_name else "")
    held = (
        f"{{held}} held: {{allocated}} by allocated claims and pods, {{waiting}} by {usage.waiting_claims} "
        "claim(s) not allocated yet"
    )
    advice = (
        f"delete claims or workloads of namespace {hold.namespace}, or raise its quota (PUT /v1/quotas/"
        f"{hold.namespace} on gpushare accounting)"
    )
    if limit_memory is not None and usage.memory_mib + hold.memory_mib > limit_memory:
        left = max(0, limit_memory - usage.memory_mib)
        return (
            f"namespace {hold.namespace} GPU memory quota is {_amount(limit_memory, unit)}: "
            + held.format(
                held=_amount(usage.memory_mib, unit),
                allocated=_amount(usage.allocated_mib, unit),
                waiting=_amount(usage.waiting_mib, unit),
            )
            + f"; {_amount(left, unit)} left, {what} asks {_amount(hold.memory_mib, unit)}; {advice}"
        )
    if limit_compute is not None and usage.compute + hold.compute > limit_compute:
        left = max(0, limit_compute - usage.compute)
        return (
            f"namespace {hold.namespace} GPU compute quota is {limit_compute}%: "
            + held.format(
                held=f"{usage.compute}%",
                allocated=f"{usage.allocated_compute}%",
                waiting=f"{usage.waiting_compute}%",
            )
            + f"; {left}% left, {what} asks {hold.compute}%; {advice}"
        )
    return None


@dataclass(frozen=True)
class Admitted:
    """Admission's verdict on a claim that fits (`held`: a hold was recorded; False without a quota)."""

    held: bool
    usage: Usage | None = None


async def admit_claim(engine: AsyncEngine, hold: ClaimHold, unit: MemoryUnit, *, dry_run: bool = False) -> Admitted:
    """Count a claim being created against its namespace's quota: record its hold, or raise `QuotaExceeded` with
    `quota_message`. A namespace without a quota takes no hold (one read). The same claim UID admitted again (a
    webhook call kube-apiserver retried) keeps its one hold. `dry_run`: judge, record nothing."""
    read = select(quotas.c.memory_mib, quotas.c.compute).where(quotas.c.namespace == hold.namespace)
    async with engine.begin() as conn:
        quota = (await conn.execute(read)).first()
        if quota is None or (quota.memory_mib is None and quota.compute is None):
            return Admitted(held=False)
        await lock_quota(conn, hold.namespace)  # creations and reservations in the namespace serialise here
        quota = (await conn.execute(read)).first()  # as it is now that nobody else can change it
        if quota is None or (quota.memory_mib is None and quota.compute is None):
            return Admitted(held=False)
        known = (
            await conn.execute(select(claim_holds.c.claim_uid).where(claim_holds.c.claim_uid == hold.claim_uid))
        ).first()
        usage = await namespace_usage(conn, hold.namespace)
        if known is not None:
            return Admitted(held=True, usage=usage)
        refusal = quota_message(hold, usage, (quota.memory_mib, quota.compute), unit)
        if refusal is not None:
            raise QuotaExceeded(refusal)
        if not dry_run:
            await conn.execute(
                insert(claim_holds)
                .values(
                    claim_uid=hold.claim_uid,
                    namespace=hold.namespace,
                    claim_name=hold.claim_name,
                    pod_name=hold.pod_name,
                    memory_mib=hold.memory_mib,
                    compute=hold.compute,
                )
                .on_conflict_do_nothing(index_elements=[claim_holds.c.claim_uid])
            )
    return Admitted(held=not dry_run, usage=usage)


async def end_holds(engine: AsyncEngine, claim_uids: list[str]) -> list[bool]:
    """The claims are gone: their holds end (per claim, whether it had one). One transaction for many claims (the
    binder's group commit of claim deletions)."""
    if not claim_uids:
        return []
    async with engine.begin() as conn:
        done = await conn.execute(
            delete(claim_holds).where(claim_holds.c.claim_uid.in_(claim_uids)).returning(claim_holds.c.claim_uid)
        )
        ended = {r.claim_uid for r in done.all()}
    return [uid in ended for uid in claim_uids]


async def holds_older_than(engine: AsyncEngine, age_s: float) -> dict[str, tuple[str, str]]:
    """Claim UID -> (namespace, claim name) of the holds admitted more than `age_s` ago (by the database's clock):
    reconciliation's candidates. Read them before listing the claims: a hold whose claim is not listed then belongs
    to a creation that failed after admission, or to a claim deleted while nobody watched."""
    query = select(claim_holds.c.claim_uid, claim_holds.c.namespace, claim_holds.c.claim_name).where(
        claim_holds.c.admitted_at < func.now() - timedelta(seconds=age_s)
    )
    async with reading(engine) as conn:
        return {r.claim_uid: (r.namespace, r.claim_name) for r in (await conn.execute(query)).all()}


async def largest_dra_gpu_mib(engine: AsyncEngine) -> int:
    """The schedulable memory of the largest GPU on a DRA node (what a claim request without memory can take); 0
    when there is none."""
    query = (
        select(func.coalesce(func.max(gpus.c.memory_mib), 0))
        .select_from(gpus.join(nodes, nodes.c.name == gpus.c.node))
        .where(and_(nodes.c.allocator == "dra", gpus.c.retired_at.is_(None)))
    )
    async with reading(engine) as conn:
        return int((await conn.execute(query)).scalar_one())


async def has_quota(engine: AsyncEngine, namespace: str) -> bool:
    """Whether the namespace has a GPU quota."""
    query = select(quotas.c.namespace).where(
        and_(quotas.c.namespace == namespace, (quotas.c.memory_mib.is_not(None)) | (quotas.c.compute.is_not(None)))
    )
    async with reading(engine) as conn:
        return (await conn.execute(query)).first() is not None


async def quota_namespaces(engine: AsyncEngine) -> set[str]:
    """The namespaces with a GPU quota (the only ones whose claims take holds)."""
    query = select(quotas.c.namespace).where((quotas.c.memory_mib.is_not(None)) | (quotas.c.compute.is_not(None)))
    async with reading(engine) as conn:
        return {r.namespace for r in (await conn.execute(query)).all()}
