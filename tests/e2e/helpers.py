"""Helpers for the end-to-end scenarios: pod manifests, waits, ledger reads, accounting and inspect calls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import httpx
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.waits import poll
from devstack.stack.demo_run import run_inspect

BIND_TIMEOUT = 60.0
LIVE = ("reserved", "bound", "assigned")


def gpu_pod(
    name: str,
    mems: list[int],
    *,
    count: int | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod with one container per `mems` entry, each limiting `aliyun.com/gpu-mem` (GiB)."""
    containers = []
    for i, mem in enumerate(mems):
        limits = {"aliyun.com/gpu-mem": str(mem)}
        if count:
            limits["aliyun.com/gpu-count"] = str(count)
        containers.append(
            {
                "name": f"c{i}",
                "image": "nvcr.io/nvidia/cuda:12.2.0-base-ubuntu22.04",
                "command": ["sleep", "infinity"],
                "resources": {"limits": limits},
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"e2e": "true"}, "annotations": annotations or {}},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 0},
    }


async def create_namespace(api: client.ApiClient, name: str) -> None:
    """Create a namespace."""
    await client.CoreV1Api(api).create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


async def create_pod(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> client.V1Pod:
    """Create a pod; returns it."""
    return await client.CoreV1Api(api).create_namespaced_pod(namespace, body)


async def delete_pod(api: client.ApiClient, namespace: str, name: str) -> None:
    """Delete a pod at once (no kubelet would ever confirm a graceful stop)."""
    try:
        await client.CoreV1Api(api).delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except ApiException as exc:
        if exc.status != 404:
            raise


async def delete_all_pods(api: client.ApiClient, namespace: str) -> None:
    """Delete every pod of a namespace and wait until they are gone."""
    core = client.CoreV1Api(api)
    await core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)  # one call for all

    async def gone() -> bool:
        return not (await core.list_namespaced_pod(namespace)).items

    await poll(gone, 120, interval=0.5, what=f"pods of {namespace} to be deleted")


async def pod_node(api: client.ApiClient, namespace: str, name: str) -> str | None:
    """The node a pod is bound to, or None."""
    pod = await client.CoreV1Api(api).read_namespaced_pod(name, namespace)
    return pod.spec.node_name


async def wait_bound(
    api: client.ApiClient, namespace: str, names: list[str], timeout_s: float = BIND_TIMEOUT
) -> dict[str, str]:
    """Wait until every named pod is bound; returns pod -> node."""

    async def all_bound() -> dict[str, str] | None:
        nodes = {n: await pod_node(api, namespace, n) for n in names}
        return nodes if all(nodes.values()) else None  # type: ignore[return-value]

    return await poll(all_bound, timeout_s, interval=0.5, what=f"pods {names} in {namespace} to be bound")


async def stays_pending(api: client.ApiClient, namespace: str, name: str, seconds: float) -> bool:
    """True when the pod is still unbound after `seconds`."""
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        if await pod_node(api, namespace, name):
            return False
        await asyncio.sleep(0.5)
    return True


async def scheduled_condition(api: client.ApiClient, namespace: str, name: str) -> str:
    """The message of the pod's PodScheduled condition ('' when none)."""
    pod = await client.CoreV1Api(api).read_namespaced_pod(name, namespace)
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled":
            return f"{cond.status}:{cond.reason}:{cond.message}"
    return ""


async def cluster_gpu_mem_by_node(api: client.ApiClient) -> dict[str, int]:
    """Sum of `aliyun.com/gpu-mem` limits of the live pods bound to each node, across all namespaces."""
    pods = await client.CoreV1Api(api).list_pod_for_all_namespaces()
    out: dict[str, int] = {}
    for pod in pods.items:
        if not pod.spec.node_name or pod.metadata.deletion_timestamp is not None:
            continue
        for c in pod.spec.containers:
            mem = ((c.resources and c.resources.limits) or {}).get("aliyun.com/gpu-mem")
            if mem:
                out[pod.spec.node_name] = out.get(pod.spec.node_name, 0) + int(mem)
    return out


# ------------------------------------------------------------------------------------------ ledger (read only)
async def ledger_allocations(database_url: str, namespace: str) -> dict[str, dict[str, Any]]:
    """Live allocations of a namespace: pod name -> {uid, node, state, memory_mib, parts: [...]}."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT a.id, a.pod_uid, a.pod_name, a.node, a.state, a.memory_mib, p.container, p.container_index,"
            " p.gpu_uuid, p.gpu_index, p.memory_mib AS part_mib, p.init, p.sidecar"
            " FROM allocations a JOIN allocation_parts p ON p.allocation_id = a.id"
            " WHERE a.namespace = $1 AND a.state = ANY($2::text[]) ORDER BY p.container_index, p.gpu_index",
            namespace,
            list(LIVE),
        )
    finally:
        await conn.close()
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        entry = out.setdefault(
            r["pod_name"],
            {
                "id": r["id"],
                "uid": r["pod_uid"],
                "node": r["node"],
                "state": r["state"],
                "memory_mib": r["memory_mib"],
                "parts": [],
            },
        )
        entry["parts"].append(
            {
                "container": r["container"],
                "gpu_uuid": r["gpu_uuid"],
                "gpu_index": r["gpu_index"],
                "memory_mib": r["part_mib"],
                "init": r["init"],
                "sidecar": r["sidecar"],
            }
        )
    return out


async def gpu_rows(database_url: str, node: str) -> list[dict[str, Any]]:
    """The ledger's GPUs of a node with their allocated counters."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            'SELECT uuid, "index", memory_mib, allocated_memory_mib FROM gpus WHERE node = $1 AND retired_at IS NULL'
            ' ORDER BY "index"',
            node,
        )
    finally:
        await conn.close()
    return [dict(r) for r in rows]


async def wait_ledger(
    database_url: str, namespace: str, pods: list[str], timeout_s: float = 30.0
) -> dict[str, dict[str, Any]]:
    """Wait until each named pod has a bound or assigned allocation in the ledger."""

    async def ready() -> dict[str, dict[str, Any]] | None:
        allocs = await ledger_allocations(database_url, namespace)
        ok = all(p in allocs and allocs[p]["state"] in ("bound", "assigned") for p in pods)
        return allocs if ok else None

    return await poll(ready, timeout_s, interval=0.5, what=f"ledger allocations of {pods} in {namespace}")


async def wait_released(database_url: str, namespace: str, pod: str, timeout_s: float = 30.0) -> None:
    """Wait until the pod no longer holds a live allocation."""

    async def released() -> bool:
        return pod not in await ledger_allocations(database_url, namespace)

    await poll(released, timeout_s, interval=0.5, what=f"ledger release of {namespace}/{pod}")


# ------------------------------------------------------------------------------------------ container env
async def container_env(
    stack: Any, node: str, namespace: str, pod: str, container: str, timeout_s: float = 30.0
) -> dict[str, str]:
    """The environment the kubelet stand-in obtained from the node agent for one container."""
    kubelet = stack.kubelets[node]

    async def env() -> dict[str, str] | None:
        return await kubelet_env(kubelet, namespace, pod, container)

    return await poll(env, timeout_s, interval=0.5, what=f"container env of {namespace}/{pod}/{container} on {node}")


async def kubelet_env(kubelet: Any, namespace: str, pod: str, container: str) -> dict[str, str] | None:
    """Ask the stand-in for one container's allocated env (None until it has allocated it)."""
    result = kubelet.container_env(namespace, pod, container)
    if asyncio.iscoroutine(result):
        result = await result
    return dict(result) if result else None


# ------------------------------------------------------------------------------------------ accounting / inspect
async def accounting_pod(stack: Any, namespace: str, name: str) -> dict[str, Any] | None:
    """Accounting's view of a pod (GET /v1/pods/{ns}/{name}); None on 404."""
    async with httpx.AsyncClient(timeout=5) as http:
        resp = await http.get(f"{stack.accounting_url}/v1/pods/{namespace}/{name}")
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return resp.json()


async def wait_pending_reason(stack: Any, namespace: str, name: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Accounting's view of a pod once it says why the pod is pending (`pending` is set only then)."""

    async def refused() -> dict[str, Any] | None:
        view = await accounting_pod(stack, namespace, name)
        return view if view and view.get("pending") else None

    return await poll(refused, timeout_s, what=f"accounting to show why {namespace}/{name} is pending")


async def accounting_pending(stack: Any, namespace: str) -> list[dict[str, Any]]:
    """Accounting's pods waiting for GPUs in a namespace (GET /v1/pending)."""
    async with httpx.AsyncClient(timeout=5) as http:
        resp = await http.get(f"{stack.accounting_url}/v1/pending", params={"namespace": namespace})
    resp.raise_for_status()
    return list(resp.json()["items"])


async def set_quota(stack: Any, token: str, namespace: str, memory_gib: int) -> httpx.Response:
    """PUT a namespace quota through accounting's admin API."""
    async with httpx.AsyncClient(timeout=5) as http:
        return await http.put(
            f"{stack.accounting_url}/v1/quotas/{namespace}",
            json={"memory_mib": memory_gib * 1024},
            headers={"Authorization": f"Bearer {token}"},
        )


async def inspect(stack: Any, *args: str) -> str:
    """Run `gpushare inspect ARGS` against the stack's accounting; returns stdout (asserts exit 0)."""
    status, out, err = await run_inspect(stack.accounting_url, *args)
    assert status == 0, f"gpushare inspect {args} exited {status}: {err[-2000:]}"
    return out


def detail_sections(text: str) -> dict[str, dict[str, int]]:
    """Parse `inspect -d`: node -> {pod: GiB allocated over all its GPU columns}."""
    out: dict[str, dict[str, int]] = {}
    node = None
    for line in text.splitlines():
        cols = line.split()
        if len(cols) == 2 and cols[0] == "NAME:":
            node = cols[1]
            out[node] = {}
        elif node and len(cols) >= 3 and cols[0] not in ("NAME", "Allocated", "Total") and cols[2].isdigit():
            out[node][cols[0]] = sum(int(c) for c in cols[2:] if c.isdigit())
    return out


async def inspect_json(stack: Any, *args: str) -> Any:
    """`gpushare inspect -o json ARGS` parsed."""
    return json.loads(await inspect(stack, "-o", "json", *args))


async def ledger_disagreements(database_url: str) -> list[str]:
    """GPUs whose allocated counter is not the sum of the live shares on them (app containers only): [] when the
    ledger is exact."""
    conn = await asyncpg.connect(database_url)
    try:
        counters = await conn.fetch("SELECT uuid, node, allocated_memory_mib FROM gpus WHERE retired_at IS NULL")
        shares = await conn.fetch(
            "SELECT p.gpu_uuid, sum(p.memory_mib) AS mib FROM allocation_parts p JOIN allocations a"
            " ON a.id = p.allocation_id WHERE a.state = ANY($1::text[]) GROUP BY p.gpu_uuid",
            list(LIVE),
        )
    finally:
        await conn.close()
    held = {r["gpu_uuid"]: int(r["mib"]) for r in shares}
    return [
        f"{r['node']}/{r['uuid']}: counter {r['allocated_memory_mib']} MiB, live shares {held.get(r['uuid'], 0)} MiB"
        for r in counters
        if r["allocated_memory_mib"] != held.get(r["uuid"], 0)
    ]
