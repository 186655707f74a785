"""Kubernetes objects for the DRA tests, as the API returns them (camelCase dicts): pods with claims, claims
allocated as kube-scheduler allocates them (results with shareID and consumedCapacity), ledger GPUs."""

from __future__ import annotations

import uuid
from typing import Any

from shared.dra import DEVICE_CLASS, DRIVER
from shared.dra.claims import LedgerGpu
from shared.dra.slices import device_name
from shared.events.catalogue import GpuInfo


def gpu(node: str, index: int, memory_gib: int = 16) -> GpuInfo:
    """A GPU of a node as its inventory reports it."""
    return GpuInfo(
        uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{index}')}",
        index=index,
        model="Tesla-T4",
        memory_mib=memory_gib * 1024,
        memory_total_mib=memory_gib * 1024,
    )


def ledger_gpus(gpus: list[GpuInfo]) -> dict[str, LedgerGpu]:
    """The node's GPUs by device name, as the binder reads them from the ledger."""
    return {device_name(g.uuid): LedgerGpu(g.uuid, g.index, g.memory_mib, g.compute_units) for g in gpus}


def request(name: str, memory: str | None = "4Gi", compute: str | None = None, count: int = 1) -> dict[str, Any]:
    """A device request of the gpushare class with capacity requests."""
    exactly: dict[str, Any] = {"deviceClassName": DEVICE_CLASS}
    wanted = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    if wanted:
        exactly["capacity"] = {"requests": wanted}
    if count != 1:
        exactly["allocationMode"] = "ExactCount"
        exactly["count"] = count
    return {"name": name, "exactly": exactly}


def pod(
    name: str,
    containers: list[tuple[str, str | None]],
    *,
    inits: list[tuple[str, str | None, bool]] = (),  # type: ignore[assignment]
    claim_entry: str = "gpushare",
    claim_name: str | None = None,
    template: str | None = None,
    namespace: str = "default",
    uid: str | None = None,
) -> dict[str, Any]:
    """A pod whose containers reference requests of its claim entry (`(container, request or None)`; None: the
    container references no request; "" references the whole claim). `inits`: (name, request, sidecar)."""

    def container(cname: str, req: str | None, sidecar: bool = False) -> dict[str, Any]:
        c: dict[str, Any] = {"name": cname, "image": "busybox"}
        if req is not None:
            use = {"name": claim_entry, **({"request": req} if req else {})}
            c["resources"] = {"claims": [use]}
        if sidecar:
            c["restartPolicy"] = "Always"
        return c

    entry: dict[str, Any] = {"name": claim_entry}
    if template:
        entry["resourceClaimTemplateName"] = template
    else:
        entry["resourceClaimName"] = claim_name or f"{name}-gpushare"
    out: dict[str, Any] = {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "creationTimestamp": "2026-12-04T10:00:00Z",
        },
        "spec": {
            "containers": [container(c, r) for c, r in containers],
            "resourceClaims": [entry],
        },
        "status": {},
    }
    if inits:
        out["spec"]["initContainers"] = [container(c, r, s) for c, r, s in inits]
    if template:
        out["status"]["resourceClaimStatuses"] = [{"name": claim_entry, "resourceClaimName": claim_name}]
    return out


def claim(
    name: str,
    namespace: str,
    requests: list[dict[str, Any]],
    results: list[tuple[str, GpuInfo, str, str]],
    *,
    node: str,
    pod_uid: str | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    """An allocated claim: `results` are (request, GPU, memory, compute) as the scheduler consumed them."""
    out: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()), "generation": 1},
        "spec": {"devices": {"requests": requests}},
        "status": {},
    }
    if results:
        out["status"]["allocation"] = {
            "devices": {
                "results": [
                    {
                        "request": req,
                        "driver": DRIVER,
                        "pool": node,
                        "device": device_name(g.uuid),
                        "shareID": str(uuid.uuid4()),
                        "consumedCapacity": {"memory": mem, "compute": comp},
                        "bindingConditions": ["gpushare.io/LedgerReserved"],
                        "bindingFailureConditions": ["gpushare.io/LedgerRefused"],
                    }
                    for req, g, mem, comp in results
                ]
            }
        }
    if pod_uid:
        out["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": pod_uid}]
    return out
