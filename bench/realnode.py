"""13. Real nodes: GPU pods and plain pods from creation to Running on kubelet v1.37.2, containerd and runc.

One stack on the local control plane with one real node (docs/devcluster.md, "Real nodes": its own kubelet,
containerd v2.4.2 and runc v1.5.3; 2 x 16 GiB fake GPUs, the node agent registered with kubelet). Pods of the two
kinds alternate, one at a time: a plain pod (busybox, `cpu: 10m`: kube-scheduler alone, kubelet, containerd) and a
GPU pod (busybox, `aliyun.com/gpu-mem: 1`: kube-scheduler with the extender's filter, prioritize and bind, the
ledger's reservation, the binder's Binding, kubelet's device-manager calls to the node agent, containerd). Each pod
is measured from the create request to the benchmark's poll (every 20 ms) seeing `phase: Running`, then deleted
(grace 0) and waited for until kubelet removed it. CPU per pod by component covers each kind's whole lives (start
and end); `gpushare_cpu_ms_per_gpu_pod` is the product's share (extender, binder, accounting, node agent,
PostgreSQL, NATS) minus what the same processes spent per plain pod. Also: kubelet's and containerd's resident
memory with the node idle.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from bench.common import BenchResult, Context, latency_summary, median
from bench.cpu import CpuWindow, ms_per_item, product_ms_per_pod
from bench.kube_stack import create_namespace, whole_stack

NAME = "realnode"
TITLE = "13. Real nodes: GPU pods vs plain pods, creation -> Running on kubelet + containerd, CPU per pod"
GPUS = "2x16GiB:Tesla-T4"
KINDS = ("plain", "gpu")


def pod(name: str, image: str, kind: str) -> dict[str, Any]:
    """A busybox pod that sleeps: plain (`cpu: 10m`) or asking 1 GiB of GPU memory."""
    resources = {"limits": {"aliyun.com/gpu-mem": "1"}} if kind == "gpu" else {"requests": {"cpu": "10m"}}
    main = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}
    spec = {"containers": [{**main, "resources": resources}], "terminationGracePeriodSeconds": 0}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f}s")
        await asyncio.sleep(0.02)


async def one_life(core: client.CoreV1Api, namespace: str, body: dict[str, Any], timeout_s: float) -> float:
    """Create a pod, wait until it runs, delete it and wait until it is gone; returns creation -> Running (s)."""
    name = body["metadata"]["name"]
    started = time.monotonic()
    await core.create_namespaced_pod(namespace, body)
    running_at = 0.0

    async def running() -> bool:
        nonlocal running_at
        p = await core.read_namespaced_pod(name, namespace)
        if p.status.phase == "Running":
            running_at = time.monotonic()
            return True
        if p.status.phase == "Failed":
            raise RuntimeError(f"{namespace}/{name} failed: {p.status.reason} {p.status.message}")
        return False

    await until(running, timeout_s, f"{name} Running")
    await core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

    async def gone() -> bool:
        try:
            await core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    await until(gone, timeout_s, f"{name} gone")
    return running_at - started


async def run(ctx: Context) -> BenchResult:
    """Both kinds of pod, alternating, on one real node."""
    from devstack.cluster.realnode import can_run_real_nodes

    pods = ctx.pick(3, 12, 40)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"gpus": GPUS, "pods_per_kind": pods, "in_flight": 1})
    why = can_run_real_nodes()
    if why:
        result.status = "skipped"
        result.notes.append(f"real nodes cannot run here: {why}")
        return result
    listeners = ctx.server_ports()
    async with whole_stack(ctx, 1, gpus=GPUS, nodes_kind="real") as stack:
        (node,) = stack.real_nodes.values()
        result.params["node_start_s"] = round(node.start_seconds, 2)
        result.metrics |= {f"idle_rss_mib_{k}": round(v / 1024, 1) for k, v in node.rss_kib().items()}
        api = await stack.api_client()
        core = client.CoreV1Api(api)
        ns = f"bench-real-{uuid.uuid4().hex[:5]}"
        await create_namespace(api, ns)
        await one_life(core, ns, pod("warm-up", node.workload_image, "gpu"), 120)  # first sandbox, first Allocate
        latencies: dict[str, list[float]] = {k: [] for k in KINDS}
        spent: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
        for i in range(pods):
            for kind in KINDS:
                with CpuWindow(listeners) as window:
                    latencies[kind].append(await one_life(core, ns, pod(f"{kind}-{i}", node.workload_image, kind), 120))
                spent[kind].update(window.spent())
        result.metrics |= {f"busy_rss_mib_{k}": round(v / 1024, 1) for k, v in node.rss_kib().items()}
    for kind in KINDS:
        result.metrics |= latency_summary(f"{kind}_to_running", latencies[kind])
        result.metrics |= ms_per_item(dict(spent[kind]), pods, kind)
    gpu, plain = (product_ms_per_pod(result.metrics, k) for k in ("gpu", "plain"))
    result.metrics["gpushare_cpu_ms_per_gpu_pod"] = round(gpu - plain, 2)
    result.metrics["gpu_vs_plain_to_running_p50"] = round(median(latencies["gpu"]) / median(latencies["plain"]), 2)
    result.notes.append(
        "one pod at a time; creation -> Running as the benchmark's 20 ms poll saw it; CPU per pod covers start and "
        "end (delete until kubelet removed the pod); gpushare_cpu_ms_per_gpu_pod = product CPU per GPU pod minus per "
        "plain pod"
    )
    return result
