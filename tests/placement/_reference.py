"""The placement solver as it was before the fast paths and caches: the reference for differential tests.

Regular init containers are placed by asking `gpu_charges` (the ledger's rule) what each candidate GPU would
be charged, rather than by the solver's running per-GPU sums: a second way to the same choices. kubelet's device
reuse (`shared.placement.reuse`, a rule like `gpu_charges`) keeps each reuse group on one set of GPUs: the first
placement when it does, else the group sets tried in the solver's order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.events.catalogue import AllocationPart
from shared.ledger.rules import gpu_charges
from shared.placement import reuse
from shared.placement.demand import ContainerDemand, PodDemand
from shared.placement.hints import Policy
from shared.placement.view import GpuView, NodeView

Extra = Mapping[str, tuple[int, int]]
# AllocationPart's fields in their order: container, index, gpu uuid, gpu index, MiB, compute, init, sidecar
_Part = tuple[str, int, str, int, int, int, bool, bool]


def _part(p: _Part) -> AllocationPart:
    return AllocationPart(**dict(zip(AllocationPart.model_fields, p, strict=True)))


def _charge_on(parts: list[_Part], gpu_uuid: str) -> tuple[int, int]:
    return gpu_charges([_part(p) for p in parts if p[2] == gpu_uuid]).get(gpu_uuid, (0, 0))


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
    kind = "sidecar container" if c.sidecar else "init container" if c.init else "container"
    return f"{kind} {c.name} needs {what} on {where}"


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
    if reuse.inexact(demand):
        return Verdict(False, False, f"gpushare cannot place this pod exactly: {reuse.inexact(demand)}")
    return None


def _solve(
    node: NodeView,
    demand: PodDemand,
    policy: Policy,
    *,
    capacity: bool = False,
    extra: Extra | None = None,
) -> tuple[list[_Part] | None, str]:
    """Place every container; returns (parts, "") or (None, reason)."""
    hints = demand.hints
    gpus = [
        g
        for g in node.gpus
        if (capacity or g.healthy) and (not hints.constrains_gpus or hints.gpu_allowed(g.uuid, g.model))
    ]
    if not gpus:
        unhealthy = sum(1 for g in node.gpus if not g.healthy)
        return None, f"all {unhealthy} matching GPU(s) on {node.name} are unhealthy"
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
    groups = reuse.reuse_groups(demand)
    parts, reason = _place({}, gpus, {u: list(v) for u, v in free.items()}, demand, policy, capacity)
    if not groups or (parts is not None and reuse.kept_together(parts, groups)):
        return parts, reason
    spread = policy is Policy.SPREAD
    ordered = sorted(gpus, key=lambda g: (-free[g.uuid][0] if spread else free[g.uuid][0], g.index))
    sets = [
        [frozenset(g.uuid for g in combo) for combo in itertools.combinations(ordered, grp[0].count)] for grp in groups
    ]
    same = [(s,) * len(groups) for s in sets[0]] if len({grp[0].count for grp in groups}) == 1 else []
    tried: list[tuple[frozenset[str], ...]] = []
    for choice in [*same, *itertools.product(*sets)]:
        if choice in tried:
            continue
        tried.append(choice)
        if len(tried) > 64:
            break
        pins = {(c.name, c.index, c.init): gpu_set for grp, gpu_set in zip(groups, choice, strict=True) for c in grp}
        pinned, _ = _place(pins, gpus, {u: list(v) for u, v in free.items()}, demand, policy, capacity)
        if pinned is not None:
            return pinned, ""
    if parts is None:
        return None, reason
    group = max(groups, key=len)
    share = "a GPU" if group[0].count == 1 else f"{group[0].count} GPUs"
    later = ", ".join(f"{c.kind} {c.name}" for c in group[1:])
    shown = _describe_free(gpus, free, any(c.compute for c in group), capacity)
    return None, (
        f"kubelet hands the GPU memory devices of init container {group[0].name} on to {later} (device reuse), so "
        f"they must share {share}, and no GPU on {node.name} has room for all of them; {shown}"
    )


def _place(
    pins: Mapping[tuple[str, int, bool], frozenset[str]], gpus: list[GpuView], free: dict[str, list[int]], *args: Any
) -> tuple[list[_Part] | None, str]:
    """The placement of every container with `pins` keeping containers on given GPUs (args: demand, policy,
    capacity)."""
    demand, policy, capacity = args
    orig = {u: (v[0], v[1]) for u, v in free.items()}
    spread = policy is Policy.SPREAD
    parts: list[_Part] = []
    steady = [*demand.containers, *(c for c in demand.init_containers if c.sidecar)]
    for c in sorted(steady, key=lambda c: (-c.memory_mib, -c.compute, c.init, c.index)):
        pin = pins.get((c.name, c.index, c.init))
        cands = [
            g
            for g in gpus
            if free[g.uuid][0] >= c.memory_mib and free[g.uuid][1] >= c.compute and (pin is None or g.uuid in pin)
        ]
        if len(cands) < c.count:
            return None, f"{_describe_need(c)}; {_describe_free(gpus, free, c.compute > 0, capacity)}"
        if spread:
            cands.sort(key=lambda g: (-free[g.uuid][0], -free[g.uuid][1], g.index))
        else:
            cands.sort(key=lambda g: (free[g.uuid][0], free[g.uuid][1], g.index))
        for g in cands[: c.count]:
            f = free[g.uuid]
            f[0] -= c.memory_mib
            f[1] -= c.compute
            parts.append((c.name, c.index, g.uuid, g.index, c.memory_mib, c.compute, c.init, c.sidecar))
    for c in demand.init_containers:
        if c.sidecar:
            continue
        now = {g.uuid: _charge_on(parts, g.uuid) for g in gpus}
        trial = {}
        alone = {}  # what the GPU holds while this init container runs: it and the sidecars started before it
        for g in gpus:
            part = (c.name, c.index, g.uuid, g.index, c.memory_mib, c.compute, True, False)
            trial[g.uuid] = _charge_on([*parts, part], g.uuid)
            alone[g.uuid] = _charge_on([*(p for p in parts if p[7] and p[1] < c.index), part], g.uuid)
        pin = pins.get((c.name, c.index, c.init))
        cands = [
            g
            for g in gpus
            if alone[g.uuid][0] <= orig[g.uuid][0]
            and alone[g.uuid][1] <= orig[g.uuid][1]
            and (pin is None or g.uuid in pin)
        ]
        if len(cands) < c.count:
            orig_view = {u: list(v) for u, v in orig.items()}
            also = " beside the sidecars started before it" if any(p[7] and p[1] < c.index for p in parts) else ""
            return None, f"{_describe_need(c)}{also}; {_describe_free(gpus, orig_view, c.compute > 0, capacity)}"

        def key(g: GpuView, now: dict = now, trial: dict = trial) -> tuple[int, ...]:
            rest = orig[g.uuid][0] - now[g.uuid][0]
            grow = (trial[g.uuid][0] - now[g.uuid][0], trial[g.uuid][1] - now[g.uuid][1])
            return (*grow, -rest if spread else rest, g.index)

        cands.sort(key=key)
        for g in cands[: c.count]:
            parts.append((c.name, c.index, g.uuid, g.index, c.memory_mib, c.compute, True, False))
    parts.sort(key=lambda p: (p[6], p[1], p[3]))
    return parts, ""


def evaluate(node: NodeView, demand: PodDemand, policy: Policy = Policy.BINPACK) -> Verdict:
    """Filter one node: fits now, full now (resolvable), or can never fit (not resolvable)."""
    if not demand.wants_gpu:
        return FITS
    pre = _precheck(node, demand)
    if pre is not None:
        return pre
    if demand.simple:
        c = demand.containers[0]
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
    parts, reason = _solve(node, demand, _policy(demand, policy))
    if parts is not None:
        return FITS
    cap, cap_reason = _solve(node, demand, _policy(demand, policy), capacity=True)
    if cap is None:
        return Verdict(False, False, f"can never fit on {node.name}: {cap_reason}")
    return Verdict(False, True, reason)


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
    if demand.simple and demand.containers[0].compute == 0:
        need = demand.containers[0].memory_mib
        for node in nodes:  # fast path: a node fits iff its freest healthy GPU has the memory
            if node.max_free_memory_mib >= need:
                ok.append(node.name)
                continue
            v = evaluate(node, demand, policy)
            (failed if v.resolvable else never)[node.name] = v.reason
        return ok, failed, never
    for node in nodes:
        v = evaluate(node, demand, policy)
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
    """(name, score) for each node, same formula as `score_node`, without per-node call overhead."""
    need = demand.memory_mib if demand.wants_gpu else 0
    binpack = _policy(demand, policy) is Policy.BINPACK
    out = []
    for node in nodes:
        total = node.healthy_memory_mib
        if total <= 0:
            out.append((node.name, 0))
            continue
        u = (node.healthy_allocated_mib + need) / total
        u = 1.0 if u > 1.0 else u
        out.append((node.name, int((10 * u if binpack else 10 * (1 - u)) + 0.5)))
    return out


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
    return Placement(node.name, tuple(_part(p) for p in parts))
