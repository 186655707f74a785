"""What the binder's pod watch last saw of each GPU pod, so that binding need not GET the pod first.

On API servers that ignore a Binding's `metadata.uid` (1.20-1.22, 1.25-1.26) the binder must check that the
pod is still the one reserved for, unbound and alive before it binds. The pod watch already delivers every
GPU pod; this index keeps the few fields `decide` reads, per namespace/name, and answers only while the
watch is synced. A pod it has not seen yet (the watch may trail the scheduler by milliseconds) is read
from the API server as before, and any refusal of the Binding is still settled by reading the pod.
It also keeps each pod's resourceVersion and gpushare annotations, so that the annotations' follower need not
GET a pod before its conditional patch either (a stale entry makes that patch conflict, and the pod is read).
Of a pod with DRA claims (`spec.resourceClaims`) it keeps what `shared.dra.claims.read_claim` reads too (owner,
creation time, the claim entries and their statuses, each container's name, restart policy and claims) and when
kube-scheduler bound it, so that the claim gate reads no pod either (services/binder/claims.py).
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
from shared.dra import CLAIM_ANNOTATION
from shared.kube import pods
from shared.kube.pod_index import PodIndex
from shared.kube.pods import Pod

# the annotations the binder writes (`services.binder.annotate.annotation_patch` compares them)
GPUSHARE_ANNOTATIONS = frozenset(
    {GPU_MEM_IDX, GPU_MEM_POD, GPU_MEM_DEV, GPU_MEM_ASSIGNED, GPU_MEM_ASSUME_TIME, ALLOCATION, CLAIM_ANNOTATION}
)


def has_claims(pod: Pod) -> bool:
    """True when the pod names DRA claims (`spec.resourceClaims`; pure)."""
    return bool((pod.get("spec") or {}).get("resourceClaims"))


def _container_summary(container: dict[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {"name": container.get("name")}
    if container.get("restartPolicy"):
        kept["restartPolicy"] = container["restartPolicy"]
    uses = (container.get("resources") or {}).get("claims")
    if uses:
        kept["resources"] = {"claims": uses}
    return kept


def _claim_fields(pod: Pod, kept: Pod) -> None:
    """Add what `read_claim` reads of a pod with DRA claims, and its PodScheduled condition, to `kept`."""
    meta, spec, status = pods.metadata(pod), pod.get("spec") or {}, pod.get("status") or {}
    for key in ("creationTimestamp", "ownerReferences"):
        if meta.get(key):
            kept["metadata"][key] = meta[key]
    kept["spec"]["resourceClaims"] = spec.get("resourceClaims")
    for key in ("initContainers", "containers"):
        if spec.get(key):
            kept["spec"][key] = [_container_summary(c) for c in spec[key]]
    if status.get("resourceClaimStatuses"):
        kept["status"]["resourceClaimStatuses"] = status["resourceClaimStatuses"]
    scheduled = [c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"]
    if scheduled:
        kept["status"]["conditions"] = scheduled


def summary(pod: Pod) -> Pod:
    """The fields of a pod that `services.binder.decide.decide` reads, and its resourceVersion and gpushare
    annotations, which `services.binder.annotate` compares with the ledger before a conditional patch; of a pod
    with DRA claims also what the claim gate reads (pure)."""
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
    kept: Pod = {
        "metadata": kept_meta,
        "spec": {"nodeName": pods.node_name(pod)},
        "status": {"phase": pods.phase(pod)},
    }
    if has_claims(pod):
        _claim_fields(pod, kept)
    return kept


def binder_index() -> PodIndex:
    """The binder's index: a `summary` of every pod the watch shows."""
    return PodIndex(summary)
