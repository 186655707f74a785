"""5. Packing quality: GPU memory utilisation at the first unschedulable pod, project policy vs baseline.

A seeded, realistic mixed workload (1, 2, 4, 8 GiB pods; some on 2 GPUs; about a third leave again after
a while) arrives one pod at a time on `nodes` x 4 x 16 GiB GPUs until a pod fits nowhere. Both policies see
exactly the same arrivals and departures (departure times are fixed in arrival ticks), so the only
difference is where pods go:

* project: `shared.placement` as the extender runs it: filter (`evaluate`), `score_node` (binpack by
  default), the highest score wins with ties broken at random as kube-scheduler's selectHost does, then
  `pick` chooses the GPUs;
* baseline (gpushare-style): kube-scheduler's default node spreading (LeastAllocated on the GPU memory
  resource, 0..100, random among ties) and the gpushare extender's best-fit GPU (least free memory that fits).

Reported: utilisation (allocated / total GPU memory) at the first rejection, whole GPUs still free then,
pods placed; medians over seeds.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from bench.common import BenchResult, Context, Target, latency_summary, median
from shared.placement import GpuView, NodeView, evaluate, parse_pod, pick, score_node
from shared.settings import MemoryUnit

NAME = "packing"
TITLE = "5. Packing quality: utilisation at first rejection, project vs gpushare-style baseline"
GPU_GIB = 16
GPUS_PER_NODE = 4

# (GiB per GPU, GPU count, weight): mostly single-GPU shares, some 2-GPU pods.
POD_MIX = ((1, 1, 24), (2, 1, 24), (4, 1, 22), (8, 1, 16), (4, 2, 7), (8, 2, 7))
DEPARTING = 0.35  # share of pods that leave again
LIFETIME = (20, 400)  # in later arrivals


@dataclass(frozen=True)
class Arrival:
    """One pod of the workload, and the tick at which it leaves (None: stays)."""

    index: int
    gib_per_gpu: int
    count: int
    leaves_at: int | None


def workload(seed: int, length: int) -> list[Arrival]:
    """The seeded arrival sequence (longer than any run needs)."""
    rng = random.Random(seed)
    kinds = [(g, c) for g, c, _ in POD_MIX]
    weights = [w for _, _, w in POD_MIX]
    out = []
    for i in range(length):
        g, c = rng.choices(kinds, weights)[0]
        leaves = i + rng.randint(*LIFETIME) if rng.random() < DEPARTING else None
        out.append(Arrival(i, g, c, leaves))
    return out


def pod_dict(a: Arrival) -> dict:
    """The Kubernetes Pod the arrival stands for (gpushare resources: total GiB, GPU count)."""
    limits = {"aliyun.com/gpu-mem": str(a.gib_per_gpu * a.count)}
    if a.count > 1:
        limits["aliyun.com/gpu-count"] = str(a.count)
    return {
        "metadata": {"uid": f"pod-{a.index}", "namespace": "bench", "name": f"pod-{a.index}"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


class Cluster:
    """Node views plus what each placed pod holds, so departures can give capacity back."""

    def __init__(self, nodes: int) -> None:
        mib = GPU_GIB * 1024
        self.nodes: dict[str, NodeView] = {
            f"node-{n:03d}": NodeView(
                name=f"node-{n:03d}",
                gpus=tuple(GpuView(uuid=f"GPU-{n:03d}-{i}", index=i, memory_mib=mib) for i in range(GPUS_PER_NODE)),
            )
            for n in range(nodes)
        }
        self.held: dict[int, tuple[str, dict[str, int]]] = {}

    def charge(self, pod: int, node: str, per_gpu: dict[str, int], sign: int = 1) -> None:
        """Add (or with sign=-1 remove) a pod's memory on its GPUs."""
        view = self.nodes[node]
        gpus = tuple(
            replace(g, allocated_memory_mib=g.allocated_memory_mib + sign * per_gpu.get(g.uuid, 0)) for g in view.gpus
        )
        self.nodes[node] = NodeView(name=view.name, gpus=gpus, cuda_version=view.cuda_version)
        if sign > 0:
            self.held[pod] = (node, per_gpu)
        else:
            self.held.pop(pod, None)

    def depart(self, pod: int) -> None:
        """A pod leaves: give its memory back."""
        if pod in self.held:
            node, per_gpu = self.held[pod]
            self.charge(pod, node, per_gpu, -1)

    def utilisation(self) -> float:
        """Allocated / total GPU memory."""
        total = sum(g.memory_mib for v in self.nodes.values() for g in v.gpus)
        used = sum(g.allocated_memory_mib for v in self.nodes.values() for g in v.gpus)
        return used / total

    def free_gpus(self) -> int:
        """GPUs with nothing allocated."""
        return sum(1 for v in self.nodes.values() for g in v.gpus if g.allocated_memory_mib == 0)


def select_host(
    nodes: Iterable[NodeView], fits: Callable[[NodeView], bool], score: Callable[[NodeView], int], rng: random.Random
) -> NodeView | None:
    """kube-scheduler's selectHost: among the nodes that fit, one of the highest score, ties broken at random."""
    best: list[NodeView] = []
    best_score = -1
    for view in nodes:
        if not fits(view):
            continue
        s = score(view)
        if s > best_score:
            best, best_score = [view], s
        elif s == best_score:
            best.append(view)
    return rng.choice(best) if best else None


def place_project(cluster: Cluster, a: Arrival, rng: random.Random) -> tuple[str, dict[str, int]] | None:
    """The project's decision: filter, score, random among the best, pick."""
    demand = parse_pod(pod_dict(a), MemoryUnit.GIB)
    view = select_host(cluster.nodes.values(), lambda v: evaluate(v, demand).fits, lambda v: score_node(v, demand), rng)
    if view is None:
        return None
    placement = pick(view, demand)
    per_gpu: dict[str, int] = {}
    for p in placement.parts:
        per_gpu[p.gpu_uuid] = per_gpu.get(p.gpu_uuid, 0) + p.memory_mib
    return view.name, per_gpu


def place_baseline(cluster: Cluster, a: Arrival, rng: random.Random) -> tuple[str, dict[str, int]] | None:
    """gpushare-style: LeastAllocated node spreading on GPU memory, best-fit GPUs on the chosen node."""
    need = a.gib_per_gpu * 1024

    def least_allocated(view: NodeView) -> int:
        cap = sum(g.memory_mib for g in view.gpus)
        requested = sum(g.allocated_memory_mib for g in view.gpus) + need * a.count
        return (cap - requested) * 100 // cap

    view = select_host(
        cluster.nodes.values(),
        lambda v: sum(1 for g in v.gpus if g.free_memory_mib >= need) >= a.count,
        least_allocated,
        rng,
    )
    if view is None:
        return None
    fit = sorted((g for g in view.gpus if g.free_memory_mib >= need), key=lambda g: (g.free_memory_mib, g.index))
    return view.name, {g.uuid: need for g in fit[: a.count]}


def simulate(policy: str, arrivals: list[Arrival], nodes: int, seed: int) -> dict[str, float]:
    """Run arrivals (with their departures) until the first pod that fits nowhere."""
    place = place_project if policy == "project" else place_baseline
    rng = random.Random(seed * 7919 + 1)
    cluster = Cluster(nodes)
    leaving: dict[int, list[int]] = {}
    decision_s: list[float] = []
    for a in arrivals:
        for pod in leaving.pop(a.index, []):
            cluster.depart(pod)
        t0 = time.perf_counter()
        chosen = place(cluster, a, rng)
        decision_s.append(time.perf_counter() - t0)
        if chosen is None:
            return {
                "utilisation_pct": 100 * cluster.utilisation(),
                "free_gpus": cluster.free_gpus(),
                "placed": a.index,
                "running": len(cluster.held),
                "rejected_gib": a.gib_per_gpu * a.count,
                "rejected_gpus": a.count,
                "decision_s": decision_s,
            }
        cluster.charge(a.index, chosen[0], chosen[1])
        if a.leaves_at is not None:
            leaving.setdefault(a.leaves_at, []).append(a.index)
    raise RuntimeError("the workload ended before the cluster filled up; make it longer")


async def run(ctx: Context) -> BenchResult:
    """Both policies over the same seeded workloads; medians over seeds."""
    nodes = ctx.pick(10, 100, 100)
    seeds = ctx.pick([1], [1, 2, 3], list(range(1, 11)))
    result = BenchResult(
        NAME,
        TITLE,
        ctx.profile,
        params={
            "nodes": nodes,
            "gpus_per_node": GPUS_PER_NODE,
            "gpu_gib": GPU_GIB,
            "seeds": seeds,
            "pod_mix_gib_count_weight": [list(m) for m in POD_MIX],
            "departing_share": DEPARTING,
            "lifetime_arrivals": list(LIFETIME),
        },
    )
    result.targets += [Target("project_utilisation_pct", ">=", 97.0), Target("utilisation_gain_pct_points", ">", 0.0)]
    runs: dict[str, list[dict]] = {"project": [], "baseline": []}
    for seed in seeds:
        arrivals = workload(seed, nodes * GPUS_PER_NODE * GPU_GIB * 4)
        for policy in runs:
            runs[policy].append(simulate(policy, arrivals, nodes, seed))
    m = result.metrics
    for policy, outs in runs.items():
        m[f"{policy}_utilisation_pct"] = round(median([o["utilisation_pct"] for o in outs]), 2)
        m[f"{policy}_utilisation_min_pct"] = round(min(o["utilisation_pct"] for o in outs), 2)
        m[f"{policy}_free_gpus"] = median([o["free_gpus"] for o in outs])
        m[f"{policy}_pods_placed"] = median([o["placed"] for o in outs])
    m["utilisation_gain_pct_points"] = round(m["project_utilisation_pct"] - m["baseline_utilisation_pct"], 2)
    m["project_wins_all_seeds"] = int(
        all(p["utilisation_pct"] > b["utilisation_pct"] for p, b in zip(runs["project"], runs["baseline"], strict=True))
    )
    m.update(latency_summary("project_decision_100_nodes", [s for o in runs["project"] for s in o["decision_s"]]))
    result.notes.append(
        "per seed (project / baseline utilisation %): "
        + ", ".join(
            f"{s}: {p['utilisation_pct']:.1f}/{b['utilisation_pct']:.1f} (rejected {p['rejected_gib']}/"
            f"{b['rejected_gib']} GiB)"
            for s, p, b in zip(seeds, runs["project"], runs["baseline"], strict=True)
        )
    )
    return result
