"""Benchmark 12's baseline: the DRA path's claims through kube-scheduler with nothing of gpushare on the path.

A third node pool of the DRA pool's shape whose GPUs a minimal driver publishes (this module writes one
ResourceSlice per node, as a DRA driver's kubelet plugin would: the same devices, capacities and request policies
as gpushare's, `shared.dra.slices`, under the driver name `baseline.bench.gpushare.io` and without binding
conditions), a DeviceClass for it, and pods that carry the very claim gpushare admission writes for an
`aliyun.com/gpu-mem: 1` pod (a ResourceClaimTemplate with one request `main` of `memory: 1Gi`) in a namespace that
did not opt in. No webhook, no gate, no ledger, no node agent: kube-apiserver, the resourceclaim controller and
kube-scheduler's DynamicResources plugin, what Kubernetes' DRA costs by itself here.

Like every DRA driver, the minimal one has a kubelet plugin (`MinimalPreparer` behind the same gRPC server as the
node agent's), and the pool's kubelet stand-ins prepare each pod's claim through it before its containers start, as
kubelet does (`devstack.cluster.kubelet_dra`: kubelet reads the claim, then calls `NodePrepareResources`). What the
plugin does is what a driver built on Kubernetes' own kubelet-plugin helper does at the least
(k8s.io/dynamic-resource-allocation v0.37.2, kubeletplugin/draplugin.go: `NodePrepareResources` first reads each
claim from the API server, `getResourceClaims`, and refuses one that is not allocated or was replaced by another
UID; the driver then answers one device per allocation result of its own and hands the container a CDI device):
no ledger, no gate, no wait. Before 2026-12-07 the stand-ins prepared nothing on this pool, which left kubelet's
and the driver's claim reads out of Kubernetes' own DRA cost (docs/benchmarks.md).

gpushare's binder and accounting still follow every pod and claim of the cluster (their watches), so what they spend
on the baseline's objects shows as its (small) gpushare CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.kubelet_dra import DraKubeletStandIn
from devstack.cluster.nodes import create_gpu_node, delete_node
from devstack.stack.kubelets import NodeKubelet
from devstack.stack.spec import parse_gpus
from services.node_agent.dra_plugin import DraPluginServer
from services.node_agent.dra_prepare import PreparedDevice, PrepareError
from shared.dra import cdi
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


class MinimalPreparer:
    """The minimal driver's kubelet plugin for one node: reads each claim it is asked to prepare from the API server
    (allocated, the UID kubelet named), answers one device per allocation result of this driver, and writes the
    claim's CDI spec (one device per request); unprepare removes the spec."""

    def __init__(self, api: Any, cdi_dir: Path) -> None:
        self.resource = client.ResourceV1Api(api)
        self.cdi_dir = cdi_dir
        self.prepared = 0

    async def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        """NodePrepareResources for one claim (raises PrepareError: the message goes to kubelet)."""
        try:
            claim = await read_json(
                await self.resource.read_namespaced_resource_claim(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            raise PrepareError(f"retrieve claim {namespace}/{name}: {exc.status} {exc.reason}") from None
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise PrepareError(f"claim {namespace}/{name} not allocated")
        if (claim.get("metadata") or {}).get("uid") != uid:
            raise PrepareError(f"claim {namespace}/{name} got replaced")
        results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == DRIVER]
        requests = list(dict.fromkeys(str(r["request"]) for r in results))
        devices = {q: [str(r["device"]) for r in results if r["request"] == q] for q in requests}
        spec = cdi.cdi_spec(uid, {q: {"BASELINE_DEVICES": ",".join(devices[q])} for q in requests})
        path = self.cdi_dir / cdi.spec_file_name(uid)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, path)
        self.prepared += 1
        first: set[str] = set()
        out = []
        for r in results:
            request = str(r["request"])
            ids = () if request in first else (cdi.device_id(uid, request),)
            first.add(request)
            out.append(PreparedDevice(request, str(r["pool"]), str(r["device"]), str(r.get("shareID") or ""), ids))
        return out

    def unprepare(self, uid: str) -> bool:
        """NodeUnprepareResources for one claim: its CDI spec removed (True when there was one)."""
        try:
            (self.cdi_dir / cdi.spec_file_name(uid)).unlink()
        except FileNotFoundError:
            return False
        return True


@dataclass
class Pool:
    """The baseline's nodes, their kubelet stand-ins and the minimal driver's kubelet plugins."""

    nodes: list[str]
    kubelets: list[NodeKubelet] = field(default_factory=list)
    plugins: list[DraPluginServer] = field(default_factory=list)

    def prepared(self) -> int:
        """Claims the minimal driver's plugins prepared so far."""
        return sum(p.preparer.prepared for p in self.plugins)


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
            here = sockets / node
            (here / "cdi").mkdir(parents=True)
            plugin = DraPluginServer(
                node,
                MinimalPreparer(api, here / "cdi"),  # type: ignore[arg-type]  # the preparer's two calls
                registration_dir=here / "plugins_registry",
                plugin_dir=here / "plugins",
                health=list,
                changed=asyncio.Event,
                driver=DRIVER,
            )
            await plugin.start()
            pool.plugins.append(plugin)
            dra = DraKubeletStandIn(api, here / "plugins_registry", here / "cdi")
            kubelet = NodeKubelet(api, node, here / "dp", here / "pod-resources.sock", dra=dra)
            pool.kubelets.append(await kubelet.start())
            await dra.wait_registered(DRIVER)
        yield pool
    finally:
        for kubelet in pool.kubelets:
            await kubelet.stop()
        for plugin in pool.plugins:
            await plugin.stop()
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
