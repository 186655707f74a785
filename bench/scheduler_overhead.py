"""1. Scheduler overhead: GPU pods through kube-scheduler + extender + binder vs plain pods, same run.

On the local control plane with the whole stack: `pods` plain CPU pods (kube-scheduler alone: the
extender manages only the GPU resources, so kube-scheduler does not call it for them), then `pods` GPU
pods of 1 GiB (filter, prioritize, bind through the extender, Binding by the binder), same nodes, same
client, same concurrency. Rate = pods / (last pod seen bound - first create).

Two variants on the same stack: shared-core (every process on every CPU, as the machine schedules them), and
deployment-shaped (metrics `pinned_*`): the control plane pinned to one CPU, gpushare's add-on (its services,
PostgreSQL, NATS) to another (`bench.affinity`), the load generator unpinned, so the ratio says whether one
core of add-on keeps up with one core of control plane. The full profile alternates 3 rounds of each and
reports medians; every pair of phases but the first starts from an empty cluster (the previous pods deleted,
their GPU shares given back, the stack quiet again).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import asyncpg
from kubernetes_asyncio import client

from bench import extender_calls
from bench.affinity import Pinning, deployment_plan, pinned
from bench.common import BenchResult, Context, Target, median
from bench.cpu import CENTRAL_GROUPS, CpuWindow, benchmark_roots, cpu_by_group, ms_per_item, product_ms_per_pod
from bench.kube_stack import create_namespace, create_pods, pause_kubelets, pod_body, wait_all_bound, whole_stack
from bench.pyspy import phase_profiles
from shared.ledger.models import LIVE_SQL

NAME = "overhead"
TITLE = "1. Scheduler overhead: GPU pods/s (scheduler + extender + binder) vs plain pods/s"
PINNED = "pinned_"  # the deployment-shaped variant's metrics
PRODUCT_CPU_MS_PER_GPU_POD = 12.0  # target: extender + binder + accounting + node agents + PostgreSQL + NATS


async def phase(
    api: object, gpu_gib: int, pods: int, concurrency: int, timeout_s: float, namespace: str | None = None
) -> dict[str, float]:
    """Create the pods (in a new namespace), wait until all are bound; the rate and how many made it."""
    ns = namespace or f"bench-{'gpu' if gpu_gib else 'plain'}-{uuid.uuid4().hex[:5]}"
    await create_namespace(api, ns)
    bodies = [pod_body(f"p-{i}", gpu_gib=gpu_gib) for i in range(pods)]
    t0 = time.monotonic()
    await create_pods(api, ns, bodies, concurrency)
    created = time.monotonic()
    done, bound = await wait_all_bound(api, ns, pods, timeout_s)
    return {"pods_per_s": bound / (done - t0), "bound": bound, "create_s": created - t0, "total_s": done - t0}


@dataclass
class Variant:
    """One variant's rounds of a plain then a GPU phase: each round's figures, the CPU of all of them."""

    prefix: str
    rounds: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {"plain": [], "gpu": []})
    cpu: dict[str, Counter[str]] = field(default_factory=lambda: {"plain": Counter(), "gpu": Counter()})
    calls: dict[str, Counter[str]] = field(default_factory=lambda: {"plain": Counter(), "gpu": Counter()})

    async def run_round(
        self, api: object, pods: int, timeout_s: float, listeners: list[int | str], extender_url: str
    ) -> list[str]:
        """A plain phase, then a GPU phase (20 creates in flight); returns their namespaces."""
        namespaces = []
        for kind, gpu_gib in (("plain", 0), ("gpu", 1)):
            ns = "-".join(filter(None, ("bench", self.prefix.strip("_"), kind, uuid.uuid4().hex[:5])))
            calls_before = await extender_calls.read_calls(extender_url)
            with CpuWindow(listeners) as window, phase_profiles(f"overhead-{self.prefix}{kind}"):
                self.rounds[kind].append(await phase(api, gpu_gib, pods, 20, timeout_s, ns))
            self.cpu[kind].update(window.spent())
            calls_after = await extender_calls.read_calls(extender_url)
            self.calls[kind].update({v: calls_after[v] - calls_before[v] for v in calls_after})
            namespaces.append(ns)
        return namespaces

    def metrics(self, pods: int) -> dict[str, float]:
        """Medians of the rounds' rates and ratios, CPU per pod over all rounds; per round when more than one."""
        plain, gpu = (self.rounds["plain"], self.rounds["gpu"])
        ratios = [
            g["pods_per_s"] / p["pods_per_s"] if p["pods_per_s"] else 0.0 for p, g in zip(plain, gpu, strict=True)
        ]
        m: dict[str, float] = {
            "plain_pods_per_s": round(median([r["pods_per_s"] for r in plain]), 2),
            "gpu_pods_per_s": round(median([r["pods_per_s"] for r in gpu]), 2),
            "ratio_gpu_vs_plain": round(median(ratios), 3),
            "gpu_product_cpu_ms_per_pod": 0.0,  # filled in below, listed here to stand beside the ratio
            "plain_bound": int(min(r["bound"] for r in plain)),
            "gpu_bound": int(min(r["bound"] for r in gpu)),
            "plain_total_s": round(median([r["total_s"] for r in plain]), 2),
            "gpu_total_s": round(median([r["total_s"] for r in gpu]), 2),
        }
        for kind in ("plain", "gpu"):
            m.update(ms_per_item(self.cpu[kind], pods * len(self.rounds[kind]), kind))
            m.update(extender_calls.per_pod(Counter(), self.calls[kind], pods * len(self.rounds[kind]), kind))
        m["gpu_product_cpu_ms_per_pod"] = product_ms_per_pod(m, "gpu")
        m["gpu_product_cpu_ms_per_pod_without_node_agents"] = product_ms_per_pod(m, "gpu", CENTRAL_GROUPS)
        if len(ratios) > 1:
            for i, (p, g, ratio) in enumerate(zip(plain, gpu, ratios, strict=True), 1):
                m[f"plain_pods_per_s_round{i}"] = round(p["pods_per_s"], 2)
                m[f"gpu_pods_per_s_round{i}"] = round(g["pods_per_s"], 2)
                m[f"ratio_gpu_vs_plain_round{i}"] = round(ratio, 3)
        return {self.prefix + k: v for k, v in m.items()}


def side_by_side(shared: Mapping[str, float], pinned: Mapping[str, float]) -> dict[str, float]:
    """Both variants' metrics, each pinned figure right after its shared-core one."""
    out: dict[str, float] = {}
    for key, value in shared.items():
        out[key] = value
        if PINNED + key in pinned:
            out[PINNED + key] = pinned[PINNED + key]
    out.update(pinned)
    return out


async def clear(api: object, namespaces: list[str], database_url: str, roots: list[int], timeout_s: float) -> bool:
    """Delete the phases' pods at once and their namespaces, wait until the binder has given every GPU share
    back and the stack is quiet again; False when the shares were not back in time."""
    core = client.CoreV1Api(api)
    for ns in namespaces:
        await core.delete_collection_namespaced_pod(ns, grace_period_seconds=0, _preload_content=False)
        await core.delete_namespace(ns, _preload_content=False)
    deadline = time.monotonic() + timeout_s
    conn = await asyncpg.connect(database_url)
    try:
        while await conn.fetchval(f"SELECT count(*) FROM allocations WHERE {LIVE_SQL}"):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.5)
    finally:
        await conn.close()
    await settle(roots)
    return True


async def settle(roots: list[int], busy_below: float = 0.3, most_s: float = 30.0) -> None:
    """Wait until the stack (the load generator aside) used less than `busy_below` of a core over a second
    (accounting's projections and the agents' updates of the releases), at most `most_s`."""
    deadline = time.monotonic() + most_s
    before = cpu_by_group(roots)
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        after = cpu_by_group(roots)
        busy = sum(after[g] - before.get(g, 0.0) for g in after if g != "bench")
        if busy < busy_below:
            return
        before = after


def sizes(ctx: Context) -> tuple[int, int, int]:
    """(pods per phase, nodes, rounds) of this run's profile."""
    return ctx.pick(20, 200, 1000), ctx.pick(1, 4, 10), ctx.pick(1, 1, 3)


def max_pods_per_node(pods: int, nodes: int) -> int:
    """Each simulated node's pod capacity: a round leaves both of its phases' pods bound until the next round
    clears them, so the nodes must hold twice a phase (a kubelet's default of 110 held 1,100 on 10 nodes, and
    the full profile's GPU phase stalled at its 100th pod)."""
    return max(110, math.ceil(2 * pods / nodes) + 10)


async def run(ctx: Context) -> BenchResult:
    """Rounds of (shared-core pair, pinned pair) on one stack."""
    pods, nodes, rounds = sizes(ctx)
    plan = deployment_plan()
    result = BenchResult(
        NAME,
        TITLE,
        ctx.profile,
        params={"pods": pods, "nodes": nodes, "gpus": "8x16GiB", "concurrency": 20, "rounds": rounds},
    )
    for prefix in ("", PINNED):
        result.targets.append(Target(f"{prefix}ratio_gpu_vs_plain", ">=", 0.9))
        result.targets.append(Target(f"{prefix}gpu_product_cpu_ms_per_pod", "<=", PRODUCT_CPU_MS_PER_GPU_POD))
    variants = [Variant(""), *([Variant(PINNED)] if plan else [])]
    if plan is None:
        result.notes.append("deployment-shaped variant skipped: fewer than 2 CPUs usable (or not Linux)")
    listeners = ctx.server_ports()
    timeout = ctx.pick(60.0, 300.0, 900.0)
    off_cpu = 0
    async with whole_stack(ctx, nodes, max_pods=max_pods_per_node(pods, nodes)) as stack:
        api = await stack.api_client()
        await pause_kubelets(stack)
        roots = benchmark_roots(listeners)
        previous: list[str] = []
        for _ in range(rounds):
            for variant in variants:
                if previous and not await clear(api, previous, stack.database_url, roots, timeout):
                    result.notes.append("the previous phases' GPU shares were not all given back in time")
                pinning: contextlib.AbstractContextManager[Pinning | None] = (
                    pinned(plan, roots) if plan and variant.prefix else contextlib.nullcontext()
                )
                with pinning as pins:
                    previous = await variant.run_round(api, pods, timeout, listeners, stack.extender_url)
                    if pins is not None:
                        placement = pins.placement()
                        off_cpu = max(off_cpu, placement.off)
                        if len(variant.rounds["gpu"]) == 1:
                            result.notes.append(f"pinned: {pins.summary()}")
                            result.notes.append(
                                f"pinned groups' threads after the pinned phases: {placement.threads}, "
                                f"{placement.new} of them started since pinning, {placement.off} off their CPU"
                            )
    m = result.metrics
    m.update(side_by_side(variants[0].metrics(pods), variants[1].metrics(pods) if plan else {}))
    if plan:
        m[f"{PINNED}threads_off_cpu"] = off_cpu
    for v in variants:
        if m[f"{v.prefix}gpu_bound"] < pods or m[f"{v.prefix}plain_bound"] < pods:
            result.status = "error"
            result.notes.append(
                f"{'deployment-shaped' if v.prefix else 'shared-core'}: not every pod was bound in time "
                f"(plain {m[f'{v.prefix}plain_bound']}, gpu {m[f'{v.prefix}gpu_bound']})"
            )
    return result
