"""8. Node agents at scale: PostgreSQL connections, control-plane CPU per GPU pod and the scheduler overhead
ratio at growing node counts (50, 200, 500 nodes of 8 GPUs in the full profile).

Every node runs a real node agent (fake GPUs, device-plugin servers, its ledger link over NATS) and a kubelet
stand-in, all in one process (`devstack.stack.fleet`), so hundreds fit on a small machine; they talk to the
central services exactly as the DaemonSet does. Each size runs on a fresh stack: `pods` plain pods, then
`pods` GPU pods of 1 GiB through kube-scheduler + extender + binder (kubelets do not start pods: scheduling
and binding are what is measured). Connections are sampled from pg_stat_activity during the GPU phase.
"""

from __future__ import annotations

import asyncio
import os

from bench.common import BenchResult, Context
from bench.cpu import CpuWindow
from bench.scheduler_overhead import phase
from devstack.embedded import sample_connections

NAME = "scale"
TITLE = "8. Node agents at scale: DB connections, CPU per GPU pod and GPU/plain ratio vs node count"


async def one_size(ctx: Context, nodes: int, pods: int) -> dict[str, float]:
    """One stack of `nodes` simulated nodes: plain phase, then GPU phase; the figures of this size."""
    from bench.kube_stack import whole_stack

    out: dict[str, float] = {}
    async with whole_stack(ctx, nodes, fleet=True) as stack:
        api = await stack.api_client()
        timeout = max(120.0, pods * 0.6)
        with CpuWindow(ctx.server_ports()) as plain_cpu:
            plain = await phase(api, 0, pods, 20, timeout)
        samples: list[int] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_connections(stack.database_url, samples, stop))
        try:
            with CpuWindow(ctx.server_ports()) as gpu_cpu:
                gpu = await phase(api, 1, pods, 20, timeout)
        finally:
            stop.set()
            await sampler
    gpu_ms = gpu_cpu.per_item_ms(pods, "gpu")
    plain_ms = plain_cpu.per_item_ms(pods, "plain")
    out["db_connections_max"] = max(samples) if samples else 0
    out["gpu_pods_per_s"] = round(gpu["pods_per_s"], 2)
    out["plain_pods_per_s"] = round(plain["pods_per_s"], 2)
    out["ratio_gpu_vs_plain"] = round(gpu["pods_per_s"] / plain["pods_per_s"], 3)
    out["gpu_cpu_ms_per_pod_total"] = gpu_ms["gpu_cpu_ms_per_pod_total"]
    out["plain_cpu_ms_per_pod_total"] = plain_ms["plain_cpu_ms_per_pod_total"]
    for part in ("extender", "binder", "accounting", "postgres", "nats_server", "node_agent"):
        out[f"gpu_cpu_ms_per_pod_{part}"] = gpu_ms.get(f"gpu_cpu_ms_per_pod_{part}", 0.0)
    out["bound"] = int(min(gpu["bound"], plain["bound"]))
    return out


async def run(ctx: Context) -> BenchResult:
    """Each node count in turn."""
    override = os.environ.get("GPUSHARE_BENCH_SCALE_NODES", "")  # e.g. "500": one size only
    sizes = [int(n) for n in override.split(",") if n.strip()] or ctx.pick([10, 20], [50, 200], [50, 200, 500])
    pods = ctx.pick(40, 300, 600)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"nodes": sizes, "pods": pods, "gpus": "8x16GiB"})
    for nodes in sizes:
        figures = await one_size(ctx, nodes, pods)
        for key, value in figures.items():
            result.metrics[f"n{nodes}_{key}"] = value
        if figures["bound"] < pods:
            result.status = "error"
            result.notes.append(f"{nodes} nodes: only {figures['bound']} of {pods} pods bound in time")
    first, last = sizes[0], sizes[-1]
    m = result.metrics
    if first == last:
        return result
    m["connections_growth"] = m[f"n{last}_db_connections_max"] - m[f"n{first}_db_connections_max"]
    m["gpu_cpu_ms_per_pod_growth_pct"] = round(
        100 * (m[f"n{last}_gpu_cpu_ms_per_pod_total"] / m[f"n{first}_gpu_cpu_ms_per_pod_total"] - 1), 1
    )
    return result
