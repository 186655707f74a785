"""What kube-scheduler knows about a node's pods when it preempts, read from the Kubernetes API for the preempt verb.

kube-scheduler sends only the UIDs of the victims it chose (`nodeCacheCapable: true`); to answer as its own
preemption would (`shared.placement.preempt`), the extender needs every pod on each candidate node (priority, start
time, namespace, name, labels) and every PodDisruptionBudget (selector and status). Both are listed when a preempt
call comes (preemption is rare; a list of one node's pods is served from the API server's watch cache by the
`spec.nodeName` index). Without the API (`--trust-filter-pods`) or when a read fails, the answer falls back to
kube-scheduler's own victims (`Facts.unknown`), which is right whenever they free the right GPU.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shared.kube import pods
from shared.kube.pods import Pod, list_pods
from shared.kube.raw import read_json
from shared.placement.disruption import Budget, parse_budget

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PodFacts:
    """One pod on a node, as preemption reads it."""

    uid: str
    namespace: str
    name: str
    labels: dict[str, str]
    priority: int
    started: datetime | None
    terminating: bool = False  # a deletionTimestamp: on its way out (kube-scheduler's victims are deleted so)


@dataclass(frozen=True)
class Facts:
    """The pods on each candidate node and the cluster's PodDisruptionBudgets (None: not known)."""

    pods: dict[str, list[PodFacts]] | None
    budgets: list[Budget]

    @classmethod
    def unknown(cls) -> Facts:
        """Nothing read: the answer keeps to kube-scheduler's victims."""
        return cls(None, [])


def pod_facts(pod: Pod) -> PodFacts:
    """A pod's priority (`spec.priority`, 0 when unset: `corev1helpers.PodPriority`), start (`status.startTime`),
    namespace, name and labels."""
    meta = pods.metadata(pod)
    priority = (pod.get("spec") or {}).get("priority")
    started = (pod.get("status") or {}).get("startTime")
    return PodFacts(
        uid=pods.pod_uid(pod),
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
        started=datetime.fromisoformat(started) if isinstance(started, str) and started else None,
        terminating=bool(meta.get("deletionTimestamp")),
    )


async def read_facts(api: Callable[[], Awaitable[Any]] | None, nodes: Sequence[str]) -> Facts:
    """List the pods of `nodes` (terminated ones left out, as kube-scheduler's cache leaves them) and every
    PodDisruptionBudget; `Facts.unknown()` without an API or when a read fails (logged)."""
    if api is None or not nodes:
        return Facts.unknown()
    from kubernetes_asyncio import client

    try:
        kube = await api()

        async def on(node: str) -> list[PodFacts]:
            items, _ = await list_pods(kube, timeout_s=LIST_TIMEOUT_S, field_selector=f"spec.nodeName={node}")
            return [pod_facts(p) for p in items if not pods.is_terminated(p)]

        async def budgets() -> list[Budget]:
            body = await read_json(
                await client.PolicyV1Api(kube).list_pod_disruption_budget_for_all_namespaces(
                    _preload_content=False, _request_timeout=LIST_TIMEOUT_S
                )
            )
            return [parse_budget(b) for b in body.get("items") or []]

        *listed, found = await asyncio.gather(*(on(n) for n in nodes), budgets())
    except Exception as exc:
        log.warning("preempt could not read the candidate nodes' pods or the PodDisruptionBudgets: %r", exc)
        return Facts.unknown()
    return Facts(dict(zip(nodes, listed, strict=True)), found)  # type: ignore[arg-type]  # gather's last is budgets()
