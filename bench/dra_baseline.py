"""Benchmark 12's baseline: the DRA path's claims through kube-scheduler with nothing of gpushare on the path.

A third node pool of the DRA pool's shape whose GPUs a minimal driver publishes (this module writes one
ResourceSlice per node, as a DRA driver's kubelet plugin would: the same devices, capacities and request policies
as gpushare's, `shared.dra.slices`, under the driver name `baseline.bench.gpushare.io` and without binding
conditions), a DeviceClass for it, and pods that carry the very claim gpushare admission writes for an
`aliyun.com/gpu-mem: 1` pod (a ResourceClaimTemplate with one request `main` of `memory: 1Gi`) in a namespace that
did not opt in. No webhook, no gate, no ledger, no node agent: kube-apiserver, the resourceclaim controller and
kube-scheduler's DynamicResources plugin, what Kubernetes' DRA costs by itself here. The pool's kubelet stand-ins
admit the pods bound to them; they prepare nothing (no plugin is registered for the driver), so the baseline's
bound -> running leaves a plugin's prepare out, and its pods/s to bound is the figure compared.

gpushare's binder and accounting still follow every pod and claim of the cluster (their watches), so what they spend
on the baseline's objects shows as its (small) gpushare CPU.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.nodes import create_gpu_node, delete_node
from devstack.stack.kubelets import NodeKubelet
from devstack.stack.spec import parse_gpus
from shared.dra.slices import resource_slice, slice_spec
from shared.events.catalogue import GpuInfo
from shared.kube.raw import read_json
from shared.settings import MemoryUnit

DRIVER = "baseline.bench.gpushare.io"
DEVICE_CLASS = "bench-baseline-gpu"
TEMPLATE = "baseline-1gi"
POOL_LABEL = "bench.gpushare.io/pool"


def device_class() -> dict[str, Any]:
    """The baseline driver's DeviceClass (pure)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def node_slice(node: str, node_uid: str, gpus: str, unit: MemoryUnit = MemoryUnit.GIB) -> dict[str, Any]:
    """The minimal driver's ResourceSlice of one node: gpushare's devices under the baseline driver (pure)."""
    infos = [
        GpuInfo(
            uuid=f"GPU-{node}-{index}",
            index=index,
            model=g.model,
            memory_mib=g.memory_mib,
            memory_total_mib=g.memory_mib,
        )
        for index, g in enumerate(g for g in parse_gpus(gpus) for _ in range(g.count))
    ]
    spec = slice_spec(node, infos, unit, generation=1)
    spec["driver"] = DRIVER
    body = resource_slice(node, node_uid, spec)
    body["metadata"]["name"] = f"{node}-{DRIVER}"
    return body


def template() -> dict[str, Any]:
    """The claim gpushare admission writes for `aliyun.com/gpu-mem: 1`, of the baseline class (pure)."""
    request = {
        "name": "main",
        "exactly": {"deviceClassName": DEVICE_CLASS, "capacity": {"requests": {"memory": "1Gi"}}},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": TEMPLATE},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }


def pod_body(name: str) -> dict[str, Any]:
    """A pod as gpushare admission leaves `bench.kube_stack.pod_body(name, gpu_gib=1)`, on the baseline's class."""
    container = {"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpushare", "request": "main"}]}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [container],
            "resourceClaims": [{"name": "gpushare", "resourceClaimTemplateName": TEMPLATE}],
            "terminationGracePeriodSeconds": 0,
        },
    }


@dataclass
class Pool:
    """The baseline's nodes and their kubelet stand-ins."""

    nodes: list[str]
    kubelets: list[NodeKubelet] = field(default_factory=list)


@asynccontextmanager
async def baseline_pool(api: Any, prefix: str, count: int, gpus: str, max_pods: int) -> AsyncIterator[Pool]:
    """`count` nodes published by the minimal driver, each with a kubelet stand-in; removed at the end."""
    resource = client.ResourceV1Api(api)
    try:
        await read_json(await resource.create_device_class(device_class(), _preload_content=False))
    except ApiException as exc:
        if exc.status != 409:  # a run before this one made it
            raise
    pool = Pool([f"{prefix}-base-{i}" for i in range(1, count + 1)])
    sockets = Path(tempfile.mkdtemp(prefix="bench-base-"))
    shapes = [(g.memory_mib // 1024, g.model) for g in parse_gpus(gpus) for _ in range(g.count)]
    try:
        for node in pool.nodes:
            created = await create_gpu_node(
                api, node, gpus=shapes, labels={POOL_LABEL: "baseline"}, pods=str(max_pods), dra=True
            )
            await read_json(
                await resource.create_resource_slice(
                    node_slice(node, str(created.metadata.uid), gpus), _preload_content=False
                )
            )
            (sockets / node).mkdir()
            kubelet = NodeKubelet(api, node, sockets / node / "dp", sockets / node / "pod-resources.sock")
            pool.kubelets.append(await kubelet.start())
        yield pool
    finally:
        for kubelet in pool.kubelets:
            await kubelet.stop()
        for node in pool.nodes:
            await delete_node(api, node)  # its slice is owned by the node and goes with it
        shutil.rmtree(sockets, ignore_errors=True)


async def create_template(api: Any, namespace: str) -> None:
    """The pods' ResourceClaimTemplate in the phase's namespace."""
    await read_json(
        await client.ResourceV1Api(api).create_namespaced_resource_claim_template(
            namespace, template(), _preload_content=False
        )
    )
