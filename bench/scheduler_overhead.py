"""1. Scheduler overhead over the whole life of a pod: GPU pods through kube-scheduler + extender + binder + kubelet
and the node agent, against plain pods through kube-scheduler and kubelet, and against the seed's own extender on
the same nodes and pods, same run.

On the local control plane with the whole stack, every simulated node's kubelet stand-in admits the pods bound
to it as kubelet 1.37 does (`bench.lifecycle.NodeWatchKubelets`: a watch per node, admission in kubelet's order,
GetPreferredAllocation, Allocate and PreStartContainer per container through the node agent, pod-resources, the
pod reported Running). A round: `pods` plain pods asking 10m CPU (kube-scheduler alone: the extender manages only
the GPU resources), then `pods` GPU pods of 1 and 2 GiB (filter, prioritize, bind through the extender, Binding by
the binder, devices from the node agent), 16 creates in flight. Each phase's CPU window runs from the first create
until every pod started (and, for GPU pods, every pod's `ALIYUN_COM_GPU_MEM_ASSIGNED=true` was written: the last
step of its setup); the GPU pods' deletion is a window of its own (until the ledger gave every share back).
Rate = pods / (last pod seen bound - first create); `*_started_per_s` to the last pod started.

In the shared-core variant a third phase creates as many GPU pods again at half the GPU phase's rate
(`gpu_paced_*`): its latencies are the pipeline's own, where the burst's are mostly queueing (16 creates in flight
reach the API server faster than GPU pods are placed, so the burst's p99 is about its length).

After the GPU phase every GPU pod is checked (`bench.lifecycle.disagreements`): the environment kubelet got, the
ledger and both annotations name the same GPUs, no GPU is overcommitted; any disagreement fails the benchmark.

Then the seed's extender (`bench.peer`) schedules the same number of pods of the same sizes on the same (emptied)
nodes through a kube-scheduler of its own, with its client's rate limit raised (`peer_raised_*`) and, in the first
round only, as shipped (`peer_as_shipped_*`); its pods stay bound (its device plugin does not run here).

A second variant on the same stack (metrics `pinned_*`): the control plane pinned to one CPU, gpushare's add-on
(its services, PostgreSQL, NATS) to another (`bench.affinity`), the load generator and kubelets unpinned. The full
profile alternates 3 rounds of each and reports medians; every round starts from an empty cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import asyncpg
from kubernetes_asyncio import client

from bench import db_counts, extender_calls, peer
from bench.affinity import Pinning, deployment_plan, pinned
from bench.common import BenchResult, Context, Target, median
from bench.cpu import CENTRAL_GROUPS, CpuWindow, benchmark_roots, cpu_by_group, ms_per_item, product_ms_per_pod
from bench.kube_stack import create_namespace, pod_body, whole_stack
from bench.lifecycle import NodeWatchKubelets, PodTimes, create_timed, disagreements, latency_ms, wait_for
from bench.pyspy import phase_profiles
from shared.kube.raw import read_json
from shared.ledger.models import LIVE_SQL

NAME = "overhead"
TITLE = "1. Scheduler overhead, whole pod life: GPU pods/s vs plain pods/s vs the seed's extender"
PINNED = "pinned_"  # the deployment-shaped variant's metrics
IN_FLIGHT = 16
PRODUCT_CPU_MS_PER_GPU_POD = 8.0  # target: gpushare's CPU per GPU pod over its whole setup
RATIO_GPU_VS_PLAIN = 0.5
CREATE_TO_BOUND_P99_MS = 1000.0
BOUND_TO_STARTED_P99_MS = 200.0
PACED_SHARE = 0.5  # the paced GPU phase creates pods at this share of the round's GPU rate


def gpu_gib(i: int) -> int:
    """The i-th GPU pod's memory: 1 and 2 GiB in turn."""
    return 1 + i % 2


@dataclass
class Phase:
    """One phase's figures."""

    pods_per_s: float
    started_per_s: float
    bound: int
    started: int
    total_s: float
    latencies: dict[str, float] = field(default_factory=dict)


async def life_phase(
    api: Any,
    namespace: str,
    bodies: list[dict[str, Any]],
    times: PodTimes,
    timeout_s: float,
    *,
    started: str | None = "started",
    assigned: bool = False,
    concurrency: int = IN_FLIGHT,
    rate: float | None = None,
) -> Phase:
    """Create the pods (in a new namespace); wait until all are bound, then until all reached `started` (the
    step of `PodTimes` that says kubelet started them: `started`, or `running` where only their status tells;
    None: bound is all), then (`assigned`) until every one carries the assigned flag."""
    await create_namespace(api, namespace)
    n = len(bodies)
    t0 = time.monotonic()
    await create_timed(api, namespace, bodies, concurrency, times, rate=rate)
    await wait_for(times, "bound", namespace, n, timeout_s)
    if started:
        await wait_for(times, started, namespace, n, timeout_s)
    if assigned:
        await wait_for(times, "assigned", namespace, n, timeout_s)
    bound_at = times.last("bound", namespace)
    started_at = times.last(started, namespace) if started else 0.0
    lat = latency_ms("create_to_bound", times.delays("created", "bound", namespace))
    if started:
        lat |= latency_ms(f"bound_to_{started}", times.delays("bound", started, namespace))
        lat |= latency_ms(f"create_to_{started}", times.delays("created", started, namespace))
    if assigned:
        lat |= latency_ms("bound_to_assigned_flag", times.delays("bound", "assigned", namespace))
    return Phase(
        pods_per_s=n / (bound_at - t0) if bound_at > t0 else 0.0,
        started_per_s=n / (started_at - t0) if started_at > t0 else 0.0,
        bound=times.count("bound", namespace),
        started=times.count(started, namespace) if started else 0,
        total_s=time.monotonic() - t0,
        latencies=lat,
    )


async def delete_pods(api: Any, namespace: str, database_url: str, timeout_s: float) -> bool:
    """Delete a namespace's pods at once; wait until they are gone and the ledger gave their shares back (then
    the namespace goes too); False when not in time."""
    core = client.CoreV1Api(api)
    await core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0, _preload_content=False)
    deadline = time.monotonic() + timeout_s
    conn = await asyncpg.connect(database_url)
    try:
        while True:
            left = await read_json(await core.list_namespaced_pod(namespace, limit=1, _preload_content=False))
            pods = len(left.get("items") or [])
            live = await conn.fetchval(
                f"SELECT count(*) FROM allocations WHERE namespace = $1 AND {LIVE_SQL}", namespace
            )
            if not pods and not live:
                break
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)
    finally:
        await conn.close()
    await core.delete_namespace(namespace, _preload_content=False)
    return True


@dataclass
class Variant:
    """One variant's rounds of a plain then a GPU phase: each round's figures, the CPU of all of them."""

    prefix: str
    paced: bool = False  # also a GPU phase created at half the measured GPU rate (latency without queueing)
    rounds: dict[str, list[Phase]] = field(default_factory=lambda: {"plain": [], "gpu": [], "gpu_paced": []})
    cpu: dict[str, Counter[str]] = field(
        default_factory=lambda: {"plain": Counter(), "gpu": Counter(), "gpu_delete": Counter(), "gpu_paced": Counter()}
    )
    calls: dict[str, Counter[str]] = field(default_factory=lambda: {"plain": Counter(), "gpu": Counter()})
    wrong: list[str] = field(default_factory=list)
    exchanges: float = 0.0
    paced_rates: list[float] = field(default_factory=list)
    db: Counter[str] = field(default_factory=Counter)  # PostgreSQL's counters over the GPU phases

    async def run_round(self, ctx: Context, stack: Any, times: PodTimes, pods: int, timeout_s: float) -> None:
        """A plain phase, then a GPU phase with the exactness check, then the GPU pods' deletion (measured), then
        the plain pods' (not measured)."""
        api, listeners = await stack.api_client(), ctx.server_ports()
        namespaces = {}
        for kind in ("plain", "gpu"):
            ns = "-".join(filter(None, ("bench", self.prefix.strip("_"), kind, uuid.uuid4().hex[:5])))
            namespaces[kind] = ns
            bodies = [pod_body(f"p-{i}", gpu_gib=gpu_gib(i) if kind == "gpu" else 0) for i in range(pods)]
            calls_before = await extender_calls.read_calls(stack.extender_url)
            exchanges_before = await node_agent_exchanges(stack)
            db_before = await db_counts.read_counts(stack.database_url) if kind == "gpu" else {}
            with CpuWindow(listeners) as window, phase_profiles(f"overhead-{self.prefix}{kind}"):
                phase = await life_phase(api, ns, bodies, times, timeout_s, assigned=kind == "gpu")
            self.rounds[kind].append(phase)
            self.cpu[kind].update(window.spent())
            calls_after = await extender_calls.read_calls(stack.extender_url)
            self.calls[kind].update({v: calls_after[v] - calls_before[v] for v in calls_after})
            if kind == "gpu":
                db_after = await db_counts.read_counts(stack.database_url)
                self.db.update({k: db_after[k] - db_before.get(k, 0) for k in db_after})
                self.exchanges += await node_agent_exchanges(stack) - exchanges_before
                self.wrong += await disagreements(api, stack.database_url, ns, envs_of(stack))
        with CpuWindow(listeners) as window:
            deleted = await delete_pods(api, namespaces["gpu"], stack.database_url, timeout_s)
        self.cpu["gpu_delete"].update(window.spent())
        if self.paced:
            rate = PACED_SHARE * self.rounds["gpu"][-1].pods_per_s
            ns = f"bench-gpu-paced-{uuid.uuid4().hex[:5]}"
            bodies = [pod_body(f"p-{i}", gpu_gib=gpu_gib(i)) for i in range(pods)]
            with CpuWindow(listeners) as window:
                phase = await life_phase(api, ns, bodies, times, timeout_s, assigned=True, rate=rate)
            self.rounds["gpu_paced"].append(phase)
            self.cpu["gpu_paced"].update(window.spent())
            self.paced_rates.append(rate)
            self.wrong += await disagreements(api, stack.database_url, ns, envs_of(stack))
            deleted = await delete_pods(api, ns, stack.database_url, timeout_s) and deleted
        deleted = await delete_pods(api, namespaces["plain"], stack.database_url, timeout_s) and deleted
        if not deleted:
            self.wrong.append("the round's pods were not all deleted, or their GPU shares not given back, in time")

    def metrics(self, pods: int) -> dict[str, float]:
        """Medians of the rounds' rates and ratios, CPU per pod over all rounds; per round when more than one."""
        plain, gpu = (self.rounds["plain"], self.rounds["gpu"])
        ratios = [g.pods_per_s / p.pods_per_s if p.pods_per_s else 0.0 for p, g in zip(plain, gpu, strict=True)]
        started = [
            g.started_per_s / p.started_per_s if p.started_per_s else 0.0 for p, g in zip(plain, gpu, strict=True)
        ]
        m: dict[str, float] = {
            "plain_pods_per_s": round(median([r.pods_per_s for r in plain]), 2),
            "gpu_pods_per_s": round(median([r.pods_per_s for r in gpu]), 2),
            "ratio_gpu_vs_plain": round(median(ratios), 3),
            "gpu_product_cpu_ms_per_pod": 0.0,  # filled in below, listed here to stand beside the ratio
            "plain_started_per_s": round(median([r.started_per_s for r in plain]), 2),
            "gpu_started_per_s": round(median([r.started_per_s for r in gpu]), 2),
            "ratio_gpu_vs_plain_started": round(median(started), 3),
            "plain_bound": int(min(r.bound for r in plain)),
            "gpu_bound": int(min(r.bound for r in gpu)),
            "plain_started": int(min(r.started for r in plain)),
            "gpu_started": int(min(r.started for r in gpu)),
            "plain_total_s": round(median([r.total_s for r in plain]), 2),
            "gpu_total_s": round(median([r.total_s for r in gpu]), 2),
            "gpu_disagreements": len(self.wrong),
            "gpu_exchanges_per_100_pods": round(100 * self.exchanges / (pods * len(gpu)), 2),
        }
        for kind, phases in (("plain", plain), ("gpu", gpu)):
            for key in phases[0].latencies:
                m[f"{kind}_{key}"] = round(median([r.latencies[key] for r in phases]), 1)
        if self.rounds["gpu_paced"]:
            paced = self.rounds["gpu_paced"]
            m["gpu_paced_create_rate_per_s"] = round(median(self.paced_rates), 2)
            m["gpu_paced_pods_per_s"] = round(median([r.pods_per_s for r in paced]), 2)
            for key in paced[0].latencies:
                m[f"gpu_paced_{key}"] = round(median([r.latencies[key] for r in paced]), 1)
            m.update(ms_per_item(self.cpu["gpu_paced"], pods * len(paced), "gpu_paced"))
            m["gpu_paced_product_cpu_ms_per_pod"] = product_ms_per_pod(m, "gpu_paced")
        for kind in ("plain", "gpu", "gpu_delete"):
            m.update(ms_per_item(self.cpu[kind], pods * len(gpu), kind))
        for kind in ("plain", "gpu"):
            m.update(extender_calls.per_pod(Counter(), self.calls[kind], pods * len(self.rounds[kind]), kind))
        if self.db:
            zero = dict.fromkeys(self.db, 0)
            m.update(db_counts.per_pod(zero, dict(self.db), pods * len(gpu), "gpu"))
        m["gpu_product_cpu_ms_per_pod"] = product_ms_per_pod(m, "gpu")
        m["gpu_product_cpu_ms_per_pod_without_node_agents"] = product_ms_per_pod(m, "gpu", CENTRAL_GROUPS)
        m["gpu_delete_product_cpu_ms_per_pod"] = product_ms_per_pod(m, "gpu_delete")
        if len(ratios) > 1:
            for i, (p, g, ratio) in enumerate(zip(plain, gpu, ratios, strict=True), 1):
                m[f"plain_pods_per_s_round{i}"] = round(p.pods_per_s, 2)
                m[f"gpu_pods_per_s_round{i}"] = round(g.pods_per_s, 2)
                m[f"ratio_gpu_vs_plain_round{i}"] = round(ratio, 3)
        return {self.prefix + k: v for k, v in m.items()}


@dataclass
class PeerRuns:
    """The seed's extender's phases: each variant's rates and its CPU."""

    rounds: dict[str, list[Phase]] = field(default_factory=dict)
    cpu: dict[str, Counter[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    async def run(
        self, ctx: Context, stack: Any, times: PodTimes, variant: str, binary: str, pods: int, timeout_s: float
    ) -> None:
        """One phase of the peer's `variant` (its processes started for it and stopped after)."""
        api = await stack.api_client()
        procs = await peer.start(stack, binary, ctx.work_dir / f"peer-{variant}", scheduler_qps=SCHEDULER_QPS)
        ns = f"bench-peer-{variant.replace('_', '-')}-{uuid.uuid4().hex[:5]}"
        try:
            bodies = [peer.pod_body(f"p-{i}", gpu_gib(i)) for i in range(pods)]
            with CpuWindow(ctx.server_ports()) as window:
                phase = await life_phase(api, ns, bodies, times, timeout_s, started=None)
        finally:
            procs.stop()
        self.rounds.setdefault(variant, []).append(phase)
        self.cpu.setdefault(variant, Counter()).update(window.spent())
        if phase.bound < pods:
            self.notes.append(f"peer {variant}: only {phase.bound} of {pods} pods bound in {timeout_s:.0f} s")
        if not await delete_pods(api, ns, stack.database_url, timeout_s):
            self.notes.append(f"peer {variant}: its pods were not all deleted in time")

    def metrics(self, pods: int, gpu_pods_per_s: float) -> dict[str, float]:
        """`peer_<variant>_*` figures, and gpushare's GPU rate against each."""
        m: dict[str, float] = {}
        for variant, phases in self.rounds.items():
            p = f"peer_{variant}"
            rate = median([r.pods_per_s for r in phases])
            m[f"{p}_pods_per_s"] = round(rate, 2)
            m[f"gpu_vs_{p}"] = round(gpu_pods_per_s / rate, 3) if rate else 0.0
            m[f"{p}_bound"] = int(min(r.bound for r in phases))
            for key in phases[0].latencies:
                m[f"{p}_{key}"] = round(median([r.latencies[key] for r in phases]), 1)
            spent = ms_per_item(self.cpu[variant], pods * len(phases), p)
            m.update(spent)
            m[f"{p}_own_cpu_ms_per_pod"] = spent.get(f"{p}_cpu_ms_per_pod_{peer.PEER_GROUP.replace('-', '_')}", 0.0)
        return m


SCHEDULER_QPS = 1000  # every kube-scheduler's own client (bench.kube_stack): the peer's too
OUTCOMES = "gpushare_node_agent_device_plugin_outcomes_total"


async def node_agent_exchanges(stack: Any) -> float:
    """Exchanges the node agents made so far (their device-plugin outcomes `exchanged`)."""
    total = 0.0
    async with aiohttp.ClientSession() as http:
        for name, proc in stack.processes.items():
            if not name.startswith("node-agent"):
                continue
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(proc.command.listens + "/metrics") as resp:
                    text = await resp.text()
                for line in text.splitlines():
                    if (
                        line.startswith("gpushare_node_agent_device_plugin_outcomes_total")
                        and 'reason="exchanged"' in line
                    ):
                        total += float(re.split(r"\s+", line)[-1])
    return total


def envs_of(stack: Any) -> Any:
    """`envs(namespace, pod, container)` from the stack's kubelet stand-ins (what Allocate returned)."""

    def envs(namespace: str, pod: str, container: str) -> dict[str, str] | None:
        for kubelet in stack.kubelets.values():
            env = kubelet.container_env(namespace, pod, container)
            if env is not None:
                return env
        return None

    return envs


def side_by_side(shared: Mapping[str, float], pinned: Mapping[str, float]) -> dict[str, float]:
    """Both variants' metrics, each pinned figure right after its shared-core one."""
    out: dict[str, float] = {}
    for key, value in shared.items():
        out[key] = value
        if PINNED + key in pinned:
            out[PINNED + key] = pinned[PINNED + key]
    out.update(pinned)
    return out


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
    return ctx.pick(20, 200, 600), ctx.pick(1, 4, 10), ctx.pick(1, 1, 3)


def max_pods_per_node(pods: int, nodes: int) -> int:
    """Each simulated node's pod capacity: a round leaves both of its phases' pods bound until their deletion, so
    the nodes must hold twice a phase (a kubelet's default of 110 held 1,100 on 10 nodes, and the full profile's
    GPU phase stalled at its 100th pod)."""
    return max(110, math.ceil(2 * pods / nodes) + 10)


async def run(ctx: Context) -> BenchResult:
    """Rounds of (shared-core pair, pinned pair, the peer's phases) on one stack."""
    pods, nodes, rounds = sizes(ctx)
    plan = deployment_plan()
    peers = {v: ctx.peer_extenders.get(v) for v in peer.VARIANTS}
    result = BenchResult(
        NAME,
        TITLE,
        ctx.profile,
        params={
            "pods": pods,
            "nodes": nodes,
            "gpus": "8x16GiB",
            "pod_gib": "1 and 2 in turn",
            "concurrency": IN_FLIGHT,
            "rounds": rounds,
            "peer_extender": {v: p or "" for v, p in peers.items()},
        },
    )
    m = result.metrics
    result.targets += [
        Target("gpu_product_cpu_ms_per_pod", "<=", PRODUCT_CPU_MS_PER_GPU_POD),
        Target("ratio_gpu_vs_plain", ">=", RATIO_GPU_VS_PLAIN),
        Target("gpu_vs_peer_raised", ">=", 1.0),
        Target("gpu_create_to_bound_p99_ms", "<=", CREATE_TO_BOUND_P99_MS),
        Target("gpu_bound_to_started_p99_ms", "<=", BOUND_TO_STARTED_P99_MS),
    ]
    variants = [Variant("", paced=True), *([Variant(PINNED)] if plan else [])]
    if plan is None:
        result.notes.append("deployment-shaped variant skipped: fewer than 2 CPUs usable (or not Linux)")
    for variant, binary in peers.items():
        missing = peer.available(binary)
        result.notes.append(f"peer {variant} ({peer.VARIANTS[variant]}): {missing or binary}")
    peer_runs = PeerRuns()
    timeout = ctx.pick(60.0, 300.0, 900.0)
    off_cpu = 0
    times = PodTimes()
    async with whole_stack(ctx, nodes, max_pods=max_pods_per_node(pods, nodes)) as stack:
        api = await stack.api_client()
        roots = benchmark_roots(ctx.server_ports())
        kubelets = await NodeWatchKubelets(api, stack.kubelets, times, skip=peer.is_peer_pod).start()
        try:
            for i in range(rounds):
                for variant in variants:
                    pinning: contextlib.AbstractContextManager[Pinning | None] = (
                        pinned(plan, roots) if plan and variant.prefix else contextlib.nullcontext()
                    )
                    with pinning as pins:
                        await variant.run_round(ctx, stack, times, pods, timeout)
                        if pins is not None:
                            placement = pins.placement()
                            off_cpu = max(off_cpu, placement.off)
                            if len(variant.rounds["gpu"]) == 1:
                                result.notes.append(f"pinned: {pins.summary()}")
                                result.notes.append(
                                    f"pinned groups' threads after the pinned phases: {placement.threads}, "
                                    f"{placement.new} of them started since pinning, {placement.off} off their CPU"
                                )
                    await settle(roots)
                for variant, binary in peers.items():
                    if peer.available(binary) or (variant == peer.AS_SHIPPED and i > 0):
                        continue  # as shipped, the peer is slow: its rate is measured in the first round only
                    await peer_runs.run(ctx, stack, times, variant, str(binary), pods, timeout)
                    await settle(roots)
        finally:
            await kubelets.stop()
    m.update(side_by_side(variants[0].metrics(pods), variants[1].metrics(pods) if plan else {}))
    m.update(peer_runs.metrics(pods, m["gpu_pods_per_s"]))
    shared = variants[0]
    if shared.db:
        gpu_pods = pods * len(shared.rounds["gpu"])
        rows = db_counts.tables_breakdown(dict.fromkeys(shared.db, 0), dict(shared.db), gpu_pods)
        result.notes.append(f"GPU phase, PostgreSQL rows written per pod by table: {rows}")
    result.notes += peer_runs.notes
    if plan:
        m[f"{PINNED}threads_off_cpu"] = off_cpu
    for v in variants:
        what = "deployment-shaped" if v.prefix else "shared-core"
        if m[f"{v.prefix}gpu_started"] < pods or m[f"{v.prefix}plain_started"] < pods:
            result.status = "error"
            result.notes.append(
                f"{what}: not every pod was bound and started in time (plain {m[f'{v.prefix}plain_started']}, "
                f"gpu {m[f'{v.prefix}gpu_started']} of {pods})"
            )
        if v.wrong:
            result.status = "error"
            result.notes.append(
                f"{what}: EXACTNESS FAILED, {len(v.wrong)} disagreements between the containers' environment, the "
                f"ledger and the annotations, e.g. {'; '.join(v.wrong[:5])}"
            )
    return result
