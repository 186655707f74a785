"""DRA workloads for the end-to-end DRA tests, written as a user (or, later, gpushare's admission webhook) writes
them: a ResourceClaimTemplate of the `gpushare-gpu` class with capacity requests, and pods whose containers name
its requests. Plus the reads the tests check them with (claims, slices, ledger rows)."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.annotations import ALLOCATION
from shared.dra import DEVICE_CLASS
from shared.dra.slices import slice_name
from shared.kube.raw import read_json
from shared.ledger.models import part_from_row
from shared.ledger.rules import gpu_charges
from tests.waiting import eventually

Request = tuple[str, str | None, str | None, int]  # (name, memory, compute, count)


def claim_spec(requests: list[Request], device_class: str = DEVICE_CLASS) -> dict[str, Any]:
    """A claim spec: one request per entry, each for `count` GPUs with capacity requests."""
    out = []
    for name, memory, compute, count in requests:
        exactly: dict[str, Any] = {"deviceClassName": device_class}
        wanted = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
        if wanted:
            exactly["capacity"] = {"requests": wanted}
        if count != 1:
            exactly.update(allocationMode="ExactCount", count=count)
        out.append({"name": name, "exactly": exactly})
    return {"devices": {"requests": out}}


def template(name: str, requests: list[Request], device_class: str = DEVICE_CLASS) -> dict[str, Any]:
    """A ResourceClaimTemplate."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": claim_spec(requests, device_class)},
    }


def pod(
    name: str,
    containers: list[tuple[str, str | None]],
    *,
    template_name: str,
    inits: list[tuple[str, str | None, bool]] | None = None,
    entry: str = "gpushare",
) -> dict[str, Any]:
    """A pod using one claim made from `template_name`: (container, request it names or None) per container,
    (name, request, sidecar) per init container."""

    def container(cname: str, request: str | None, sidecar: bool = False) -> dict[str, Any]:
        c: dict[str, Any] = {"name": cname, "image": "nvcr.io/nvidia/cuda:12.2.0-base-ubuntu22.04"}
        if request is not None:
            c["resources"] = {"claims": [{"name": entry, **({"request": request} if request else {})}]}
        if sidecar:
            c["restartPolicy"] = "Always"
        return c

    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "containers": [container(c, r) for c, r in containers],
        "resourceClaims": [{"name": entry, "resourceClaimTemplateName": template_name}],
    }
    if inits:
        spec["initContainers"] = [container(c, r, s) for c, r, s in inits]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"e2e": "dra"}}, "spec": spec}


async def create(api: client.ApiClient, namespace: str, *objects: dict[str, Any]) -> None:
    """Create templates and pods (in order)."""
    resource, core = client.ResourceV1Api(api), client.CoreV1Api(api)
    for obj in objects:
        if obj["kind"] == "ResourceClaimTemplate":
            await resource.create_namespaced_resource_claim_template(namespace, obj, _preload_content=False)
        else:
            await core.create_namespaced_pod(namespace, obj)


async def raw_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """A pod as JSON (None when gone)."""
    try:
        return await read_json(await client.CoreV1Api(api).read_namespaced_pod(name, namespace, _preload_content=False))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def pod_claim(api: client.ApiClient, namespace: str, pod_name: str) -> dict[str, Any] | None:
    """The claim made for a pod from its template (None until the controller made it)."""
    p = await raw_pod(api, namespace, pod_name)
    statuses = ((p or {}).get("status") or {}).get("resourceClaimStatuses") or []
    if not statuses or not statuses[0].get("resourceClaimName"):
        return None
    return await claim(api, namespace, statuses[0]["resourceClaimName"])


async def claim(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """A claim as JSON (None when gone)."""
    try:
        return await read_json(
            await client.ResourceV1Api(api).read_namespaced_resource_claim(name, namespace, _preload_content=False)
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def claims(api: client.ApiClient) -> list[dict[str, Any]]:
    """Every claim of the cluster."""
    body = await read_json(
        await client.ResourceV1Api(api).list_resource_claim_for_all_namespaces(_preload_content=False)
    )
    return list(body.get("items") or [])


async def claims_in(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    """The claims of one namespace."""
    body = await read_json(
        await client.ResourceV1Api(api).list_namespaced_resource_claim(namespace, _preload_content=False)
    )
    return list(body.get("items") or [])


async def resource_slice(api: client.ApiClient, node: str) -> dict[str, Any] | None:
    """The node's ResourceSlice (None while it has none)."""
    try:
        return await read_json(
            await client.ResourceV1Api(api).read_resource_slice(slice_name(node), _preload_content=False)
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def events_of(api: client.ApiClient, namespace: str, name: str) -> list[str]:
    """`reason: message` of the events about one object."""
    found = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return [f"{e.reason}: {e.message}" for e in found.items]


async def wait_claim_allocated(
    api: client.ApiClient, namespace: str, pod_name: str, within: float = 60
) -> dict[str, Any]:
    """The pod's claim once it is allocated."""

    async def allocated() -> dict[str, Any] | None:
        c = await pod_claim(api, namespace, pod_name)
        return c if c and (c.get("status") or {}).get("allocation") else None

    return await eventually(
        allocated, what=f"the claim of {namespace}/{pod_name} to be allocated", within=within, interval=0.3
    )


async def wait_recorded(api: client.ApiClient, namespace: str, names: list[str], within: float = 60) -> None:
    """Until the binder recorded each pod's claim: it writes the pod's allocation annotation right after the ledger
    record (without the gate, kube-scheduler may bind the pod a moment before that)."""

    async def recorded() -> bool:
        for name in names:
            p = await raw_pod(api, namespace, name)
            if ALLOCATION not in ((p or {}).get("metadata") or {}).get("annotations", {}):
                return False
        return True

    await eventually(recorded, what=f"the claims of {names} recorded", within=within, interval=0.3)


async def annotated_pod(api: client.ApiClient, namespace: str, name: str, within: float = 60) -> dict[str, Any]:
    """The pod once the binder wrote its gpushare annotations (on the default pool: when the node agent has
    prepared its claim, with the assigned flag; services/binder/claims.py)."""

    async def check() -> dict[str, Any] | None:
        pod = await raw_pod(api, namespace, name)
        return pod if pod is not None and ALLOCATION in (pod["metadata"].get("annotations") or {}) else None

    pod: dict[str, Any] = await eventually(check, what=f"the gpushare annotations of {namespace}/{name}", within=within)
    return pod


async def ledger_rows(database_url: str, sql: str, *args: Any) -> list[dict[str, Any]]:
    """Rows of a read-only query on the ledger."""
    conn = await asyncpg.connect(database_url)
    try:
        return [dict(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


async def claim_allocations(database_url: str, namespace: str) -> dict[str, dict[str, Any]]:
    """The namespace's live DRA allocations by pod name: id, claim_uid, state, node, memory_mib."""
    rows = await ledger_rows(
        database_url,
        "SELECT id, pod_name, claim_uid, claim_name, state, node, memory_mib FROM allocations"
        " WHERE namespace = $1 AND state IN ('reserved', 'bound', 'assigned')",
        namespace,
    )
    return {r["pod_name"]: r for r in rows}


async def ledger_exact(database_url: str) -> list[str]:
    """GPUs whose allocated counters are not what their live shares charge (`rules.gpu_charges`), read in one
    snapshot: [] when the ledger is exact."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            counters = await conn.fetch(
                "SELECT uuid, node, allocated_memory_mib, allocated_compute FROM gpus WHERE retired_at IS NULL"
            )
            parts = await conn.fetch(
                "SELECT p.* FROM allocation_parts p JOIN allocations a ON a.id = p.allocation_id"
                " WHERE a.state IN ('reserved', 'bound', 'assigned')"
            )
    finally:
        await conn.close()
    by_alloc: dict[Any, list[Any]] = {}
    for p in parts:
        by_alloc.setdefault(p["allocation_id"], []).append(part_from_row(_Row(p)))
    charged: dict[str, list[int]] = {}
    for alloc_parts in by_alloc.values():
        for gpu_uuid, (memory, compute) in gpu_charges(alloc_parts).items():
            cur = charged.setdefault(gpu_uuid, [0, 0])
            cur[0] += memory
            cur[1] += compute
    out = []
    for r in counters:
        want = charged.get(r["uuid"], [0, 0])
        if [r["allocated_memory_mib"], r["allocated_compute"]] != want:
            out.append(
                f"{r['node']}/{r['uuid']}: counters {r['allocated_memory_mib']} MiB "
                f"{r['allocated_compute']}%, shares {want}"
            )
    return out


class _Row:
    def __init__(self, record: Any) -> None:
        self.__dict__.update(dict(record))


def consumed(claim_obj: dict[str, Any]) -> list[tuple[str, str, str, str | None]]:
    """(request, device, memory, shareID) of each allocation result."""
    results = ((claim_obj.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    return [
        (r["request"], r["device"], (r.get("consumedCapacity") or {}).get("memory", ""), r.get("shareID"))
        for r in results
    ]


async def settle(seconds: float) -> None:
    """Let time pass on purpose (a pod that must stay Pending through several scheduling attempts)."""
    await asyncio.sleep(seconds)


async def extender_share(api: client.ApiClient, ledger: Any, namespace: str, name: str, node: str, gpu: dict) -> Any:
    """A share the extender path holds on `gpu` (a ledger row): a real pod no scheduler picks up (the binder binds
    it, as after the extender's bind), so the share stays live until the pod is deleted. Returns the reservation."""
    from shared.events.catalogue import AllocationPart
    from shared.ledger.reservations import ReservationRequest
    from tests.e2e import helpers

    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "gpushare-test-nobody",
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "c", "image": "busybox"}],
        },
    }
    uid = (await helpers.create_pod(api, namespace, body)).metadata.uid
    part = AllocationPart(
        container="c", container_index=0, gpu_uuid=gpu["uuid"], gpu_index=gpu["index"], memory_mib=1024
    )
    reservation = await ledger.reserve(
        ReservationRequest(pod_uid=uid, namespace=namespace, pod_name=name, node=node, parts=(part,))
    )
    await helpers.wait_bound(api, namespace, [name], timeout_s=30)
    return reservation


async def wait_quota_enforced(api: client.ApiClient, namespace: str, within: float = 30) -> None:
    """Until gpushare's claim webhook enforces the namespace's quota (the extender hears of a quota from the event
    stream, a moment after it is set): a dry-run claim larger than any quota is refused."""

    async def refused() -> bool:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "quota-probe"},
            "spec": claim_spec([("probe", "1000000Gi", None, 1)]),
        }
        resp = await client.ResourceV1Api(api).create_namespaced_resource_claim(
            namespace, body, dry_run="All", _preload_content=False
        )
        return int(resp.status) == 403

    await eventually(refused, what=f"the quota of {namespace} enforced at claim creation", within=within, interval=0.2)
