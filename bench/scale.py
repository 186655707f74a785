"""8. Node agents at scale: PostgreSQL connections, CPU per GPU pod over its whole life and the scheduler overhead
ratio at growing node counts (50, 200, 500 nodes of 8 GPUs in the full profile).

Every node runs a real node agent (fake GPUs, device-plugin servers, its ledger link over NATS) and a kubelet
stand-in, all in one process (`devstack.stack.fleet`), so hundreds fit on a small machine; they talk to the
central services exactly as the DaemonSet does. The fleet's kubelets admit the pods bound to their nodes (one pod
list for all of them, every second), with GetPreferredAllocation, Allocate and PreStartContainer per container, and
report them Running. Each size runs on a fresh stack: `pods` plain pods, then `pods` GPU pods of 1 and 2 GiB through
kube-scheduler + extender + binder + the node agents, each phase until every pod is Running (GPU pods: and carries
its assigned flag). Connections are sampled from pg_stat_activity during the GPU phase. Every GPU pod's annotations
are then checked against the ledger, and no GPU may be overcommitted (the containers' environments are in the fleet
process; benchmark 1 checks those).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

from bench.common import BenchResult, Context
from bench.cpu import CpuWindow, product_ms_per_pod
from bench.kube_stack import pod_body
from bench.lifecycle import PodTimes, disagreements, watch_namespace
from bench.scheduler_overhead import gpu_gib, life_phase
from devstack.embedded import sample_connections

NAME = "scale"
TITLE = "8. Node agents at scale: DB connections, CPU per GPU pod and GPU/plain ratio vs node count"


async def one_size(ctx: Context, nodes: int, pods: int) -> tuple[dict[str, float], list[str]]:
    """One stack of `nodes` simulated nodes: plain phase, then GPU phase; the figures of this size and what
    disagrees."""
    from bench.kube_stack import whole_stack

    out: dict[str, float] = {}
    times = PodTimes()
    stop = asyncio.Event()
    async with whole_stack(ctx, nodes, fleet=True, fleet_admit=True) as stack:
        api = await stack.api_client()
        timeout = max(120.0, pods * 0.6)
        plain_ns, gpu_ns = (f"bench-{k}-{uuid.uuid4().hex[:5]}" for k in ("plain", "gpu"))
        watches = [asyncio.create_task(watch_namespace(api, ns, times, stop)) for ns in (plain_ns, gpu_ns)]
        samples: list[int] = []
        try:
            with CpuWindow(ctx.server_ports()) as plain_cpu:
                plain = await life_phase(
                    api, plain_ns, [pod_body(f"p-{i}") for i in range(pods)], times, timeout, started="running"
                )
            sampler = asyncio.create_task(sample_connections(stack.database_url, samples, stop))
            bodies = [pod_body(f"p-{i}", gpu_gib=gpu_gib(i)) for i in range(pods)]
            with CpuWindow(ctx.server_ports()) as gpu_cpu:
                gpu = await life_phase(api, gpu_ns, bodies, times, timeout, started="running", assigned=True)
            stop.set()
            await sampler
            wrong = await disagreements(api, stack.database_url, gpu_ns, None)
        finally:
            stop.set()
            for task in watches:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    gpu_ms = gpu_cpu.per_item_ms(pods, "gpu")
    plain_ms = plain_cpu.per_item_ms(pods, "plain")
    out["db_connections_max"] = max(samples) if samples else 0
    out["gpu_pods_per_s"] = round(gpu.pods_per_s, 2)
    out["plain_pods_per_s"] = round(plain.pods_per_s, 2)
    out["ratio_gpu_vs_plain"] = round(gpu.pods_per_s / plain.pods_per_s, 3) if plain.pods_per_s else 0.0
    out["gpu_running_per_s"] = round(gpu.started_per_s, 2)
    out["plain_running_per_s"] = round(plain.started_per_s, 2)
    for key, value in gpu.latencies.items():
        out[f"gpu_{key}"] = value
    out["gpu_cpu_ms_per_pod_total"] = gpu_ms["gpu_cpu_ms_per_pod_total"]
    out["plain_cpu_ms_per_pod_total"] = plain_ms["plain_cpu_ms_per_pod_total"]
    for part in ("extender", "binder", "accounting", "postgres", "nats_server", "node_agent"):
        out[f"gpu_cpu_ms_per_pod_{part}"] = gpu_ms.get(f"gpu_cpu_ms_per_pod_{part}", 0.0)
    out["gpu_product_cpu_ms_per_pod"] = product_ms_per_pod(gpu_ms, "gpu")
    out["bound"] = int(min(gpu.bound, plain.bound))
    out["running"] = int(min(gpu.started, plain.started))
    out["gpu_disagreements"] = len(wrong)
    return out, wrong


async def run(ctx: Context) -> BenchResult:
    """Each node count in turn."""
    override = os.environ.get("GPUSHARE_BENCH_SCALE_NODES", "")  # e.g. "500": one size only
    sizes = [int(n) for n in override.split(",") if n.strip()] or ctx.pick([10, 20], [50, 200], [50, 200, 500])
    pods = ctx.pick(40, 300, 600)
    result = BenchResult(
        NAME, TITLE, ctx.profile, params={"nodes": sizes, "pods": pods, "gpus": "8x16GiB", "pod_gib": "1 and 2"}
    )
    for nodes in sizes:
        figures, wrong = await one_size(ctx, nodes, pods)
        for key, value in figures.items():
            result.metrics[f"n{nodes}_{key}"] = value
        if figures["running"] < pods:
            result.status = "error"
            result.notes.append(f"{nodes} nodes: only {figures['running']} of {pods} pods bound and running in time")
        if wrong:
            result.status = "error"
            result.notes.append(
                f"{nodes} nodes: EXACTNESS FAILED, {len(wrong)} disagreements between the ledger and the annotations, "
                f"e.g. {'; '.join(wrong[:5])}"
            )
    first, last = sizes[0], sizes[-1]
    m = result.metrics
    if first == last:
        return result
    m["connections_growth"] = m[f"n{last}_db_connections_max"] - m[f"n{first}_db_connections_max"]
    m["gpu_cpu_ms_per_pod_growth_pct"] = round(
        100 * (m[f"n{last}_gpu_cpu_ms_per_pod_total"] / m[f"n{first}_gpu_cpu_ms_per_pod_total"] - 1), 1
    )
    return result
