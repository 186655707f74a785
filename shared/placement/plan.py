"""Filter, score and pick: the decisions about one pod on one node.

Filter and pick run the same solver, so a node that passes filter is one where pick succeeds (on the
same view). The solver places the containers that run for the pod's whole life first (app containers and
sidecars, i.e. init containers with `restartPolicy: Always`), largest share first, each on `count` distinct
GPUs chosen by the policy (binpack: best fit = least free memory that fits, ties to the lowest index;
spread: most free memory). Regular init containers run one at a time before the app containers, beside
the sidecars started before them, so on a GPU the pod is charged Kubernetes' effective request
(`shared.ledger.rules.gpu_charges`): max(max over regular init i of (init_i + sidecars before i),
sidecars + app shares). A regular init container is placed where it raises that charge least.
Largest first is a heuristic: when it finds no room, `shared.placement.search` tries the other assignments of
the app containers and sidecars (in the same order of preference), so the solver places a pod whenever some
placement fits (within the search's budget), and says it can never fit only when none fits the empty node.

kubelet hands a regular init container's devices on to the containers allocated after it (`reuse`): those
containers of a *reuse group* get the same GPUs, so the solver keeps each group on one set of GPUs (its first
placement when it already does, else each group pinned to the GPUs in policy order until one fits). Pods kubelet
cannot be predicted for (`reuse.inexact`) never fit.

Score (0..10) uses the node's memory utilisation after placing the pod,
u = (allocated MiB on healthy GPUs + pod's effective MiB) / (memory of healthy GPUs):
binpack = round(10 * u) (fill the fullest node that still fits), spread = round(10 * (1 - u)).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.events.catalogue import AllocationPart
from shared.placement import reuse
from shared.placement.demand import ContainerDemand, PodDemand
from shared.placement.hints import Policy
from shared.placement.search import Pins, search_long_running
from shared.placement.view import GpuView, NodeView

Extra = Mapping[str, tuple[int, int]]
MAX_PINNINGS = 64  # placements tried per node for a pod with reuse groups
# AllocationPart's fields in their order: container, index, gpu uuid, gpu index, MiB, compute, init, sidecar
_Part = tuple[str, int, str, int, int, int, bool, bool]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Filter's answer for one node: fits, or not with a reason; `resolvable=False` = can never fit."""

    fits: bool
    resolvable: bool = True
    reason: str = ""


FITS = Verdict(True)


@dataclass(frozen=True, slots=True)
class Placement:
    """The GPUs chosen for each container of a pod on one node."""

    node: str
    parts: tuple[AllocationPart, ...]


class NoFit(Exception):
    """The pod does not fit on the node (`resolvable=False`: it never will)."""

    def __init__(self, reason: str, resolvable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.resolvable = resolvable


def _policy(demand: PodDemand, default: Policy) -> Policy:
    return demand.hints.policy or default


def _describe_need(c: ContainerDemand) -> str:
    what = f"{c.memory_mib} MiB" + (f" and {c.compute}% compute" if c.compute else "")
    where = "one GPU" if c.count == 1 else f"each of {c.count} distinct GPUs"
    return f"{c.kind} {c.name} needs {what} on {where}"


def _describe_free(gpus: list[GpuView], free: dict[str, list[int]], compute: bool, capacity: bool) -> str:
    label = "capacity" if capacity else "free"
    items = []
    for g in gpus[:16]:
        m, k = free[g.uuid]
        items.append(f"GPU {g.index} {m} MiB" + (f"/{k}%" if compute else ""))
    more = f" (+{len(gpus) - 16} more)" if len(gpus) > 16 else ""
    return f"{label}: " + ", ".join(items) + more


def _precheck(node: NodeView, demand: PodDemand) -> Verdict | None:
    """Node-level refusals that no amount of waiting fixes (no GPUs, CUDA too old, hints exclude all)."""
    if not node.gpus:
        return Verdict(False, False, f"node {node.name} has no shareable GPUs")
    need = demand.hints.min_cuda
    if need is not None:
        wanted = ".".join(map(str, need))
        if node.cuda is None:
            return Verdict(False, False, f"node {node.name} reports no CUDA version; pod needs >= {wanted}")
        if node.cuda < need:
            return Verdict(False, False, f"node {node.name} has CUDA {node.cuda_version}; pod needs >= {wanted}")
    if demand.hints.constrains_gpus and not any(demand.hints.gpu_allowed(g.uuid, g.model) for g in node.gpus):
        return Verdict(False, False, f"no GPU on {node.name} matches the pod's hints ({demand.hints.describe()})")
    problem = reuse.inexact(demand) if demand.init_containers else ""
    if problem:
        return Verdict(False, False, f"gpushare cannot place this pod exactly: {problem}")
    return None


def _solve(
    node: NodeView,
    demand: PodDemand,
    policy: Policy,
    *,
    capacity: bool = False,
    extra: Extra | None = None,
    name: str | None = None,
) -> tuple[list[_Part] | None, str]:
    """Place every container; returns (parts, "") or (None, reason) (`name` replaces the node's in reasons)."""
    hints = demand.hints
    gpus = [
        g
        for g in node.gpus
        if (capacity or g.healthy) and (not hints.constrains_gpus or hints.gpu_allowed(g.uuid, g.model))
    ]
    if not gpus:
        unhealthy = sum(1 for g in node.gpus if not g.healthy)
        return None, f"all {unhealthy} matching GPU(s) on {node.name if name is None else name} are unhealthy"
    free: dict[str, list[int]] = {}
    for g in gpus:
        if capacity:
            free[g.uuid] = [g.memory_mib, g.compute_units]
        else:
            m, k = g.free_memory_mib, g.free_compute
            if extra and g.uuid in extra:
                em, ek = extra[g.uuid]
                m, k = min(g.memory_mib, m + em), min(g.compute_units, k + ek)
            free[g.uuid] = [m, k]
    groups = reuse.reuse_groups(demand) if demand.init_containers else ()
    parts, reason = _place_pod(gpus, free, demand, policy, capacity)
    if not groups or (parts is not None and reuse.kept_together(parts, groups)):
        return parts, reason
    for pins in _pinnings(gpus, free, groups, policy):
        pinned, _ = _place_pod(gpus, free, demand, policy, capacity, pins)
        if pinned is not None:
            return pinned, ""
    if parts is None:
        return None, reason
    where = node.name if name is None else name
    group = max(groups, key=len)
    return None, (
        f"kubelet hands the GPU memory devices of init container {group[0].name} on to "
        f"{', '.join(f'{c.kind} {c.name}' for c in group[1:])} (device reuse), so they must share "
        f"{'a GPU' if group[0].count == 1 else f'{group[0].count} GPUs'}, and no GPU on {where} has room for all of "
        f"them; {_describe_free(gpus, free, any(c.compute for c in group), capacity)}"
    )


def _pinnings(
    gpus: list[GpuView], free: dict[str, list[int]], groups: tuple[tuple[ContainerDemand, ...], ...], policy: Policy
) -> list[Pins]:
    """GPU sets to pin each reuse group to, best first by the policy: every group on one set, then mixed (at most
    MAX_PINNINGS in all)."""
    spread = policy is Policy.SPREAD
    ordered = sorted(gpus, key=lambda g: ((-1 if spread else 1) * free[g.uuid][0], g.index))
    choices = [
        [frozenset(g.uuid for g in combo) for combo in itertools.combinations(ordered, grp[0].count)] for grp in groups
    ]

    def pins(sets: tuple[frozenset[str], ...]) -> Pins:
        return {(c.name, c.index, c.init): gpu_set for grp, gpu_set in zip(groups, sets, strict=True) for c in grp}

    out: list[Pins] = []
    seen: set[tuple[frozenset[str], ...]] = set()
    same = [tuple(s for _ in groups) for s in choices[0]] if len({g[0].count for g in groups}) == 1 else []
    for sets in itertools.chain(same, itertools.product(*choices)):
        if sets in seen:
            continue
        seen.add(sets)
        out.append(pins(sets))
        if len(out) >= MAX_PINNINGS:
            break
    return out


def _place_pod(
    gpus: list[GpuView],
    free: dict[str, list[int]],
    demand: PodDemand,
    policy: Policy,
    capacity: bool,
    pins: Pins | None = None,
) -> tuple[list[_Part] | None, str]:
    """The solver proper on the node's eligible GPUs and what each has free (left as it was): largest first by
    policy, then the bounded search (`shared.placement.search`); `pins` keep containers on given GPUs."""
    orig = {u: (v[0], v[1]) for u, v in free.items()}
    spread = policy is Policy.SPREAD
    steady = sorted(
        [*demand.containers, *(c for c in demand.init_containers if c.sidecar)],
        key=lambda c: (-c.memory_mib, -c.compute, c.init, c.index),
    )
    parts, reason = _place(gpus, {u: list(v) for u, v in orig.items()}, orig, demand, steady, spread, capacity, pins)
    if parts is None:  # largest first was not enough: search
        order = _by_most_free if spread else _by_least_free
        chosen = search_long_running(
            gpus, {u: list(v) for u, v in orig.items()}, steady, demand.init_containers, order, pins
        )
        if chosen is not None:
            again = {u: list(v) for u, v in orig.items()}
            parts, _ = _place(gpus, again, orig, demand, steady, spread, capacity, pins, chosen)
    return parts, "" if parts is not None else reason


def _by_least_free(g: GpuView, free: dict[str, list[int]]) -> tuple[int, ...]:
    """Binpack's order of candidates: best fit (least free memory, then compute), ties to the lowest index."""
    return (free[g.uuid][0], free[g.uuid][1], g.index)


def _by_most_free(g: GpuView, free: dict[str, list[int]]) -> tuple[int, ...]:
    """Spread's order of candidates: most free memory, then compute, ties to the lowest index."""
    return (-free[g.uuid][0], -free[g.uuid][1], g.index)


def _place(
    gpus: list[GpuView],
    free: dict[str, list[int]],
    orig: dict[str, tuple[int, int]],
    demand: PodDemand,
    steady: list[ContainerDemand],
    spread: bool,
    capacity: bool,
    pins: Pins | None = None,
    chosen: list[tuple[ContainerDemand, tuple[GpuView, ...]]] | None = None,
) -> tuple[list[_Part] | None, str]:
    """Place the long-running containers (`steady`, in order) largest first by policy, or on the GPUs `chosen` for
    them, then the regular init containers, each within its `pins` if any; returns (parts, "") or (None, reason).
    `free` is used up."""
    parts: list[_Part] = []
    plan: list[tuple[ContainerDemand, tuple[GpuView, ...] | None]] = [(c, None) for c in steady]
    for c, on in chosen if chosen is not None else plan:
        if on is None:
            cands = [g for g in gpus if free[g.uuid][0] >= c.memory_mib and free[g.uuid][1] >= c.compute]
            pin = pins.get((c.name, c.index, c.init)) if pins else None
            if pin is not None:
                cands = [g for g in cands if g.uuid in pin]
            if len(cands) < c.count:
                return None, f"{_describe_need(c)}; {_describe_free(gpus, free, c.compute > 0, capacity)}"
            if spread:  # as `_by_most_free` / `_by_least_free` order them, inline: the first pass runs per node
                cands.sort(key=lambda g: (-free[g.uuid][0], -free[g.uuid][1], g.index))
            else:
                cands.sort(key=lambda g: (free[g.uuid][0], free[g.uuid][1], g.index))
            on = tuple(cands[: c.count])
        for g in on:
            f = free[g.uuid]
            f[0] -= c.memory_mib
            f[1] -= c.compute
            parts.append((c.name, c.index, g.uuid, g.index, c.memory_mib, c.compute, c.init, c.sidecar))
    if any(not c.sidecar for c in demand.init_containers):
        held = {u: [orig[u][0] - v[0], orig[u][1] - v[1]] for u, v in free.items()}  # long-running charge per GPU
        sidecar_parts = [p for p in parts if p[7]]
        for c in demand.init_containers:
            if c.sidecar:
                continue
            # a regular init container runs beside the sidecars started before it
            beside = {u: [0, 0] for u in free}
            for p in sidecar_parts:
                if p[1] < c.index:
                    beside[p[2]][0] += p[4]
                    beside[p[2]][1] += p[5]
            need = {u: (c.memory_mib + b[0], c.compute + b[1]) for u, b in beside.items()}
            cands = [g for g in gpus if orig[g.uuid][0] >= need[g.uuid][0] and orig[g.uuid][1] >= need[g.uuid][1]]
            pin = pins.get((c.name, c.index, c.init)) if pins else None
            if pin is not None:
                cands = [g for g in cands if g.uuid in pin]
            if len(cands) < c.count:
                orig_view = {u: list(v) for u, v in orig.items()}
                also = " beside the sidecars started before it" if any(p[1] < c.index for p in sidecar_parts) else ""
                free_text = _describe_free(gpus, orig_view, c.compute > 0, capacity)
                return None, f"{_describe_need(c)}{also}; {free_text}"

            def key(g: GpuView, need: dict[str, tuple[int, int]] = need) -> tuple[int, ...]:
                h, n = held[g.uuid], need[g.uuid]
                rest = orig[g.uuid][0] - h[0]
                grow = (max(0, n[0] - h[0]), max(0, n[1] - h[1]))
                return (*grow, -rest if spread else rest, g.index)

            cands.sort(key=key)
            for g in cands[: c.count]:
                h, n = held[g.uuid], need[g.uuid]
                h[0], h[1] = max(h[0], n[0]), max(h[1], n[1])
                parts.append((c.name, c.index, g.uuid, g.index, c.memory_mib, c.compute, True, False))
    parts.sort(key=lambda p: (p[6], p[1], p[3]))
    return parts, ""


_NAME = "\x00"  # stands for the node name in cached reasons (a pod whose names hold it bypasses the cache)
_MEMO_DEMANDS = 64  # demand signatures remembered
_MEMO_SHAPES = 20_000  # verdicts remembered per demand signature
_memo: OrderedDict[tuple, dict] = OrderedDict()
_memo_lock = threading.Lock()


class _Plan:
    """What filter precomputes once per (pod, policy): sorted containers, fast-path bounds, the verdict cache."""

    __slots__ = (
        "hints",
        "inits",
        "max_count",
        "memo",
        "policy",
        "sum_compute",
        "sum_memory",
        "summaries_suffice",
        "together",
    )

    def __init__(self, demand: PodDemand, policy: Policy) -> None:
        self.policy = _policy(demand, policy)
        apps = demand.containers
        steady = (*apps, *(c for c in demand.init_containers if c.sidecar))
        self.sum_memory = sum(c.memory_mib for c in steady)
        self.sum_compute = sum(c.compute for c in steady)
        self.max_count = max((c.count for c in steady), default=0)
        inits = []
        side_memory = side_compute = 0  # per-GPU shares of the sidecars so far: at most this much runs beside
        for c in demand.init_containers:
            if c.sidecar:
                side_memory, side_compute = side_memory + c.memory_mib, side_compute + c.compute
            else:
                inits.append((c.memory_mib + side_memory, c.compute + side_compute, c.count))
        self.inits = tuple(inits)
        self.hints = demand.hints.constrains_gpus
        # `_surely_fits` holds for reuse groups on one GPU each (all of a group on the freest GPU fits, and the
        # solver tries that), not for groups spanning several GPUs
        groups = reuse.reuse_groups(demand) if demand.init_containers else ()
        self.summaries_suffice = all(g[0].count == 1 for g in groups) and not (groups and reuse.inexact(demand))
        # with reuse groups (one GPU each), one GPU holding every share at once: the groups all fit there
        self.together: tuple[int, int] | None = None
        if groups:
            self.together = (
                max([self.sum_memory, *(m for m, _, _ in self.inits)]),
                max([self.sum_compute, *(c for _, c, _ in self.inits)]),
            )
        names_safe = all(_NAME not in c.name for c in (*apps, *demand.init_containers))
        self.memo: dict | None = (
            _memo_for((apps, demand.init_containers, demand.hints, self.policy)) if names_safe else None
        )


def _memo_for(signature: tuple) -> dict:
    """The verdict cache of one demand signature (bounded LRU of signatures)."""
    with _memo_lock:
        memo = _memo.get(signature)
        if memo is None:
            memo = _memo[signature] = {}
            while len(_memo) > _MEMO_DEMANDS:
                _memo.popitem(last=False)
        else:
            _memo.move_to_end(signature)
        return memo


def _count_at_least(node: NodeView, memory: int, compute: int) -> int:
    """How many healthy GPUs have this much memory and compute free."""
    return sum(1 for m, k in node.free_pairs if m >= memory and k >= compute)


def _surely_fits(node: NodeView, plan: _Plan) -> bool:
    """A sufficient condition for the solver to place the pod (no GPU hints), from the node's summaries.

    Apps and sidecars: a GPU with the sum of all their shares free stays a candidate for each container
    whatever the earlier ones took (each takes at most one share per GPU), so `max count` such GPUs
    guarantee success. Regular inits: the solver's only test is `count` GPUs whose free amount holds the
    init share plus the sidecars started before it there; holding it plus every earlier sidecar share
    suffices (and is exact without sidecars). Reuse groups (one GPU each, `summaries_suffice`): a GPU that holds
    every share at once takes all of them, and the solver tries each GPU for them.
    """
    desc = node.free_memory_desc
    if plan.together is not None and _count_at_least(node, *plan.together) < 1:
        return False
    k = plan.max_count
    if k:
        if len(desc) < k or desc[k - 1] < plan.sum_memory:
            return False
        if plan.sum_compute and _count_at_least(node, plan.sum_memory, plan.sum_compute) < k:
            return False
    for m, c, count in plan.inits:
        if len(desc) < count or desc[count - 1] < m:
            return False
        if c and _count_at_least(node, m, c) < count:
            return False
    return True


def _memory_bound(plan: _Plan) -> tuple[int, int] | None:
    """`_surely_fits` as one (position, MiB) test on the sorted free memory, when no share asks compute."""
    if plan.sum_compute or any(c for _, c, _ in plan.inits):
        return None
    needs = [(plan.max_count - 1, plan.sum_memory)] if plan.max_count else []
    needs += [(count - 1, m) for m, _, count in plan.inits]
    if not needs:
        return None
    # desc[p] >= m for every need holds iff it holds at the deepest position for the largest amount,
    # unless a deeper position asks less: then keep the general test
    pos = max(p for p, _ in needs)
    least = max(m for _, m in needs)
    if any(p == pos and m == least for p, m in needs):
        return pos, least
    return None


def _solve_verdict(node: NodeView, demand: PodDemand, policy: Policy, name: str | None = None) -> Verdict:
    parts, reason = _solve(node, demand, policy, name=name)
    if parts is not None:
        return FITS
    cap, cap_reason = _solve(node, demand, policy, capacity=True, name=name)
    if cap is None:
        return Verdict(False, False, f"can never fit on {node.name if name is None else name}: {cap_reason}")
    return Verdict(False, True, reason)


def _simple_verdict(node: NodeView, c: ContainerDemand) -> Verdict:
    if node.max_free_memory_mib >= c.memory_mib:
        for m, k in node.free_pairs:
            if m >= c.memory_mib and k >= c.compute:
                return FITS
    if c.memory_mib > node.max_capacity_mib or c.compute > max(g.compute_units for g in node.gpus):
        return Verdict(
            False,
            False,
            f"{_describe_need(c)}; the largest GPU on {node.name} has {node.max_capacity_mib} MiB",
        )
    extra = f" and {c.compute}% compute" if c.compute else ""
    return Verdict(
        False,
        True,
        f"{_describe_need(c)}; no healthy GPU on {node.name} has {c.memory_mib} MiB{extra} free "
        f"(most free: GPU {node.max_free_index} with {node.max_free_memory_mib} MiB)",
    )


def _judge(node: NodeView, demand: PodDemand, plan: _Plan) -> Verdict:
    """`evaluate` for a pod that wants a GPU share, with the fast paths and the per-shape verdict cache."""
    pre = _precheck(node, demand)
    if pre is not None:
        return pre
    if demand.simple:
        return _simple_verdict(node, demand.containers[0])
    shape = node.shape
    if shape is None:
        return _solve_verdict(node, demand, plan.policy)
    if not plan.hints:
        if plan.summaries_suffice and _surely_fits(node, plan):
            return FITS
        key: object = shape
    else:
        allowed = demand.hints.gpu_allowed
        key = (shape, tuple(allowed(g.uuid, g.model) for g in node.gpus))
    memo = plan.memo
    if memo is None:
        return _solve_verdict(node, demand, plan.policy)
    v = memo.get(key)
    if v is None:
        v = _solve_verdict(node, demand, plan.policy, _NAME)
        if len(memo) >= _MEMO_SHAPES:
            memo.clear()
        memo[key] = v
    if v.fits or _NAME not in v.reason:
        return v
    return Verdict(False, v.resolvable, v.reason.replace(_NAME, node.name))


def evaluate(node: NodeView, demand: PodDemand, policy: Policy = Policy.BINPACK) -> Verdict:
    """Filter one node: fits now, full now (resolvable), or can never fit (not resolvable)."""
    if not demand.wants_gpu:
        return FITS
    if demand.simple:
        pre = _precheck(node, demand)
        return pre if pre is not None else _simple_verdict(node, demand.containers[0])
    return _judge(node, demand, _Plan(demand, policy))


def fits(node: NodeView, demand: PodDemand, policy: Policy = Policy.BINPACK) -> bool:
    """True when the pod fits the node now."""
    return evaluate(node, demand, policy).fits


def filter_nodes(
    nodes: Iterable[NodeView], demand: PodDemand, policy: Policy = Policy.BINPACK
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(names that fit, {name: reason} full now, {name: reason} can never fit)."""
    ok: list[str] = []
    failed: dict[str, str] = {}
    never: dict[str, str] = {}
    if not demand.wants_gpu:
        return [node.name for node in nodes], failed, never
    if demand.memory_only:
        need = demand.containers[0].memory_mib
        for node in nodes:  # fast path: a node fits iff its freest healthy GPU has the memory
            if node.max_free_memory_mib >= need:
                ok.append(node.name)
                continue
            v = evaluate(node, demand, policy)
            (failed if v.resolvable else never)[node.name] = v.reason
        return ok, failed, never
    plan = _Plan(demand, policy)
    quick = not demand.simple and not plan.hints and demand.hints.min_cuda is None and plan.summaries_suffice
    bound = _memory_bound(plan) if quick else None
    pos, least = bound if bound is not None else (0, 0)
    for node in nodes:
        if quick:
            if bound is not None:  # `_surely_fits` reduced to one look at the sorted free memory
                desc = node.free_memory_desc
                if len(desc) > pos and desc[pos] >= least and node.shape is not None:
                    ok.append(node.name)
                    continue
            elif node.gpus and node.shape is not None and _surely_fits(node, plan):
                ok.append(node.name)
                continue
        v = _judge(node, demand, plan)
        if v.fits:
            ok.append(node.name)
        elif v.resolvable:
            failed[node.name] = v.reason
        else:
            never[node.name] = v.reason
    return ok, failed, never


def score_node(node: NodeView, demand: PodDemand, policy: Policy = Policy.BINPACK) -> int:
    """0..10 by the node's memory utilisation after placing the pod (see the module docstring)."""
    total = node.healthy_memory_mib
    if total <= 0:
        return 0
    used = node.healthy_allocated_mib + (demand.memory_mib if demand.wants_gpu else 0)
    u = min(1.0, max(0.0, used / total))
    score = 10 * u if _policy(demand, policy) is Policy.BINPACK else 10 * (1 - u)
    return int(score + 0.5)


def score_nodes(nodes: Iterable[NodeView], demand: PodDemand, policy: Policy = Policy.BINPACK) -> list[tuple[str, int]]:
    """(name, score) for each node, same formula as `score_node`, computed once per node shape."""
    need = demand.memory_mib if demand.wants_gpu else 0
    binpack = _policy(demand, policy) is Policy.BINPACK
    out: list[tuple[str, int]] = []
    add = out.append
    cache: dict[int | None, int] = {}  # score_key -> score
    get = cache.get
    for node in nodes:
        shape = node.score_key
        score = get(shape)
        if score is None:
            score = score_value(node.healthy_allocated_mib, node.healthy_memory_mib, need, binpack)
            if shape is not None:
                cache[shape] = score
        add((node.name, score))
    return out


def score_value(allocated_mib: int, total_mib: int, need_mib: int, binpack: bool) -> int:
    """0..10 from a node's healthy memory in use and in all, after adding `need_mib` (`score_node`'s formula)."""
    if total_mib <= 0:
        return 0
    u = (allocated_mib + need_mib) / total_mib
    u = 1.0 if u > 1.0 else u
    return int((10 * u if binpack else 10 * (1 - u)) + 0.5)


def pick(
    node: NodeView, demand: PodDemand, policy: Policy = Policy.BINPACK, *, extra: Extra | None = None
) -> Placement:
    """Choose the GPUs for every container on this node, or raise NoFit with the reason."""
    if not demand.wants_gpu:
        raise NoFit("the pod asks for no GPU share", resolvable=False)
    pre = _precheck(node, demand)
    if pre is not None:
        raise NoFit(pre.reason, resolvable=False)
    parts, reason = _solve(node, demand, _policy(demand, policy), extra=extra)
    if parts is None:
        cap, cap_reason = _solve(node, demand, _policy(demand, policy), capacity=True)
        if cap is None:
            raise NoFit(f"can never fit on {node.name}: {cap_reason}", resolvable=False)
        raise NoFit(reason)
    return Placement(
        node.name,
        tuple(AllocationPart(**dict(zip(AllocationPart.model_fields, p, strict=True))) for p in parts),  # type: ignore[arg-type]
    )
