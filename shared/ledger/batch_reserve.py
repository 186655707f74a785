"""Reserving for many pods in one transaction, with a constant number of statements per batch.

The fast path of group commit (`Ledger.reserve_many`). It handles the regular case, in which every pod is new,
no namespace in the batch has a GPU quota, and every GPU has room for the sum of what the batch puts on it:

1. one SELECT ... FOR UPDATE of the GPUs concerned, in UUID order;
2. one INSERT of every allocation, in pod UID order (`unnest` of arrays; the partial unique index on live
   allocations per pod);
3. one conditional UPDATE that raises each GPU's counters by the batch's sum, only where it fits;
4. one INSERT of every allocation part.

GPUs before allocations, each in its order: the ledger's one lock order (`locks`), which every other writer
follows too. Anything else raises `Irregular` before the caller commits; the caller rolls back and reserves the
batch one pod at a time (`reservations.reserve` under a savepoint each, after `locks.lock_for_reservations`),
which names the conflict and fails only the pods it concerns. The CHECK constraints on `gpus` back both paths:
no code path can commit an overcommitted GPU. The statements go to asyncpg directly (`driver`): they run for
every batch of binds.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncConnection

from shared.events.catalogue import ReservedEvent
from shared.ledger import driver, locks
from shared.ledger.models import LIVE_SQL, part_arrays
from shared.ledger.reservations import Reservation
from shared.ledger.rules import AllocationState, gpu_charges


class Irregular(Exception):
    """The batch needs the one-by-one path (an existing reservation, a quota, a GPU without room, ...)."""


_QUOTAS = (
    "SELECT namespace FROM quotas WHERE namespace = ANY($1::text[]) "
    "AND (memory_mib IS NOT NULL OR compute IS NOT NULL) LIMIT 1"
)
_INSERT_ALLOCATIONS = (
    "INSERT INTO allocations (id, pod_uid, namespace, pod_name, owner_kind, owner_name, node, state, memory_mib,"
    " compute, reserved_at, pod_created_at) "
    "SELECT u.id, u.pod_uid, u.namespace, u.pod_name, u.owner_kind, u.owner_name, u.node, $1, u.memory_mib,"
    " u.compute, u.reserved_at, u.pod_created_at "
    "FROM unnest($2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],"
    " $9::integer[], $10::integer[], $11::timestamptz[], $12::timestamptz[]) "
    "AS u(id, pod_uid, namespace, pod_name, owner_kind, owner_name, node, memory_mib, compute, reserved_at,"
    " pod_created_at) "
    f"ON CONFLICT (pod_uid) WHERE {LIVE_SQL} DO NOTHING RETURNING id"
)
_CHARGE_GPUS = (
    "UPDATE gpus AS g SET allocated_memory_mib = g.allocated_memory_mib + w.memory,"
    " allocated_compute = g.allocated_compute + w.compute, updated_at = $1 "
    "FROM unnest($2::text[], $3::text[], $4::integer[], $5::integer[]) AS w(uuid, node, memory, compute) "
    "WHERE g.uuid = w.uuid AND g.node = w.node AND g.healthy AND g.retired_at IS NULL"
    " AND g.allocated_memory_mib + w.memory <= g.memory_mib AND g.allocated_compute + w.compute <= g.compute_units "
    "RETURNING g.uuid"
)
_INSERT_PARTS = (
    "INSERT INTO allocation_parts (allocation_id, container, container_index, init, sidecar, gpu_uuid, gpu_index,"
    " memory_mib, compute) "
    "SELECT * FROM unnest($1::uuid[], $2::text[], $3::integer[], $4::boolean[], $5::boolean[], $6::text[],"
    " $7::integer[], $8::integer[], $9::integer[])"
)


def batch_charges(
    events: list[ReservedEvent], per_pod: list[dict[str, tuple[int, int]]]
) -> dict[str, tuple[str, int, int]]:
    """What the batch adds to each GPU: {uuid: (node, memory MiB, compute)}; `Irregular` when a pod appears
    twice or a GPU is named on two nodes (the one-by-one path then explains it)."""
    if len({e.pod_uid for e in events}) != len(events):
        raise Irregular("a pod appears twice in the batch")
    out: dict[str, tuple[str, int, int]] = {}
    for event, charges in zip(events, per_pod, strict=True):
        for gpu_uuid, (memory, compute) in charges.items():
            node, m, c = out.get(gpu_uuid, (event.node, 0, 0))
            if node != event.node:
                raise Irregular(f"GPU {gpu_uuid} named on nodes {node} and {event.node}")
            out[gpu_uuid] = (node, m + memory, c + compute)
    return out


async def reserve_fast(conn: AsyncConnection, events: list[ReservedEvent]) -> list[Reservation]:
    """Reserve every event's shares inside the caller's transaction, or raise `Irregular` (the caller must then
    roll back: statements may have run)."""
    per_pod = [gpu_charges(e.parts) for e in events]  # {GPU: (memory, compute)} of each pod
    charges = batch_charges(events, per_pod)
    namespaces = sorted({e.namespace for e in events})
    if await driver.fetch(conn, _QUOTAS, namespaces):
        raise Irregular("a namespace in the batch has a GPU quota")
    uuids = sorted(charges)
    await locks.lock_gpus(conn, uuids)  # GPUs before allocations (`locks`)
    order = locks.by_pod(events)
    pods = [events[i] for i in order]
    inserted = await driver.fetch(
        conn,
        _INSERT_ALLOCATIONS,
        AllocationState.RESERVED.value,
        [e.allocation_id for e in pods],
        [e.pod_uid for e in pods],
        [e.namespace for e in pods],
        [e.pod_name for e in pods],
        [e.owner_kind for e in pods],
        [e.owner_name for e in pods],
        [e.node for e in pods],
        [sum(m for m, _ in per_pod[i].values()) for i in order],
        [sum(x for _, x in per_pod[i].values()) for i in order],
        [e.occurred_at for e in pods],
        [e.pod_created_at for e in pods],
    )
    if len(inserted) != len(events):
        raise Irregular("a pod in the batch already holds a live reservation")
    if uuids:
        charged = await driver.fetch(
            conn,
            _CHARGE_GPUS,
            max(e.occurred_at for e in events),
            uuids,
            [charges[u][0] for u in uuids],
            [charges[u][1] for u in uuids],
            [charges[u][2] for u in uuids],
        )
        if len(charged) != len(uuids):
            raise Irregular("a GPU has no room for what the batch puts on it")
    parts = [(e.allocation_id, p) for e in events for p in e.parts]
    if parts:
        await driver.fetch(
            conn,
            _INSERT_PARTS,
            [a for a, _ in parts],
            *part_arrays([p for _, p in parts]),
        )
    return [
        Reservation(e.allocation_id, e.pod_uid, e.node, AllocationState.RESERVED, tuple(e.parts), created=True)
        for e in events
    ]
