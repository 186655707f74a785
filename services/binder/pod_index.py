"""What the binder's pod watch last saw of each GPU pod, so that binding need not GET the pod first.

On API servers that ignore a Binding's `metadata.uid` (1.20-1.22, 1.25-1.26) the binder must check that the
pod is still the one reserved for, unbound and alive before it binds. The pod watch already delivers every
GPU pod; this index keeps the few fields `decide` reads, per namespace/name, and answers only while the
watch is synced. A pod it has not seen yet (the watch may trail the scheduler by milliseconds) is read
from the API server as before, and any refusal of the Binding is still settled by reading the pod.
It also keeps each pod's resourceVersion and gpushare annotations, so that the annotations' follower need not
GET a pod before its conditional patch either (a stale entry makes that patch conflict, and the pod is read).
"""

from __future__ import annotations

from typing import Any

from shared.annotations import (
    ALLOCATION,
    GPU_MEM_ASSIGNED,
    GPU_MEM_ASSUME_TIME,
    GPU_MEM_DEV,
    GPU_MEM_IDX,
    GPU_MEM_POD,
)
from shared.kube import pods
from shared.kube.pod_index import PodIndex
from shared.kube.pods import Pod

# the annotations the binder writes (`services.binder.annotate.annotation_patch` compares them)
GPUSHARE_ANNOTATIONS = frozenset(
    {GPU_MEM_IDX, GPU_MEM_POD, GPU_MEM_DEV, GPU_MEM_ASSIGNED, GPU_MEM_ASSUME_TIME, ALLOCATION}
)


def summary(pod: Pod) -> Pod:
    """The fields of a pod that `services.binder.decide.decide` reads, and its resourceVersion and gpushare
    annotations, which `services.binder.annotate` compares with the ledger before a conditional patch (pure)."""
    meta = pods.metadata(pod)
    kept_meta: dict[str, Any] = {
        "uid": meta.get("uid"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "resourceVersion": meta.get("resourceVersion"),
    }
    notes = {k: v for k, v in (meta.get("annotations") or {}).items() if k in GPUSHARE_ANNOTATIONS}
    if notes:
        kept_meta["annotations"] = notes
    if meta.get("deletionTimestamp"):
        kept_meta["deletionTimestamp"] = meta["deletionTimestamp"]
    return {
        "metadata": kept_meta,
        "spec": {"nodeName": pods.node_name(pod)},
        "status": {"phase": pods.phase(pod)},
    }


def binder_index() -> PodIndex:
    """The binder's index: a `summary` of every pod the watch shows."""
    return PodIndex(summary)
