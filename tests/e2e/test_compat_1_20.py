"""The compatibility run on Kubernetes 1.20 (built with Debian's Go 1.19 and reflect2 1.0.2).

The seed packing scenario and the terminating-pod rule pass through kube-scheduler 1.20 with the v1beta1
configuration, as they do on the current release, and a GPU pod preempts a lower-priority one there. And the 1.20
kube-apiserver survives the burst that used to kill it: with the reflect2 1.0.1 that 1.20 vendors, Go >= 1.18 builds
died under a 1,000-pod burst with "unexpected fault address" in `mapiterinit`.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from devstack.cluster import Paths
from devstack.cluster.binaries import k8s_cache_dir
from devstack.cluster.build_debian import REFLECT2_STAMP
from devstack.cluster.nodes import create_gpu_node
from devstack.cluster.releases import COMPAT
from devstack.cluster.waits import poll
from tests import system_tools
from tests.e2e import helpers as h
from tests.e2e.test_sharing import test_a_terminating_pod_keeps_its_share_until_it_is_gone as _terminating_rule
from tests.e2e.test_sharing import test_seven_pods_fill_one_gpu_then_the_next_waits as _seed_packing

pytestmark = pytest.mark.e2e

STACK_K8S = "1.20"
STACK_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4"

BURST_PODS = 1000
BURST_NODES = 10
BURST_IN_FLIGHT = 32
CRASH_MARKERS = ("unexpected fault address", "fatal error:", "panic:")


async def test_seed_packing_on_1_20(stack, api, namespace) -> None:
    assert stack.control_plane.release == COMPAT
    await _seed_packing(stack, api, namespace)
    # each pod's scheduling wait from 1.20's own timestamps (its Binding sets PodScheduled as the current release
    # does): eight bound, and the one that waited for room (at least 5 s) counted so, not at its binding's moment
    buckets = await poll(lambda: _wait_buckets(stack, namespace, 8), 30, what="eight scheduling waits observed")
    assert buckets[2.0] <= 7 and buckets[float("inf")] == 8, buckets


async def _wait_buckets(stack, namespace: str, count: int) -> dict[float, float] | None:
    """le -> cumulative count of accounting's scheduling-wait histogram for the namespace's bound pods."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{stack.accounting_url}/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gpushare_scheduling_wait_seconds_bucket" and labels.get("namespace") == namespace:
                if labels.get("outcome") == "bound":
                    out[float(labels["le"])] = sample.value
    return out if out.get(float("inf")) == count else None


async def test_terminating_rule_on_1_20(stack, api, namespace) -> None:
    """The current release's test, with its assertions, run against the 1.20 API server."""
    await _terminating_rule(stack, api, namespace)


async def test_a_gpu_pod_preempts_a_lower_priority_one_on_1_20(stack, api, namespace) -> None:
    """kube-scheduler 1.20 with the v1beta1 configuration as shipped (aliyun.com/* counted per node): it finds its
    victims by the node's GPU memory and asks the extender's preempt verb. With the resources ignored, as shipped
    before, it found no shortage and never preempted (the urgent pod stayed pending)."""
    node = stack.node_names[0]
    tag = uuid.uuid4().hex[:6]
    classes = {"low": (f"e2e-low-{tag}", 10), "high": (f"e2e-high-{tag}", 1000)}
    scheduling = client.SchedulingV1Api(api)
    for name, value in classes.values():
        await scheduling.create_priority_class({"metadata": {"name": name}, "value": value})
    try:
        for name, gib in (("low-a", 10), ("low-b", 6)):  # one after the other: low-a started first
            body = h.gpu_pod(name, [gib])
            body["spec"]["priorityClassName"] = classes["low"][0]
            await h.create_pod(api, namespace, body)
            await h.wait_bound(api, namespace, [name])
        urgent = h.gpu_pod("urgent", [8])
        urgent["spec"]["priorityClassName"] = classes["high"][0]
        await h.create_pod(api, namespace, urgent)
        # by the node's total kube-scheduler gives low-b back (10 GiB free without low-a): low-a is the one victim
        assert (await h.wait_bound(api, namespace, ["urgent"], timeout_s=90))["urgent"] == node
        names = {p.metadata.name for p in (await client.CoreV1Api(api).list_namespaced_pod(namespace)).items}
        assert names == {"low-b", "urgent"}, names
        allocs = await h.wait_ledger(stack.database_url, namespace, ["low-b", "urgent"])
        assert sum(a["memory_mib"] for a in allocs.values()) == 14 * 1024
    finally:
        for name, _ in classes.values():
            await scheduling.delete_priority_class(name)


def test_the_1_20_build_carries_reflect2_1_0_2() -> None:
    paths = system_tools.compat_binaries()
    tree = k8s_cache_dir(COMPAT) / "src" / "kubernetes"
    if not tree.is_dir():
        pytest.skip(f"prebuilt 1.20 binaries ({paths.kube_apiserver.parent}) without their source tree")
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    assert (vendored / REFLECT2_STAMP).is_file() and (vendored / "go_above_118.go").is_file()
    assert (tree / "_output" / "bin" / REFLECT2_STAMP).is_file(), "the binaries were built after the swap"


async def test_1_20_apiserver_survives_a_1000_pod_burst() -> None:
    paths: Paths = system_tools.compat_binaries()
    with system_tools.running_control_plane(paths) as cp:
        async with cp.api_client() as api:
            core = client.CoreV1Api(api)
            for i in range(BURST_NODES):
                await create_gpu_node(api, f"burst-{i}", gpus=[(16, "Tesla-T4")] * 8)
            await core.create_namespace({"metadata": {"name": "burst"}})
            started = time.monotonic()
            gate = asyncio.Semaphore(BURST_IN_FLIGHT)

            async def create(i: int) -> None:
                body = {
                    "metadata": {"name": f"p-{i:04d}"},
                    "spec": {
                        "terminationGracePeriodSeconds": 0,
                        "containers": [
                            {
                                "name": "c",
                                "image": "busybox:1.36",
                                "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}},
                            }
                        ],
                    },
                }
                async with gate:
                    await core.create_namespaced_pod("burst", body)

            await asyncio.gather(*(create(i) for i in range(BURST_PODS)))

            async def all_bound() -> int | None:
                items = (await core.list_namespaced_pod("burst", _request_timeout=60)).items
                bound = sum(1 for p in items if p.spec.node_name)
                return bound if bound == BURST_PODS else None

            await poll(all_bound, 300, interval=2, what=f"{BURST_PODS} pods bound by kube-scheduler 1.20")
            elapsed = time.monotonic() - started
            await core.delete_collection_namespaced_pod("burst", grace_period_seconds=0)
        alive = cp.running()
        log = cp.log_tail("kube-apiserver", 200_000)
    assert all(alive.values()), f"a control-plane process died during the burst: {alive}"
    crashes = [m for m in CRASH_MARKERS if m in log]
    assert not crashes, f"kube-apiserver 1.20 logged {crashes} under the burst"
    print(f"{BURST_PODS} pods created and bound in {elapsed:.1f}s on kube-apiserver {COMPAT}")
