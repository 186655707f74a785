"""What the binder's pod watch last saw of each GPU pod, so that binding need not GET the pod first.

On API servers that ignore a Binding's `metadata.uid` (1.20-1.22, 1.25-1.26) the binder must check that the
pod is still the one reserved for, unbound and alive before it binds. The pod watch already delivers every
GPU pod; this index keeps the few fields `decide` reads, per namespace/name, and answers only while the
watch is synced. A pod it has not seen yet (the watch may trail the scheduler by milliseconds) is read
from the API server as before, and any refusal of the Binding is still settled by reading the pod.
"""

from __future__ import annotations

from typing import Any

from shared.kube import pods
from shared.kube.pod_index import PodIndex
from shared.kube.pods import Pod


def summary(pod: Pod) -> Pod:
    """The fields of a pod that `services.binder.decide.decide` reads (pure)."""
    meta = pods.metadata(pod)
    kept_meta: dict[str, Any] = {"uid": meta.get("uid"), "name": meta.get("name"), "namespace": meta.get("namespace")}
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
