"""1. Scheduler overhead: GPU pods through kube-scheduler + extender + binder vs plain pods, same run.

On the local control plane with the whole stack: `pods` plain CPU pods (kube-scheduler alone: the
extender manages only the GPU resources, so kube-scheduler does not call it for them), then `pods` GPU
pods of 1 GiB (filter, prioritize, bind through the extender, Binding by the binder), same nodes, same
client, same concurrency. Rate = pods / (last pod seen bound - first create).
"""

from __future__ import annotations

import time
import uuid

from bench.common import BenchResult, Context, Target
from bench.cpu import CpuWindow
from bench.kube_stack import create_namespace, create_pods, pause_kubelets, pod_body, wait_all_bound, whole_stack

NAME = "overhead"
TITLE = "1. Scheduler overhead: GPU pods/s (scheduler + extender + binder) vs plain pods/s"


async def phase(api: object, gpu_gib: int, pods: int, concurrency: int, timeout_s: float) -> dict[str, float]:
    """Create the pods, wait until all are bound; the rate and how many made it."""
    ns = f"bench-{'gpu' if gpu_gib else 'plain'}-{uuid.uuid4().hex[:5]}"
    await create_namespace(api, ns)
    bodies = [pod_body(f"p-{i}", gpu_gib=gpu_gib) for i in range(pods)]
    t0 = time.monotonic()
    await create_pods(api, ns, bodies, concurrency)
    created = time.monotonic()
    done, bound = await wait_all_bound(api, ns, pods, timeout_s)
    return {"pods_per_s": bound / (done - t0), "bound": bound, "create_s": created - t0, "total_s": done - t0}


async def run(ctx: Context) -> BenchResult:
    """Plain phase, then GPU phase, on one stack."""
    pods = ctx.pick(20, 200, 1000)
    nodes = ctx.pick(1, 4, 10)
    concurrency = 20
    result = BenchResult(
        NAME, TITLE, ctx.profile, params={"pods": pods, "nodes": nodes, "gpus": "8x16GiB", "concurrency": concurrency}
    )
    result.targets.append(Target("ratio_gpu_vs_plain", ">=", 0.8))
    async with whole_stack(ctx, nodes) as stack:
        api = await stack.api_client()
        await pause_kubelets(stack)
        timeout = ctx.pick(60.0, 300.0, 900.0)
        with CpuWindow(ctx.server_ports()) as plain_cpu:
            plain = await phase(api, 0, pods, concurrency, timeout)
        with CpuWindow(ctx.server_ports()) as gpu_cpu:
            gpu = await phase(api, 1, pods, concurrency, timeout)
    m = result.metrics
    m.update(plain_cpu.per_item_ms(pods, "plain"))
    m.update(gpu_cpu.per_item_ms(pods, "gpu"))
    m["plain_pods_per_s"] = round(plain["pods_per_s"], 2)
    m["gpu_pods_per_s"] = round(gpu["pods_per_s"], 2)
    m["ratio_gpu_vs_plain"] = round(gpu["pods_per_s"] / plain["pods_per_s"], 3)
    m["plain_bound"], m["gpu_bound"] = int(plain["bound"]), int(gpu["bound"])
    m["plain_total_s"], m["gpu_total_s"] = round(plain["total_s"], 2), round(gpu["total_s"], 2)
    if m["gpu_bound"] < pods or m["plain_bound"] < pods:
        result.status = "error"
        result.notes.append(f"not every pod was bound in time (plain {m['plain_bound']}, gpu {m['gpu_bound']})")
    return result
