"""Recording a DRA claim's allocation: the reservation statements, plus what makes a claim a claim.

kube-scheduler allocated the claim's shares from the node's ResourceSlice; the ledger records them in one
transaction, writing what `reservations.reserve` writes, under the same CHECK constraints (the conditional counter
UPDATE, the GPUs locked in UUID order first). The namespace's GiB quota is not checked again: the claim took it when
it was created (gpushare admission, `claim_holds`), as a Kubernetes object takes its ResourceQuota. On top of them:

* the same claim allocation is recorded once (its id comes from the claim's UID and share ids), and one that
  ended is never brought back;
* a node whose agent serves the device plugins takes no claim share, and a GPU that holds shares the extender
  placed takes none either (`PathConflict`): one GPU is reachable through one path. The check runs after the
  GPU rows are locked by the counter UPDATE, so an extender reservation that committed first is seen;
* the allocation row carries the claim's UID and name (a live claim has at most one live allocation).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import ClaimReservedEvent
from shared.ledger import driver, locks
from shared.ledger.models import LIVE_SQL, part_arrays
from shared.ledger.reservations import (
    InsufficientCapacity,
    Reservation,
    ReservationError,
    explain_refusal,
    live_reservation,
)
from shared.ledger.rules import AllocationState, gpu_charges, is_live


class PathConflict(ReservationError):
    """The GPU is served by the device-plugin path (its node, or shares the extender placed on it)."""


class ClaimAllocationEnded(ReservationError):
    """This very claim allocation was recorded before and has ended: it is not brought back."""


_LIVE = LIVE_SQL.replace("state", "a.state")
# after the GPU rows are locked, in one round trip: who places shares on the node, this very allocation if it was
# recorded before, another live allocation of the claim, and a live share the extender placed on one of the GPUs
_CHECKS = (
    "SELECT (SELECT allocator FROM nodes WHERE name = $1) AS allocator,"
    " (SELECT a.state FROM allocations AS a WHERE a.id = $2) AS known_state,"
    " (SELECT a.pod_uid FROM allocations AS a WHERE a.id = $2) AS known_pod,"
    f" (SELECT a.id FROM allocations AS a WHERE a.claim_uid = $3 AND {_LIVE} AND a.id <> $2 LIMIT 1) AS other,"
    " (SELECT a.namespace || '/' || a.pod_name || ' ' || p.gpu_uuid FROM allocation_parts AS p"
    " JOIN allocations AS a ON a.id = p.allocation_id"
    f" WHERE p.gpu_uuid = ANY($4::text[]) AND {_LIVE} AND a.claim_uid IS NULL AND a.id <> $2 LIMIT 1) AS taken"
)
# the allocation (with the claim's UID and name), the counters (the conditional UPDATE the CHECK constraints back)
# and the parts, in one statement: nothing is charged or added when the pod holds a live allocation already (no id
# comes back); a GPU that is not charged (short of room, unhealthy, retired) is missing from `charged`, and the
# caller then raises, which rolls the whole transaction back. The parts' foreign key is checked at the statement's
# end, when the allocation row is there.
_RECORD_CLAIM_ALLOCATION = (
    "WITH ins AS (INSERT INTO allocations (id, pod_uid, namespace, pod_name, owner_kind, owner_name, node, state,"
    " memory_mib, compute, reserved_at, pod_created_at, claim_uid, claim_name)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
    f" ON CONFLICT (pod_uid) WHERE {LIVE_SQL} DO NOTHING RETURNING id), "
    "charged AS (UPDATE gpus AS g SET allocated_memory_mib = g.allocated_memory_mib + w.memory,"
    " allocated_compute = g.allocated_compute + w.compute, updated_at = $11 "
    "FROM unnest($15::text[], $16::integer[], $17::integer[]) AS w(uuid, memory, compute) "
    "WHERE EXISTS (SELECT 1 FROM ins) AND g.uuid = w.uuid AND g.node = $7 AND g.healthy AND g.retired_at IS NULL"
    " AND g.allocated_memory_mib + w.memory <= g.memory_mib AND g.allocated_compute + w.compute <= g.compute_units "
    "RETURNING g.uuid), "
    "parts AS (INSERT INTO allocation_parts (allocation_id, container, container_index, init, sidecar, gpu_uuid,"
    " gpu_index, memory_mib, compute) "
    "SELECT ins.id, p.* FROM ins, unnest($18::text[], $19::integer[], $20::boolean[], $21::boolean[], $22::text[],"
    " $23::integer[], $24::integer[], $25::integer[]) AS p) "
    "SELECT (SELECT id FROM ins) AS id, ARRAY(SELECT uuid FROM charged) AS charged"
)


async def reserve_claim(conn: AsyncConnection, event: ClaimReservedEvent) -> Reservation:
    """Apply a claim's allocation inside the caller's transaction (which must stage `event` when `created`).

    Returns the live allocation (created=False when it was recorded before). Raises `InsufficientCapacity`,
    `PathConflict`, `ClaimAllocationEnded` or `ReservationError`; the caller rolls back. The statements go to
    asyncpg directly (`driver`), as the extender's batch reservations do: the claim's GPUs locked in UUID order,
    the checks in one round trip, then the allocation, the counters (the conditional UPDATE the CHECK constraints
    back), the parts and the claim's UID and name, written as `reservations.reserve` writes them, in one statement:
    three statements in all.
    """
    charges = gpu_charges(event.parts)
    uuids = sorted(charges)
    await locks.lock_gpus(conn, uuids)  # GPUs before allocations (`locks`)
    (found,) = await driver.fetch(conn, _CHECKS, event.node, event.allocation_id, event.claim_uid, uuids)
    if found["known_state"] is not None:
        if not is_live(found["known_state"]) or found["known_pod"] != event.pod_uid:
            raise ClaimAllocationEnded(
                f"allocation {event.allocation_id} of claim {event.namespace}/{event.claim_name} is "
                f"{found['known_state']}: the ledger does not bring an ended allocation back"
            )
        existing = await live_reservation(conn, event.pod_uid)
        assert existing is not None
        return existing
    if found["other"] is not None:
        raise ReservationError(
            f"claim {event.namespace}/{event.claim_name} holds allocation {found['other']} already; it must end first"
        )
    if found["allocator"] != "dra":
        raise PathConflict(
            f"node {event.node} is not a DRA node in the gpushare ledger "
            f"({'unknown' if found['allocator'] is None else 'its agent serves the device plugins'}): its GPUs are "
            "placed by the scheduler extender"
        )
    parts = list(event.parts)
    (written,) = await driver.fetch(
        conn,
        _RECORD_CLAIM_ALLOCATION,
        event.allocation_id,
        event.pod_uid,
        event.namespace,
        event.pod_name,
        event.owner_kind,
        event.owner_name,
        event.node,
        AllocationState.RESERVED.value,
        sum(m for m, _ in charges.values()),
        sum(c for _, c in charges.values()),
        event.occurred_at,
        event.pod_created_at,
        event.claim_uid,
        event.claim_name,
        uuids,
        [charges[u][0] for u in uuids],
        [charges[u][1] for u in uuids],
        *part_arrays(parts),
    )
    if written["id"] is None:
        held = await live_reservation(conn, event.pod_uid)
        raise ReservationError(
            f"pod {event.namespace}/{event.pod_name} holds allocation {held.allocation_id if held else '?'} "
            f"already; claim {event.claim_name} cannot add another"
        )
    short = sorted(set(uuids) - set(written["charged"]))
    if short:
        memory, compute = charges[short[0]]
        raise InsufficientCapacity(short[0], await explain_refusal(conn, event.node, short[0], memory, compute))
    if found["taken"] is not None:  # read after the GPUs were locked: an extender share that committed first
        who, _, gpu_uuid = str(found["taken"]).rpartition(" ")
        raise PathConflict(
            f"GPU {gpu_uuid} holds a share the scheduler extender placed (pod {who}); a GPU is served by one path: "
            "the DRA path takes none of it until those pods end"
        )
    return Reservation(event.allocation_id, event.pod_uid, event.node, AllocationState.RESERVED, tuple(parts), True)
