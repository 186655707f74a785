"""Read queries behind the REST API, the metrics and the dashboard (ledger tables + projections)."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from shared.ledger.models import LIVE_SQL, allocation_parts, allocations, gpus, nodes, quotas
from shared.ledger.rules import LIVE_STATE_VALUES, AllocationState

from .rightsizing import compute_advice, recommend
from .tables import pending, timeline

PENDING_STALE_AFTER = timedelta(hours=1)


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


# ---------------------------------------------------------------- GPUs and nodes


async def latest_gpu_usage(conn: AsyncConnection, *, node: str | None = None) -> dict[str, tuple[int, datetime]]:
    """Per GPU UUID (of one node's samples, when `node` is given): the memory used at its latest usage sample
    and when."""
    one = node is not None
    rows = await conn.execute(
        text(
            "WITH latest AS (SELECT gpu_uuid, max(ts) AS ts FROM usage_samples "
            f"{'WHERE node = :node ' if one else ''}GROUP BY gpu_uuid) "
            "SELECT u.gpu_uuid, sum(u.used_memory_mib) AS used, max(u.ts) AS ts "
            "FROM usage_samples u JOIN latest l ON u.gpu_uuid = l.gpu_uuid AND u.ts = l.ts "
            f"{'WHERE u.node = :node ' if one else ''}GROUP BY u.gpu_uuid"
        ),
        {"node": node} if one else {},
    )
    return {r.gpu_uuid: (int(r.used), r.ts) for r in rows}


def _gpu_dict(r: Any, used: dict[str, tuple[int, datetime]]) -> dict[str, Any]:
    u = used.get(r.uuid)
    return {
        "uuid": r.uuid,
        "index": r.index,
        "model": r.model,
        "memory_mib": r.memory_mib,
        "memory_total_mib": r.memory_total_mib,
        "allocated_memory_mib": r.allocated_memory_mib,
        "compute_units": r.compute_units,
        "allocated_compute": r.allocated_compute,
        "used_memory_mib": u[0] if u else None,
        "used_at": _iso(u[1]) if u else None,
        "healthy": r.healthy,
        "health_reason": r.health_reason,
    }


@dataclass
class NodeRows:
    """What the node listing is made of, read in one go: node rows, their GPU rows, the latest usage samples,
    the memory pending on GPUs gone from a node, and the live allocations per node. `dicts` builds the
    listing's dicts one node at a time, so a caller that streams them never holds the whole listing."""

    nodes: list[Any]
    gpus: dict[str, list[Any]]
    used: dict[str, tuple[int, datetime]]
    pending_mib: dict[str, int]
    live_counts: dict[str, int]

    def dicts(self) -> Iterator[dict[str, Any]]:
        """Each node as `/v1/nodes` lists it, with its GPUs."""
        for n in self.nodes:
            gpu_list = [_gpu_dict(g, self.used) for g in self.gpus.get(n.name, [])]
            labels = n.labels or {}
            yield {
                "name": n.name,
                "address": labels.get("address") or labels.get("internal_ip") or "",
                "driver_version": n.driver_version,
                "cuda_version": n.cuda_version,
                "retired": n.retired_at is not None,
                "gpu_count": len(gpu_list),
                "memory_mib": sum(g["memory_mib"] for g in gpu_list),
                "allocated_memory_mib": sum(g["allocated_memory_mib"] for g in gpu_list),
                "used_memory_mib": sum(g["used_memory_mib"] or 0 for g in gpu_list),
                "pending_memory_mib": self.pending_mib.get(n.name, 0),
                "live_allocations": int(self.live_counts.get(n.name, 0)),
                "gpus": gpu_list,
            }


async def node_rows(conn: AsyncConnection, *, include_retired: bool = False, name: str | None = None) -> NodeRows:
    """The rows behind the node listing: every node in service (also the retired ones with `include_retired`),
    or only the node called `name` (retired or not)."""
    query = select(nodes).order_by(nodes.c.name)
    gpu_query = select(gpus).where(gpus.c.retired_at.is_(None)).order_by(gpus.c.node, gpus.c.index)
    counts_query = select(allocations.c.node, func.count()).where(text(LIVE_SQL)).group_by(allocations.c.node)
    if name is not None:
        query = query.where(nodes.c.name == name)
        gpu_query = gpu_query.where(gpus.c.node == name)
        counts_query = counts_query.where(allocations.c.node == name)
    elif not include_retired:
        query = query.where(nodes.c.retired_at.is_(None))
    by_node: dict[str, list[Any]] = defaultdict(list)
    for g in await conn.execute(gpu_query):
        by_node[g.node].append(g)
    return NodeRows(
        nodes=(await conn.execute(query)).all(),
        gpus=by_node,
        used=await latest_gpu_usage(conn, node=name),
        pending_mib=await _pending_memory(conn, node=name),
        live_counts=dict((await conn.execute(counts_query)).all()),
    )


async def list_nodes(conn: AsyncConnection, *, include_retired: bool = False) -> list[dict[str, Any]]:
    """Every node with its GPUs and their allocated / used memory."""
    return list((await node_rows(conn, include_retired=include_retired)).dicts())


async def _pending_memory(conn: AsyncConnection, *, node: str | None = None) -> dict[str, int]:
    """Per node (or for `node` only): memory of live shares on GPUs the node no longer lists (gpushare's PENDING
    column)."""
    query = (
        select(allocations.c.node, func.sum(allocation_parts.c.memory_mib))
        .select_from(allocation_parts.join(allocations, allocation_parts.c.allocation_id == allocations.c.id))
        .outerjoin(gpus, and_(gpus.c.uuid == allocation_parts.c.gpu_uuid, gpus.c.retired_at.is_(None)))
        .where(allocations.c.state.in_(LIVE_STATE_VALUES), gpus.c.uuid.is_(None))
        .group_by(allocations.c.node)
    )
    if node is not None:
        query = query.where(allocations.c.node == node)
    return {r[0]: int(r[1]) for r in await conn.execute(query)}


async def node_detail(conn: AsyncConnection, name: str) -> dict[str, Any] | None:
    """One node, its GPUs and each GPU's live allocations (with this GPU's share of each)."""
    node = next((await node_rows(conn, name=name)).dicts(), None)
    if node is None:
        return None
    live = await _allocations_where(conn, and_(allocations.c.node == name, allocations.c.state.in_(LIVE_STATE_VALUES)))
    by_gpu: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in live:
        for p in a["parts"]:
            by_gpu[p["gpu_uuid"]].append({**_brief(a), "container": p["container"], "memory_mib": p["memory_mib"]})
    known = {g["uuid"] for g in node["gpus"]}
    for g in node["gpus"]:
        g["allocations"] = by_gpu.get(g["uuid"], [])
    node["pending_allocations"] = [x for u, items in by_gpu.items() if u not in known for x in items]
    node["allocations"] = live
    return node


def _brief(a: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] for k in ("id", "pod_uid", "namespace", "pod_name", "state", "terminating_at")}


def _gpus_in_service(*columns: Any) -> Select:
    """`columns` of every GPU in service on a node in service (what `list_nodes` lists)."""
    return (
        select(*columns)
        .join(nodes, nodes.c.name == gpus.c.node)
        .where(gpus.c.retired_at.is_(None), nodes.c.retired_at.is_(None))
    )


GpuGauge = tuple[str, int, str, str, int, int, int | None]
"""(node, index, UUID, model, memory MiB, allocated MiB, used MiB at the latest sample or None)."""


async def gpu_gauges(conn: AsyncConnection) -> tuple[list[str], list[GpuGauge]]:
    """The nodes in service (by name) and their GPUs in service (by node, index) as plain tuples: what the
    metrics collector exports and keeps between scrapes, without `list_nodes`' dict per GPU."""
    names = list(
        (await conn.execute(select(nodes.c.name).where(nodes.c.retired_at.is_(None)).order_by(nodes.c.name))).scalars()
    )
    used = await latest_gpu_usage(conn)
    query = _gpus_in_service(
        gpus.c.node, gpus.c.index, gpus.c.uuid, gpus.c.model, gpus.c.memory_mib, gpus.c.allocated_memory_mib
    ).order_by(gpus.c.node, gpus.c.index)
    rows = [
        (
            r.node,
            r.index,
            r.uuid,
            r.model,
            r.memory_mib,
            r.allocated_memory_mib,
            used[r.uuid][0] if r.uuid in used else None,
        )
        for r in await conn.execute(query)
    ]
    return names, rows


async def cluster_totals(conn: AsyncConnection, unit: str) -> dict[str, Any]:
    """Cluster-wide capacity, allocation, usage and counts: the sums of `list_nodes`, read without building it
    (on 5,000 nodes x 8 GPUs that listing is 45,000 dicts, and /v1/cluster is what dashboards poll)."""
    node_count = (
        await conn.execute(select(func.count()).select_from(nodes).where(nodes.c.retired_at.is_(None)))
    ).scalar_one()
    live_gpus = _gpus_in_service(gpus.c.uuid, gpus.c.memory_mib, gpus.c.allocated_memory_mib, gpus.c.healthy)
    used = await latest_gpu_usage(conn)
    gpu_count = unhealthy = total = allocated = used_total = 0
    for g in await conn.execute(live_gpus):
        gpu_count += 1
        unhealthy += 0 if g.healthy else 1
        total += g.memory_mib
        allocated += g.allocated_memory_mib
        u = used.get(g.uuid)
        used_total += u[0] if u else 0
    states = dict((await conn.execute(select(allocations.c.state, func.count()).group_by(allocations.c.state))).all())
    return {
        "nodes": int(node_count),
        "gpus": gpu_count,
        "unhealthy_gpus": unhealthy,
        "memory_mib": total,
        "allocated_memory_mib": allocated,
        "used_memory_mib": used_total,
        "allocated_pct": int(100 * allocated / total) if total else 0,
        "allocations_by_state": {s.value: int(states.get(s.value, 0)) for s in AllocationState},
        "pending_pods": len(await list_pending(conn)),
        "memory_unit": unit,
    }


# ---------------------------------------------------------------- allocations and pods


def _alloc_dict(r: Any, parts: list[Any]) -> dict[str, Any]:
    return {
        "id": str(r.id),
        "pod_uid": r.pod_uid,
        "namespace": r.namespace,
        "pod_name": r.pod_name,
        "owner_kind": r.owner_kind,
        "owner_name": r.owner_name,
        "node": r.node,
        "state": r.state,
        "memory_mib": r.memory_mib,
        "compute": r.compute,
        "reason": r.reason,
        "reserved_at": _iso(r.reserved_at),
        "bound_at": _iso(r.bound_at),
        "assigned_at": _iso(r.assigned_at),
        "ended_at": _iso(r.ended_at),
        "terminating_at": _iso(r.terminating_at),
        "parts": [
            {
                "container": p.container,
                "container_index": p.container_index,
                "init": p.init,
                "sidecar": p.sidecar,
                "gpu_uuid": p.gpu_uuid,
                "gpu_index": p.gpu_index,
                "memory_mib": p.memory_mib,
                "compute": p.compute,
                "assigned_at": _iso(p.assigned_at),
            }
            for p in sorted(parts, key=lambda p: (p.init, p.container_index, p.gpu_index))
        ],
    }


async def _with_parts(conn: AsyncConnection, rows: list[Any]) -> list[dict[str, Any]]:
    ids = [r.id for r in rows]
    parts: dict[uuid.UUID, list[Any]] = defaultdict(list)
    if ids:
        for p in (await conn.execute(select(allocation_parts).where(allocation_parts.c.allocation_id.in_(ids)))).all():
            parts[p.allocation_id].append(p)
    return [_alloc_dict(r, parts.get(r.id, [])) for r in rows]


async def _allocations_where(conn: AsyncConnection, where: Any) -> list[dict[str, Any]]:
    rows = (
        await conn.execute(select(allocations).where(where).order_by(allocations.c.reserved_at, allocations.c.id))
    ).all()
    return await _with_parts(conn, rows)


def true_clause() -> Any:
    """A condition that always holds (the neutral element of `and_`)."""
    return text("true")


@dataclass(frozen=True)
class AllocationFilter:
    """Filters of the allocation listing (all optional)."""

    namespace: str | None = None
    node: str | None = None
    state: str | None = None
    pod: str | None = None
    since: datetime | None = None
    until: datetime | None = None


async def list_allocations(
    conn: AsyncConnection, f: AllocationFilter, *, limit: int, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """A page of allocations (newest first) matching the filter, and how many match in all."""
    conds = []
    if f.namespace:
        conds.append(allocations.c.namespace == f.namespace)
    if f.node:
        conds.append(allocations.c.node == f.node)
    if f.state == "live":
        conds.append(allocations.c.state.in_(LIVE_STATE_VALUES))
    elif f.state:
        conds.append(allocations.c.state == f.state)
    if f.pod:
        conds.append(or_(allocations.c.pod_name == f.pod, allocations.c.pod_uid == f.pod))
    if f.until is not None:
        conds.append(allocations.c.reserved_at <= f.until)
    if f.since is not None:
        conds.append(or_(allocations.c.ended_at.is_(None), allocations.c.ended_at >= f.since))
    where = and_(true_clause(), *conds)
    total = (await conn.execute(select(func.count()).select_from(allocations).where(where))).scalar_one()
    rows = (
        await conn.execute(
            select(allocations)
            .where(where)
            .order_by(allocations.c.reserved_at.desc(), allocations.c.id)
            .limit(limit)
            .offset(offset)
        )
    ).all()
    return await _with_parts(conn, rows), int(total)


async def timeline_of(conn: AsyncConnection, allocation_ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    """Life-cycle steps of the given allocations, oldest first."""
    if not allocation_ids:
        return []
    rows = await conn.execute(
        select(timeline).where(timeline.c.allocation_id.in_(allocation_ids)).order_by(timeline.c.ts, timeline.c.id)
    )
    return [
        {"allocation_id": str(r.allocation_id), "step": r.step, "at": _iso(r.ts), "node": r.node, "detail": r.detail}
        for r in rows
    ]


def _pending_dict(r: Any, holders: list[dict[str, Any]]) -> dict[str, Any]:
    reasons = dict(r.reasons or {})
    return {
        "pod_uid": r.pod_uid,
        "namespace": r.namespace,
        "pod_name": r.pod_name,
        "summary": r.summary,
        "reasons": reasons,
        "refused_at": _iso(r.refused_at),
        "terminating_holders": [h for h in holders if h["node"] in reasons],
        "created_at": None,
        "waiting_seconds": None,
    }


async def terminating_holders(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Live allocations whose pod is being deleted: they hold their share until the pod is gone."""
    rows = (
        await conn.execute(
            select(
                allocations.c.namespace,
                allocations.c.pod_name,
                allocations.c.node,
                allocations.c.memory_mib,
                allocations.c.terminating_at,
            )
            .where(allocations.c.state.in_(LIVE_STATE_VALUES), allocations.c.terminating_at.is_not(None))
            .order_by(allocations.c.terminating_at)
        )
    ).all()
    return [
        {
            "namespace": r.namespace,
            "pod_name": r.pod_name,
            "node": r.node,
            "memory_mib": r.memory_mib,
            "terminating_since": _iso(r.terminating_at),
        }
        for r in rows
    ]


async def pod_view(conn: AsyncConnection, namespace: str, name: str) -> dict[str, Any] | None:
    """A pod's current (or latest) allocation, every allocation it had, their timeline, pending reasons."""
    allocs = await _allocations_where(conn, and_(allocations.c.namespace == namespace, allocations.c.pod_name == name))
    pend = (
        await conn.execute(
            select(pending)
            .where(pending.c.namespace == namespace, pending.c.pod_name == name)
            .order_by(pending.c.refused_at.desc())
            .limit(1)
        )
    ).first()
    if not allocs and pend is None:
        return None
    holders = await terminating_holders(conn) if pend is not None else []
    live = [a for a in allocs if a["state"] in LIVE_STATE_VALUES]
    current = live[-1] if live else (allocs[-1] if allocs else None)
    status = current["state"] if current and current["state"] in LIVE_STATE_VALUES else ("pending" if pend else None)
    if status is None and current is not None:
        status = current["state"]
    return {
        "namespace": namespace,
        "pod_name": name,
        "pod_uid": (current or {}).get("pod_uid") or (pend.pod_uid if pend else ""),
        "status": status,
        "allocation": current,
        "allocations": allocs,
        "timeline": await timeline_of(conn, [uuid.UUID(a["id"]) for a in allocs]),
        "pending": _pending_dict(pend, holders) if pend is not None and status == "pending" else None,
        "last_refusal": _pending_dict(pend, holders) if pend is not None else None,
        "usage": (await latest_pod_usage(conn, [current["pod_uid"]])).get(current["pod_uid"]) if current else None,
    }


async def live_pod_uids(conn: AsyncConnection, pod_uids: list[str]) -> set[str]:
    """Those of `pod_uids` that hold a live allocation (reserved, bound or assigned)."""
    rows = await conn.execute(
        select(allocations.c.pod_uid).where(
            allocations.c.pod_uid.in_(pod_uids), allocations.c.state.in_(LIVE_STATE_VALUES)
        )
    )
    return set(rows.scalars())


async def list_pending(
    conn: AsyncConnection, *, namespace: str | None = None, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Pods refused recently and not reserved since (latest reasons first)."""
    cutoff = (now or datetime.now(UTC)) - PENDING_STALE_AFTER
    query = select(pending).where(pending.c.refused_at >= cutoff).order_by(pending.c.refused_at.desc())
    if namespace:
        query = query.where(pending.c.namespace == namespace)
    live = select(allocations.c.pod_uid).where(allocations.c.state.in_(LIVE_STATE_VALUES))
    query = query.where(pending.c.pod_uid.not_in(live))
    rows = (await conn.execute(query)).all()
    holders = await terminating_holders(conn) if rows else []
    return [_pending_dict(r, holders) for r in rows]


# ---------------------------------------------------------------- usage and right-sizing


Owner = tuple[str, str]
"""(kind, name) of a workload."""
OwnerKey = tuple[str, str, str]
"""(namespace, owner kind, owner name) as an allocation records its pod's controller."""
Owners = Mapping[OwnerKey, Owner]
"""Recorded owners -> the workload to name instead (a ReplicaSet's Deployment)."""
OwnerLookup = Callable[[set[OwnerKey]], Awaitable[Owners]]
"""Resolves recorded owners (`owners.WorkloadNames.resolve`)."""


async def as_recorded(keys: set[OwnerKey]) -> Owners:
    """Workloads as the allocations recorded them (no lookup)."""
    return {}


def _workload(r: Any, owners: Owners | None = None) -> tuple[str, str, str]:
    kind, name = r.owner_kind or "Pod", r.owner_name or r.pod_name
    kind, name = (owners or {}).get((r.namespace, kind, name), (kind, name))
    return (r.namespace, kind, name)


def recorded_owners(rows: Iterable[Any]) -> set[OwnerKey]:
    """(namespace, owner kind, owner name) of allocation rows with an owner: what an `OwnerLookup` resolves."""
    return {(r.namespace, r.owner_kind, r.owner_name) for r in rows if r.owner_kind and r.owner_name}


async def latest_pod_usage(conn: AsyncConnection, pod_uids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per pod UID: its latest usage sample time, with memory and SM utilisation summed over its GPUs and per GPU
    (SM: percent of one GPU, summed over the GPUs that could say; null when none could)."""
    uids = sorted(set(pod_uids))
    if not uids:
        return {}
    rows = await conn.execute(
        text(
            "SELECT u.pod_uid, u.ts, u.gpu_uuid, u.container, u.used_memory_mib, u.sm_utilization_pct "
            "FROM usage_samples u JOIN (SELECT pod_uid, max(ts) AS ts FROM usage_samples "
            " WHERE pod_uid = ANY(:uids) GROUP BY pod_uid) l ON u.pod_uid = l.pod_uid AND u.ts = l.ts "
            "ORDER BY u.pod_uid, u.gpu_uuid"
        ),
        {"uids": uids},
    )
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        pod = out.setdefault(
            r.pod_uid, {"sampled_at": _iso(r.ts), "used_memory_mib": 0, "sm_utilization_pct": None, "gpus": []}
        )
        pod["used_memory_mib"] += r.used_memory_mib
        if r.sm_utilization_pct is not None:
            pod["sm_utilization_pct"] = round((pod["sm_utilization_pct"] or 0.0) + r.sm_utilization_pct, 1)
        pod["gpus"].append(
            {
                "gpu_uuid": r.gpu_uuid,
                "container": r.container,
                "used_memory_mib": r.used_memory_mib,
                "sm_utilization_pct": None if r.sm_utilization_pct is None else round(r.sm_utilization_pct, 1),
            }
        )
    return out


async def live_pod_usage(
    conn: AsyncConnection, *, namespace: str | None = None, owners: OwnerLookup = as_recorded
) -> list[dict[str, Any]]:
    """Every live allocation's pod with its workload, what it holds and what its latest usage sample says."""
    query = select(allocations).where(allocations.c.state.in_(LIVE_STATE_VALUES))
    if namespace:
        query = query.where(allocations.c.namespace == namespace)
    rows = (await conn.execute(query.order_by(allocations.c.namespace, allocations.c.pod_name))).all()
    latest = await latest_pod_usage(conn, (r.pod_uid for r in rows))
    names = await owners(recorded_owners(rows))
    out = []
    for r in rows:
        u = latest.get(r.pod_uid)
        _, kind, name = _workload(r, names)
        out.append(
            {
                "namespace": r.namespace,
                "pod_name": r.pod_name,
                "pod_uid": r.pod_uid,
                "node": r.node,
                "owner_kind": kind,
                "owner_name": name,
                "allocated_memory_mib": r.memory_mib,
                "allocated_compute": r.compute,
                "used_memory_mib": u["used_memory_mib"] if u else None,
                "sm_utilization_pct": u["sm_utilization_pct"] if u else None,
                "sampled_at": u["sampled_at"] if u else None,
            }
        )
    return out


async def _usage_per_pod(conn: AsyncConnection, since: datetime, until: datetime) -> dict[str, Any]:
    """Per pod in the window: mean / peak / p95 of its memory summed over its GPUs at each sample time, and
    mean / peak of its SM utilisation likewise (percent of one GPU; null when never measured)."""
    rows = await conn.execute(
        text(
            "SELECT pod_uid, avg(used) AS mean, max(used) AS peak, "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY used) AS p95, count(*) AS n, "
            "avg(sm) AS sm_mean, max(sm) AS sm_peak FROM ("
            " SELECT pod_uid, ts, sum(used_memory_mib) AS used, sum(sm_utilization_pct) AS sm FROM usage_samples"
            " WHERE ts >= :since AND ts <= :until AND pod_uid <> '' GROUP BY pod_uid, ts) per_ts "
            "GROUP BY pod_uid"
        ),
        {"since": since, "until": until},
    )
    return {r.pod_uid: r for r in rows}


def significant(value: float, digits: int = 6) -> float:
    """`value` to `digits` significant digits: short windows keep their small amounts (rounding GiB-hours to
    decimal places turned a pod sampled for a fraction of a second into 0)."""
    return float(f"{value:.{digits}g}")


async def usage(
    conn: AsyncConnection,
    *,
    since: datetime,
    until: datetime,
    by: str,
    namespace: str | None = None,
    owners: OwnerLookup = as_recorded,
) -> list[dict[str, Any]]:
    """GPU-memory-hours allocated vs used per namespace (`by="namespace"`) or workload (`by="workload"`).

    Allocated: each allocation's memory times the hours it was held inside the range. Used: the pod's
    mean sampled usage times those same hours (pods never sampled count as using nothing). A workload is named by
    `owners` where it names one (a ReplicaSet's Deployment).
    """
    rows = await allocations_in(conn, since=since, until=until, namespace=namespace)
    names = await owners(recorded_owners(rows)) if by != "namespace" else {}
    per_pod = await _usage_per_pod(conn, since, until)
    now = datetime.now(UTC)
    acc: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in rows:
        start = max(r.reserved_at, since)
        end = min(r.ended_at or now, until)
        hours = max((end - start).total_seconds(), 0.0) / 3600
        key: tuple[str, ...] = (r.namespace,) if by == "namespace" else _workload(r, names)
        entry = acc.setdefault(key, {"alloc": 0.0, "used": 0.0, "pods": set(), "sampled": set()})
        entry["alloc"] += r.memory_mib * hours
        sample = per_pod.get(r.pod_uid)
        if sample is not None:
            entry["used"] += float(sample.mean) * hours
            entry["sampled"].add(r.pod_uid)
        entry["pods"].add(r.pod_uid)
    out = []
    for key, e in sorted(acc.items(), key=lambda kv: (-kv[1]["alloc"], kv[0])):
        item: dict[str, Any] = {"namespace": key[0]}
        if by != "namespace":
            item.update(owner_kind=key[1], owner_name=key[2])
        item.update(
            allocated_gib_hours=significant(e["alloc"] / 1024),
            used_gib_hours=significant(e["used"] / 1024),
            efficiency_pct=int(100 * e["used"] / e["alloc"]) if e["alloc"] else None,
            pods=len(e["pods"]),
            pods_with_samples=len(e["sampled"]),
        )
        out.append(item)
    return out


async def allocations_in(
    conn: AsyncConnection, *, since: datetime, until: datetime, namespace: str | None = None
) -> list[Any]:
    """Allocation rows held at some time in [since, until] (of one namespace), oldest reservation first."""
    conds = [allocations.c.reserved_at <= until, or_(allocations.c.ended_at.is_(None), allocations.c.ended_at >= since)]
    if namespace:
        conds.append(allocations.c.namespace == namespace)
    return list((await conn.execute(select(allocations).where(and_(*conds)).order_by(allocations.c.reserved_at))).all())


async def rightsizing(
    conn: AsyncConnection,
    *,
    since: datetime,
    until: datetime,
    step_mib: int,
    headroom: float,
    namespace: str | None = None,
    owners: OwnerLookup = as_recorded,
) -> list[dict[str, Any]]:
    """Per workload with usage samples: allocated vs peak / p95 used, a recommendation and its gain, and its SM
    utilisation with what it says (an idle compute share is advice too). Workloads are named by `owners` where
    it names one (a ReplicaSet's Deployment)."""
    rows = await allocations_in(conn, since=since, until=until, namespace=namespace)
    names = await owners(recorded_owners(rows))
    per_pod = await _usage_per_pod(conn, since, until)
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(
            _workload(r, names),
            {"allocated": 0, "compute": 0, "peak": 0, "p95": 0.0, "pods": set(), "samples": 0, "sm": []},
        )
        g["allocated"] = r.memory_mib  # the newest allocation's size is what the workload requests now
        g["compute"] = r.compute
        s = per_pod.get(r.pod_uid)
        if s is not None and r.pod_uid not in g["pods"]:
            g["peak"] = max(g["peak"], int(s.peak))
            g["p95"] = max(g["p95"], float(s.p95))
            g["samples"] += int(s.n)
            g["pods"].add(r.pod_uid)
            if s.sm_peak is not None:
                g["sm"].append((float(s.sm_mean), float(s.sm_peak)))
    out = []
    for (ns, kind, name), g in sorted(groups.items()):
        if not g["pods"] or g["allocated"] <= 0:
            continue
        rec = recommend(g["allocated"], g["peak"], round(g["p95"]), step_mib=step_mib, headroom=headroom)
        sm_mean = sum(m for m, _ in g["sm"]) / len(g["sm"]) if g["sm"] else None
        sm_peak = max(p for _, p in g["sm"]) if g["sm"] else None
        compute = compute_advice(sm_peak, g["compute"], headroom=headroom)
        out.append(
            {
                "namespace": ns,
                "owner_kind": kind,
                "owner_name": name,
                "allocated_mib": rec.allocated_mib,
                "peak_used_mib": rec.peak_mib,
                "p95_used_mib": rec.p95_mib,
                "recommended_mib": rec.recommended_mib,
                "density_gain_pct": rec.density_gain_pct,
                "allocated_compute": g["compute"],
                "sm_mean_pct": None if sm_mean is None else round(sm_mean, 1),
                "sm_peak_pct": None if sm_peak is None else round(sm_peak, 1),
                "compute_idle": compute.idle,
                "recommended_compute": compute.recommended_compute,
                "pods_sampled": len(g["pods"]),
                "samples": g["samples"],
                "summary": f"{rec.text}; {compute.text}" if compute.text else rec.text,
            }
        )
    out.sort(key=lambda x: (-x["density_gain_pct"], x["namespace"], x["owner_name"]))
    return out


# ---------------------------------------------------------------- quotas and metrics inputs


def _quota_dict(r: Any) -> dict[str, Any]:
    return {
        "namespace": r.namespace,
        "memory_mib": r.memory_mib,
        "compute": r.compute,
        "updated_at": _iso(r.updated_at),
    }


async def list_quotas(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Every namespace quota, with what the namespace holds now."""
    held = await namespace_allocated(conn)
    return [
        {**_quota_dict(r), "allocated_memory_mib": held.get(r.namespace, (0, 0))[0]}
        for r in (await conn.execute(select(quotas).order_by(quotas.c.namespace))).all()
    ]


async def get_quota(conn: AsyncConnection, namespace: str) -> dict[str, Any] | None:
    """One namespace's quota, or None."""
    r = (await conn.execute(select(quotas).where(quotas.c.namespace == namespace))).first()
    if r is None:
        return None
    held = await namespace_allocated(conn)
    return {**_quota_dict(r), "allocated_memory_mib": held.get(namespace, (0, 0))[0]}


async def namespace_allocated(conn: AsyncConnection) -> dict[str, tuple[int, int]]:
    """Per namespace: memory and compute its live allocations hold."""
    rows = await conn.execute(
        select(allocations.c.namespace, func.sum(allocations.c.memory_mib), func.sum(allocations.c.compute))
        .where(allocations.c.state.in_(LIVE_STATE_VALUES))
        .group_by(allocations.c.namespace)
    )
    return {r[0]: (int(r[1] or 0), int(r[2] or 0)) for r in rows}


PodRatio = tuple[str, str, str, str, float]
"""(namespace, pod, workload kind, workload name, used / allocated GPU memory)."""


async def pod_usage_ratios(conn: AsyncConnection, *, owners: OwnerLookup = as_recorded) -> list[PodRatio]:
    """Each live pod's used / allocated memory at its latest usage sample, with its workload (named by `owners`)."""
    rows = (
        await conn.execute(
            text(
                "WITH latest AS (SELECT pod_uid, max(ts) AS ts FROM usage_samples WHERE pod_uid <> '' "
                " GROUP BY pod_uid), "
                "used AS (SELECT u.pod_uid, sum(u.used_memory_mib) AS used FROM usage_samples u "
                " JOIN latest l ON u.pod_uid = l.pod_uid AND u.ts = l.ts GROUP BY u.pod_uid) "
                "SELECT a.namespace, a.pod_name, a.owner_kind, a.owner_name, a.memory_mib, used.used "
                f"FROM allocations a JOIN used ON used.pod_uid = a.pod_uid WHERE a.{LIVE_SQL} AND a.memory_mib > 0"
            )
        )
    ).all()
    names = await owners(recorded_owners(rows))
    return [(*_workload_of(r, names), float(r.used) / r.memory_mib) for r in rows]


def _workload_of(r: Any, names: Owners) -> tuple[str, str, str, str]:
    namespace, kind, name = _workload(r, names)
    return namespace, r.pod_name, kind, name
