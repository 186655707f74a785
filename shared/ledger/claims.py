"""Recording a DRA claim's allocation: the reservation statements, plus what makes a claim a claim.

kube-scheduler allocated the claim's shares from the node's ResourceSlice; the ledger records them in one
transaction, with the very statements and CHECK constraints of `reservations.reserve` (the conditional counter
UPDATE per GPU in UUID order). The namespace's GiB quota is not checked again: the claim took it when it was
created (gpushare admission, `claim_holds`), as a Kubernetes object takes its ResourceQuota. On top of them:

* the same claim allocation is recorded once (its id comes from the claim's UID and share ids), and one that
  ended is never brought back;
* a node whose agent serves the device plugins takes no claim share, and a GPU that holds shares the extender
  placed takes none either (`PathConflict`): one GPU is reachable through one path. The check runs after the
  GPU rows are locked by the counter UPDATE, so an extender reservation that committed first is seen;
* the allocation row carries the claim's UID and name (a live claim has at most one live allocation).
"""

from __future__ import annotations

from sqlalchemy import and_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import ClaimReservedEvent
from shared.ledger.models import allocation_parts, allocations, nodes
from shared.ledger.reservations import Reservation, ReservationError, live_reservation, reserve
from shared.ledger.rules import LIVE_STATE_VALUES, is_live


class PathConflict(ReservationError):
    """The GPU is served by the device-plugin path (its node, or shares the extender placed on it)."""


class ClaimAllocationEnded(ReservationError):
    """This very claim allocation was recorded before and has ended: it is not brought back."""


async def reserve_claim(conn: AsyncConnection, event: ClaimReservedEvent) -> Reservation:
    """Apply a claim's allocation inside the caller's transaction (which must stage `event` when `created`).

    Returns the live allocation (created=False when it was recorded before). Raises `InsufficientCapacity`,
    `QuotaExceeded`, `PathConflict`, `ClaimAllocationEnded` or `ReservationError`; the caller rolls back.
    """
    known = (
        await conn.execute(
            select(allocations.c.state, allocations.c.pod_uid).where(allocations.c.id == event.allocation_id)
        )
    ).first()
    if known is not None:
        if not is_live(known.state) or known.pod_uid != event.pod_uid:
            raise ClaimAllocationEnded(
                f"allocation {event.allocation_id} of claim {event.namespace}/{event.claim_name} is {known.state}: "
                "the ledger does not bring an ended allocation back"
            )
        existing = await live_reservation(conn, event.pod_uid)
        assert existing is not None
        return existing
    other = (
        await conn.execute(
            select(allocations.c.id).where(
                and_(allocations.c.claim_uid == event.claim_uid, allocations.c.state.in_(LIVE_STATE_VALUES))
            )
        )
    ).first()
    if other is not None:
        raise ReservationError(
            f"claim {event.namespace}/{event.claim_name} holds allocation {other.id} already; it must end first"
        )
    allocator = (await conn.execute(select(nodes.c.allocator).where(nodes.c.name == event.node))).scalar()
    if allocator != "dra":
        raise PathConflict(
            f"node {event.node} is not a DRA node in the gpushare ledger "
            f"({'unknown' if allocator is None else 'its agent serves the device plugins'}): its GPUs are placed by "
            "the scheduler extender"
        )
    result = await reserve(conn, event, check_quota=False)  # the claim took its quota when it was created
    if not result.created:
        raise ReservationError(
            f"pod {event.namespace}/{event.pod_name} holds allocation {result.allocation_id} already; "
            f"claim {event.claim_name} cannot add another"
        )
    gpu_uuids = sorted({p.gpu_uuid for p in event.parts})
    taken = (
        await conn.execute(
            select(allocations.c.namespace, allocations.c.pod_name, allocation_parts.c.gpu_uuid)
            .select_from(allocations.join(allocation_parts, allocation_parts.c.allocation_id == allocations.c.id))
            .where(
                and_(
                    allocation_parts.c.gpu_uuid.in_(gpu_uuids),
                    allocations.c.state.in_(LIVE_STATE_VALUES),
                    allocations.c.claim_uid.is_(None),
                    allocations.c.id != event.allocation_id,
                )
            )
            .limit(1)
        )
    ).first()
    if taken is not None:
        raise PathConflict(
            f"GPU {taken.gpu_uuid} holds a share the scheduler extender placed (pod {taken.namespace}/"
            f"{taken.pod_name}); a GPU is served by one path: the DRA path takes none of it until those pods end"
        )
    await conn.execute(
        update(allocations)
        .where(allocations.c.id == event.allocation_id)
        .values(claim_uid=event.claim_uid, claim_name=event.claim_name)
    )
    return result
