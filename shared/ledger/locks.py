"""The ledger's one lock order. Every writer that holds more than one lock takes them tier by tier, in this order,
and within a tier in the tier's order, so no two writers can wait on each other in a cycle (which PostgreSQL
would break by aborting one of them: a deadlock).

1. claims of event ids (`idempotency.claim`, the first statement of `Ledger.record_once`);
2. namespaces' quota locks (advisory, `quotas.lock_quota`), by namespace name;
3. node rows (inventory and retirement), one node per transaction;
4. GPU rows, by UUID;
5. allocation rows: existing ones by id; a new one by pod UID (its INSERT takes the pod's entry in the unique
   index of live allocations, and waits for any transaction that holds the same pod's entry or is changing the
   pod's live row).

A writer may skip tiers, never come back to an earlier one: GPUs come before allocations everywhere.

Who takes what:
- `batch_reserve.reserve_fast` (group commit's regular batch): GPUs, then the allocations it inserts, by pod UID;
- the one-by-one fallback (`Ledger.reserve_many`) and a single reservation (`apply_event`):
  `lock_for_reservations` (quotas, GPUs), then each pod's allocation, in arrival order;
- a release or failure (`transitions.apply_transition`): `lock_gpus_of` the allocation, then its row;
- an exchange (`transitions.apply_exchange`): `lock_gpus_of` both allocations, then their rows by id;
- bound, assigned, terminating: allocation rows only (bound: by id);
- inventory and node retirement: the node's row, then its GPUs by UUID;
- a quota change: the namespace's quota lock only.

One exception, within tier 5: the fallback inserts its pods' allocations in arrival order, not pod UID order (the
pod kube-scheduler placed first keeps the room a batch runs short of; a higher-priority pod is placed first). A
cycle there needs two reserving transactions that each insert two pods the other one inserts too, in opposite
orders, on disjoint GPUs (they both hold their GPU locks): the same two pods bound at the same moment on two
nodes, by two extender replicas. PostgreSQL then aborts one, and its caller's retry (`db.retry_transient`)
reserves again. Every other pair of writers waits in one direction only.

A release or exchange must lock GPUs before it can lock the allocation that says which GPUs it holds, and an
exchange that commits meanwhile may move the allocation's parts to other GPUs of its node. So `lock_gpus_of` locks
every GPU of the allocations' nodes (and of their parts, wherever those are): a set no exchange can leave.
`tests/foundation/test_lock_order.py` races every writer above and counts PostgreSQL's deadlock reports.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import ReservedEvent
from shared.ledger import driver
from shared.ledger.quotas import lock_quota
from shared.ledger.rules import LIVE_STATE_VALUES

_LOCK_GPUS = "SELECT uuid FROM gpus WHERE uuid = ANY($1::text[]) ORDER BY uuid FOR UPDATE"
_LIVE = ", ".join(f"'{s}'" for s in LIVE_STATE_VALUES)
# every GPU of the live allocations' nodes, and every GPU their parts name (an exchange moves parts only within
# a node, so this set holds whatever exchange commits while we wait); nothing when none of them is live
_LOCK_GPUS_OF = (
    "SELECT g.uuid FROM gpus AS g WHERE g.node IN ("
    f"SELECT a.node FROM allocations AS a WHERE a.id = ANY($1::uuid[]) AND a.state IN ({_LIVE})"
    ") OR g.uuid IN ("
    "SELECT p.gpu_uuid FROM allocation_parts AS p JOIN allocations AS a ON a.id = p.allocation_id"
    f" WHERE a.id = ANY($1::uuid[]) AND a.state IN ({_LIVE})"
    ") ORDER BY g.uuid FOR UPDATE OF g"
)


async def lock_gpus(conn: AsyncConnection, uuids: Iterable[str]) -> None:
    """Lock GPU rows (tier 4), in UUID order."""
    ordered = sorted(set(uuids))
    if ordered:
        await driver.fetch(conn, _LOCK_GPUS, ordered)


async def lock_gpus_of(conn: AsyncConnection, allocation_ids: Iterable[uuid.UUID]) -> set[str]:
    """Before locking live allocations' rows: lock, in UUID order, every GPU their nodes have and their parts
    name. Returns the UUIDs locked (none when no allocation is live: ending one again changes no GPU)."""
    rows = await driver.fetch(conn, _LOCK_GPUS_OF, sorted(set(allocation_ids), key=str))
    return {r["uuid"] for r in rows}


async def lock_for_reservations(conn: AsyncConnection, events: list[ReservedEvent]) -> None:
    """Before reserving pod after pod: take every quota lock (tier 2, by namespace) and every GPU lock (tier 4,
    by UUID) the reservations will need, up front. Reserving pod after pod would take them in the pods' order."""
    for namespace in sorted({e.namespace for e in events}):
        await lock_quota(conn, namespace)
    await lock_gpus(conn, (p.gpu_uuid for e in events for p in e.parts))


def by_pod(events: list[ReservedEvent]) -> list[int]:
    """The positions of `events` in pod UID order: the order the fast path inserts their allocations (tier 5)."""
    return sorted(range(len(events)), key=lambda i: events[i].pod_uid)
