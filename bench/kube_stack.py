"""The whole stack on the local control plane for benchmarks 1 and 3 (`devstack.stack.Stack`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kubernetes_asyncio import client

from bench.common import Context, gather_limited, private_database, private_names
from shared.kube.raw import read_json

GPUS = "8x16GiB:Tesla-T4"
# kube-scheduler's API client is left at 50 requests/s (burst 100) by default, and it makes each plain pod's
# Binding itself, while a GPU pod's is the binder's: at 1,000 pods that default alone held plain pods to ~54/s,
# below the GPU pods. Raised, a plain phase measures the control plane, not the client's rate limit.
SCHEDULER_QPS = 1000


@contextlib.asynccontextmanager
async def whole_stack(
    ctx: Context,
    nodes: int,
    *,
    fleet: bool = False,
    max_pods: int = 110,
    scheduler_qps: int = SCHEDULER_QPS,
    fleet_admit: bool = False,
    gpus: str = GPUS,
    dra_nodes: int = 0,
    controller_manager_extra: Sequence[str] = (),
    nodes_kind: str = "stand-in",
) -> AsyncIterator[Any]:
    """A started Stack (control plane, services, simulated nodes) on a private database and private streams;
    `fleet`: every node's agent and kubelet stand-in in one process (hundreds of nodes), admitting no pods unless
    `fleet_admit`; `max_pods`: each node's pod capacity; `scheduler_qps`: kube-scheduler's API client rate and
    burst; `gpus`: each node's GPUs; `dra_nodes`: how many of the nodes (the last ones) are DRA nodes;
    `controller_manager_extra`: kube-controller-manager's extra flags; `nodes_kind`: `real` for real nodes
    (devstack/stack/realnodes.py).

    Raises RuntimeError naming the reason when the local control plane is unavailable.
    """
    from devstack.cluster import ensure_binaries
    from devstack.stack.stack import MODE_LOCAL, Stack, StackConfig

    paths = await asyncio.to_thread(ensure_binaries)
    names = private_names("k8s")
    async with private_database(ctx.database_url, "k8s") as db_url:
        config = StackConfig(
            data_dir=ctx.work_dir / f"stack-{uuid.uuid4().hex[:6]}",
            nodes=nodes,
            gpus=gpus,
            max_pods=max_pods,
            node_prefix=f"bench-{uuid.uuid4().hex[:4]}",
            extender_port=0,
            binder_port=0,
            accounting_port=0,
            bind_timeout=30.0,
            database_url=db_url,
            nats_url=ctx.nats_url,
            stream_name=names.stream,
            subject_prefix=names.prefix,
            log_level="WARNING",
            scheduler_extra={
                "podInitialBackoffSeconds": 1,
                "podMaxBackoffSeconds": 2,
                "clientConnection": {"qps": scheduler_qps, "burst": scheduler_qps},
            },
            control_plane_paths=paths,
            progress=lambda m: None,
            fleet=fleet,
            fleet_admit=not fleet or fleet_admit,
            ready_timeout=90.0 + (nodes if fleet else 0),
            dra_nodes=dra_nodes,
            controller_manager_extra=list(controller_manager_extra),
            nodes_kind=nodes_kind,
        )
        stack = Stack(config)
        try:  # stopped also when starting fails or is cancelled half-way
            await stack.start()
            if stack.mode != MODE_LOCAL:
                raise RuntimeError(f"the stack did not get the local control plane: {stack.mode_reason}")
            yield stack
        finally:
            await stack.stop()


async def create_namespace(api: Any, name: str, labels: dict[str, str] | None = None) -> None:
    """A namespace for one phase (with `labels`, e.g. the one that opts it in to gpushare admission)."""
    await client.CoreV1Api(api).create_namespace({"metadata": {"name": name, "labels": labels or {}}})


def pod_body(name: str, *, gpu_gib: int = 0, scheduler: str | None = None) -> dict[str, Any]:
    """A pod asking `gpu_gib` GiB of GPU memory (0: a plain pod asking 10m CPU)."""
    limits = {"aliyun.com/gpu-mem": str(gpu_gib)} if gpu_gib else {}
    requests = {} if gpu_gib else {"cpu": "10m"}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": requests}}],
        "terminationGracePeriodSeconds": 0,
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def create_pods(api: Any, namespace: str, bodies: list[dict[str, Any]], concurrency: int) -> list[Any]:
    """Create pods with at most `concurrency` requests in flight; returns the created pods."""
    core = client.CoreV1Api(api)
    return await gather_limited(concurrency, [core.create_namespaced_pod(namespace, b) for b in bodies])


async def pause_kubelets(stack: Any) -> None:
    """Stop the simulated kubelets admitting pods: on a real cluster kubelets and node agents run on the GPU
    nodes, not on the control plane's cores, and starting pods is not part of scheduling or binding."""
    for kubelet in stack.kubelets.values():
        await kubelet.pause()


async def wait_all_bound(api: Any, namespace: str, count: int, timeout_s: float) -> tuple[float, int]:
    """Poll until `count` pods have a node; returns (monotonic time when the last was seen bound, bound count)."""
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout_s
    bound = 0
    while time.monotonic() < deadline:
        # raw JSON: model objects for 1,000 pods five times a second would take a core from the measured system
        pods = await read_json(await core.list_namespaced_pod(namespace, _preload_content=False))
        bound = sum(1 for p in pods.get("items") or [] if (p.get("spec") or {}).get("nodeName"))
        if bound >= count:
            return time.monotonic(), bound
        await asyncio.sleep(0.2)
    return time.monotonic(), bound
