"""Why GPU pods wait: the extender's latest refusal of each pod (`acc_pending`, from its `refused` events) merged with
kube-scheduler's own verdict on it (the pod's `PodScheduled` condition, from accounting's pod watch,
`scheduling.SchedulingWaits`).

kube-scheduler counts every `aliyun.com/*` resource per node itself (the shipped configuration): its
NodeResourcesFit filter refuses a node short of one in total (`Insufficient aliyun.com/gpu-mem`) before the
extender is asked, so no refusal of the extender names that node, and a pod every node refuses so is never sent to
the extender at all. Such a pod is listed all the same, with kube-scheduler's message as its summary (`source:
kube-scheduler`) and no reasons per node; a pod the extender refused carries kube-scheduler's verdict beside the
extender's reasons (`scheduler`). Terminating holders are those on the nodes the reasons name and, when
kube-scheduler found nodes short of a GPU resource in total (its message does not say which), all of them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from . import queries
from .scheduling import SchedulingWaits, Waiting

EXTENDER = "extender"
KUBE_SCHEDULER = "kube-scheduler"


def _holders(item: dict[str, Any], waiting: Waiting | None, holders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if waiting is not None and waiting.verdict is not None and waiting.verdict.short_of_gpu:
        return list(holders)
    return [h for h in holders if h["node"] in item["reasons"]]


def source_of(summary: str) -> str:
    """Who refused, from a recorded refusal's summary: kube-scheduler when it is its message, else the extender."""
    return KUBE_SCHEDULER if summary.startswith(KUBE_SCHEDULER) else EXTENDER


def annotate(
    item: dict[str, Any], uid: str, waiting: Waiting | None, holders: list[dict[str, Any]], now: datetime
) -> dict[str, Any]:
    """A recorded refusal with the pod's creation time, its wait so far and kube-scheduler's verdict, where the pod
    watch knows them (pure). Its source is kube-scheduler when the summary is kube-scheduler's message (the binder
    records DRA pods' so, `kube-scheduler (DRA): ...`), else the extender."""
    item["source"] = source_of(item["summary"])
    item["scheduler"] = waiting.verdict.as_dict() if waiting is not None and waiting.verdict is not None else None
    item["terminating_holders"] = _holders(item, waiting, holders)
    if waiting is not None:
        item["created_at"] = waiting.created_at.isoformat()
        item["waiting_seconds"] = int(max((now - waiting.created_at).total_seconds(), 0.0))
    return item


def from_scheduler(uid: str, waiting: Waiting, holders: list[dict[str, Any]], now: datetime) -> dict[str, Any]:
    """A pod kube-scheduler refused that the extender never did (pure): its message is the summary."""
    verdict = waiting.verdict
    assert verdict is not None
    item: dict[str, Any] = {
        "pod_uid": uid,
        "namespace": waiting.namespace,
        "pod_name": waiting.pod_name,
        "summary": f"kube-scheduler: {verdict.message}",
        "reasons": {},
        "refused_at": (verdict.since or waiting.created_at).isoformat(),
    }
    annotate(item, uid, waiting, holders, now)
    item["source"] = KUBE_SCHEDULER
    return item


def _clock(scheduling: SchedulingWaits | None) -> datetime:
    """Now, as the pod watch tells time (waits are measured on its clock)."""
    return scheduling.clock() if scheduling is not None else datetime.now(UTC)


def _refused_at(item: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(item["refused_at"])


async def pending_items(
    conn: AsyncConnection,
    scheduling: SchedulingWaits | None,
    *,
    namespace: str | None = None,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """GPU pods waiting for a node and why, the latest refusal first (`GET /v1/pending`); `now` dates the extender's
    refusals (those older than `queries.PENDING_STALE_AFTER` are left out)."""
    items = await queries.list_pending(conn, namespace=namespace, now=now)
    now = _clock(scheduling)
    refused = scheduling.refused(namespace) if scheduling is not None else {}
    pending = scheduling.pending if scheduling is not None else {}
    listed = {p["pod_uid"] for p in items}
    others = {uid: w for uid, w in refused.items() if uid not in listed}
    live = await queries.live_pod_uids(conn, list(others)) if others else set()
    holders = await queries.terminating_holders(conn) if items or others else []
    out = [annotate(p, p["pod_uid"], pending.get(p["pod_uid"]), holders, now) for p in items]
    out += [from_scheduler(uid, w, holders, now) for uid, w in others.items() if uid not in live]
    out.sort(key=_refused_at, reverse=True)
    return out


async def pod_view(
    conn: AsyncConnection, scheduling: SchedulingWaits | None, namespace: str, name: str
) -> dict[str, Any] | None:
    """A pod's allocations, timeline and, while it waits, why (`GET /v1/pods/{namespace}/{name}`); None when
    neither the ledger nor the pod watch knows it."""
    view = await queries.pod_view(conn, namespace, name)
    now = _clock(scheduling)
    pending = scheduling.pending if scheduling is not None else {}
    if view is not None and view["last_refusal"] is not None:
        view["last_refusal"]["source"] = source_of(view["last_refusal"]["summary"])
    if view is not None and view["pending"] is not None:  # a recorded refusal (the extender's, or a DRA pod's)
        uid = view["pending"]["pod_uid"]
        annotate(view["pending"], uid, pending.get(uid), await queries.terminating_holders(conn), now)
        return view
    refused = scheduling.refused(namespace) if scheduling is not None else {}
    found = next(((uid, w) for uid, w in refused.items() if w.pod_name == name), None)
    if found is None or found[0] in await queries.live_pod_uids(conn, [found[0]]):
        return view
    uid, waiting = found
    item = from_scheduler(uid, waiting, await queries.terminating_holders(conn), now)
    if view is None:
        view = {"namespace": namespace, "pod_name": name, "allocation": None, "allocations": [], "timeline": []}
        view.update(usage=None, last_refusal=None)
    view.update(pod_uid=uid, status="pending", pending=item, last_refusal=view["last_refusal"] or item)
    return view
