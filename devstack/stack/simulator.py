"""A kube-scheduler stand-in for machines without a control plane.

It calls the extender exactly as kube-scheduler 1.20 does with `nodeCacheCapable: true`: `POST <prefix>/filter`
with PascalCase `ExtenderArgs` (`Pod`, `Nodes: null`, `NodeNames`), `POST <prefix>/prioritize` with the same
body when more than one node survives (kube-scheduler never prioritizes a single node), then
`POST <prefix>/bind` with `ExtenderBindingArgs`. Since there is no apiserver to create a Binding in, it also
plays the binder's part: once the extender has reserved the pod's GPUs, it marks the allocation bound in the
ledger (through `Ledger`, so the event reaches the stream), which is what the extender's bind waits for.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import select

from shared.ledger import models
from shared.ledger.ledger import Ledger
from shared.ledger.rules import AllocationState

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- pure: wire bodies
def filter_args(pod: dict[str, Any], node_names: Sequence[str]) -> dict[str, Any]:
    """`ExtenderArgs` as kube-scheduler sends it in NodeNames mode."""
    return {"Pod": pod, "Nodes": None, "NodeNames": list(node_names)}


def bind_args(pod: dict[str, Any], node: str) -> dict[str, Any]:
    """`ExtenderBindingArgs`."""
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}


def filter_result(reply: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    """Surviving node names, failed nodes with reasons, and the error of an `ExtenderFilterResult`."""
    names = reply.get("NodeNames") or []
    failed = dict(reply.get("FailedNodes") or {})
    failed.update(reply.get("FailedAndUnresolvableNodes") or {})
    return list(names), failed, str(reply.get("Error") or "")


def pick_host(candidates: Sequence[str], priorities: Sequence[dict[str, Any]], weight: int = 1) -> str:
    """The node with the highest extender score (ties: the first candidate, so runs are reproducible)."""
    scores = {str(p.get("Host")): int(p.get("Score", 0)) * weight for p in priorities}
    return max(candidates, key=lambda n: (scores.get(n, 0), -candidates.index(n)))


def pod_manifest(
    name: str,
    namespace: str,
    gpu_mem: Sequence[int],
    *,
    uid: str | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    owner: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A pending Pod as the apiserver would serialise it, one container per `gpu_mem` entry."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid or str(uuid.uuid4()),
        "labels": labels or {},
        "annotations": annotations or {},
    }
    if owner:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "uid": str(uuid.uuid4())}
        ]
    containers = [
        {
            "name": f"c{i}" if len(gpu_mem) > 1 else name.split("-")[0],
            "image": "demo",
            "resources": {"limits": {"aliyun.com/gpu-mem": str(m)}},
        }
        for i, m in enumerate(gpu_mem)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"schedulerName": "default-scheduler", "containers": containers},
        "status": {"phase": "Pending"},
    }


def pods_of_deployments(deployments: Sequence[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The pods a ReplicaSet controller would create for these Deployments."""
    pods: list[dict[str, Any]] = []
    for dep in deployments:
        name = dep["metadata"]["name"]
        tmpl = dep["spec"]["template"]
        mems = [int(c["resources"]["limits"]["aliyun.com/gpu-mem"]) for c in tmpl["spec"]["containers"]]
        for i in range(int(dep["spec"]["replicas"])):
            pods.append(
                pod_manifest(
                    f"{name}-{uuid.uuid4().hex[:5]}{i}",
                    namespace,
                    mems,
                    labels=dict(tmpl["metadata"].get("labels") or {}),
                    annotations=dict(tmpl["metadata"].get("annotations") or {}),
                    owner=("ReplicaSet", f"{name}-sim"),
                )
            )
    return pods


# ----------------------------------------------------------------------------- the async shell
@dataclass
class Placement:
    """What happened to one pod."""

    namespace: str
    name: str
    uid: str
    node: str | None
    reasons: dict[str, str] = field(default_factory=dict)
    error: str = ""


class SchedulerSimulator:
    """Schedules pods one at a time through the extender, in queue order."""

    def __init__(
        self,
        extender_url: str,
        node_names: Sequence[str],
        *,
        ledger: Ledger | None = None,
        weight: int = 1,
        http_timeout: float = 30.0,
    ) -> None:
        self.extender_url = extender_url.rstrip("/")
        self.node_names = list(node_names)
        self.ledger = ledger
        self.weight = weight
        self.http = httpx.AsyncClient(timeout=http_timeout)

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.http.aclose()

    async def _post(self, verb: str, body: Any) -> Any:
        resp = await self.http.post(f"{self.extender_url}/{verb}", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"extender {verb} answered {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    async def schedule(self, pod: dict[str, Any]) -> Placement:
        """One scheduling cycle: filter, prioritize (when more than one node fits), bind."""
        meta = pod["metadata"]
        placement = Placement(meta["namespace"], meta["name"], meta["uid"], None)
        names, failed, error = filter_result(await self._post("filter", filter_args(pod, self.node_names)))
        placement.reasons = failed
        if error or not names:
            placement.error = error or "no node fits"
            return placement
        node = names[0]
        if len(names) > 1:
            priorities = await self._post("prioritize", filter_args(pod, names))
            node = pick_host(names, priorities or [], self.weight)
        bind = asyncio.create_task(self._post("bind", bind_args(pod, node)))
        binder = asyncio.create_task(self._play_binder(meta["uid"], node, bind))
        try:
            reply = await bind
        finally:
            binder.cancel()
            await asyncio.gather(binder, return_exceptions=True)
        if reply and reply.get("Error"):
            placement.error = str(reply["Error"])
            return placement
        placement.node = node
        return placement

    async def _play_binder(self, pod_uid: str, node: str, bind: asyncio.Task[Any]) -> None:
        """Mark the pod's reserved allocation bound (there is no apiserver to create a Binding in)."""
        if self.ledger is None:
            return
        query = select(models.allocations.c.id).where(
            models.allocations.c.pod_uid == pod_uid, models.allocations.c.state == AllocationState.RESERVED.value
        )
        while not bind.done():
            async with self.ledger.engine.connect() as conn:
                allocation_id = (await conn.execute(query)).scalar_one_or_none()
            if allocation_id is not None:
                await self.ledger.mark_bound(allocation_id, pod_uid, node)
                log.info("simulated Binding", extra={"pod_uid": pod_uid, "node": node})
                return
            await asyncio.sleep(0.05)

    async def run(self, pods: Sequence[dict[str, Any]], *, rounds: int = 3, backoff_s: float = 1.0) -> list[Placement]:
        """Schedule every pod in order; like kube-scheduler's backoff queue, pods that fit nowhere are retried
        (`rounds` times, `backoff_s` apart) and then stay unscheduled with their reasons."""
        results: dict[str, Placement] = {}
        queue = list(pods)
        for attempt in range(rounds):
            if attempt:
                await asyncio.sleep(backoff_s)
            waiting = []
            for pod in queue:
                placement = await self.schedule(pod)
                results[placement.uid] = placement
                log.info(
                    "scheduled" if placement.node else "unschedulable",
                    extra={
                        "namespace": placement.namespace,
                        "pod": placement.name,
                        "node": placement.node or "",
                        "reason": placement.error,
                    },
                )
                if placement.node is None:
                    waiting.append(pod)
            queue = waiting
            if not queue:
                break
        return [results[p["metadata"]["uid"]] for p in pods]
