"""Preemption on one node as kube-scheduler's own preemption would choose it if it knew the GPUs (pure).

Mirrors k8s.io/kubernetes v1.37.2 `pkg/scheduler/framework/plugins/defaultpreemption/default_preemption.go`,
`SelectVictimsOnNode`, for individual pods (no pod groups): every pod on the node with a lower priority than
the preemptor is a potential victim (`isPreemptionAllowed`); if the pod does not fit with all of them gone, the
node cannot help. Otherwise they are sorted most important first (`preemption.MoreImportantVictim`: higher
priority, then the earlier start; a pod not started yet counts as starting now), split into those whose eviction
would violate a PodDisruptionBudget and the others (`disruption.violating`), and reprieved in that order, the
violating ones first: a pod is given back to the node when the preemptor still fits without it, else it is a
victim. `NumPDBViolations` is the number of violating victims.

"Fits" is the GPU rule (`plan.pick` with the victims' shares freed) and, for what kube-scheduler checked itself
(CPU, memory, ports, and `aliyun.com/gpu-mem` per node where it counts it), the victims kube-scheduler chose:
those are never reprieved. So the answer holds kube-scheduler's victims plus the GPU holders that must go too,
and it is exactly kube-scheduler's answer when its victims already free the right GPU.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from shared.placement.demand import PodDemand
from shared.placement.disruption import Budget, violating
from shared.placement.hints import Policy
from shared.placement.plan import NoFit, pick
from shared.placement.view import NodeView


@dataclass(frozen=True)
class Victim:
    """A pod on the node: what its live allocation holds on each GPU (uuid -> (MiB, compute)), its priority, when it
    started (None: not yet), and what PodDisruptionBudgets select it by."""

    uid: str
    charges: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    priority: int = 0
    started: datetime | None = None
    namespace: str = ""
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Victims:
    """The pods to evict, most important first (kube-scheduler reads the first as the highest priority), and how
    many of them violate a PodDisruptionBudget."""

    uids: tuple[str, ...]
    pdb_violations: int = 0


def _freed(victims: Sequence[Victim]) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = {}
    for v in victims:
        for uuid, (m, c) in v.charges.items():
            cur = out.setdefault(uuid, [0, 0])
            cur[0] += m
            cur[1] += c
    return {u: (m, c) for u, (m, c) in out.items()}


def _fits(node: NodeView, demand: PodDemand, policy: Policy, victims: Sequence[Victim]) -> bool:
    try:
        pick(node, demand, policy, extra=_freed(victims))
    except NoFit:
        return False
    return True


def fits_without(node: NodeView, demand: PodDemand, gone: Sequence[Victim], policy: Policy = Policy.BINPACK) -> bool:
    """Whether the pod fits on the node once `gone`'s shares are given back."""
    return _fits(node, demand, policy, gone)


def importance(victim: Victim, now: datetime) -> tuple[int, datetime, str]:
    """Sort key, most important first: higher priority, then started earlier (`MoreImportantVictim`); then UID,
    so that equal pods keep one order (kube-scheduler's sort is not stable)."""
    return (-victim.priority, victim.started or now, victim.uid)


def select_victims(
    node: NodeView,
    demand: PodDemand,
    pods: Sequence[Victim],
    *,
    preemptor_priority: int,
    required: Collection[str] = (),
    budgets: Sequence[Budget] = (),
    policy: Policy = Policy.BINPACK,
    now: datetime,
) -> Victims | None:
    """The victims on this node and their PodDisruptionBudget violations, or None when evicting every pod of lower
    priority still leaves no room on the right GPUs. `pods`: every pod on the node; `required`: the UIDs
    kube-scheduler chose (kept whatever the GPUs need)."""
    potential = sorted((p for p in pods if p.priority < preemptor_priority), key=lambda p: importance(p, now))
    if not demand.wants_gpu:
        chosen = [p for p in potential if p.uid in required]
        return Victims(tuple(p.uid for p in chosen), sum(violating(chosen, budgets)))
    if not _fits(node, demand, policy, potential):
        return None
    flags = violating(potential, budgets)
    first = [p for p, hit in zip(potential, flags, strict=True) if hit]
    then = [p for p, hit in zip(potential, flags, strict=True) if not hit]
    evicted = list(potential)  # the node as it is being tried: these are gone
    victims: list[Victim] = []
    violations = 0
    for group, counts in ((first, True), (then, False)):
        for pod in group:
            evicted.remove(pod)
            if pod.uid not in required and _fits(node, demand, policy, evicted):
                continue  # reprieved
            evicted.append(pod)
            victims.append(pod)
            violations += counts
    if first and then:  # as kube-scheduler does: most important first again
        victims.sort(key=lambda p: importance(p, now))
    return Victims(tuple(p.uid for p in victims), violations)
