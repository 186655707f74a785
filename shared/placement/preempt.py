"""Preemption: which of kube-scheduler's candidate victims must go so the pod fits on the right GPUs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from shared.placement.demand import PodDemand
from shared.placement.hints import Policy
from shared.placement.plan import NoFit, pick
from shared.placement.view import NodeView

EXACT_LIMIT = 10


@dataclass(frozen=True)
class Victim:
    """A candidate victim and what its live allocation holds on each GPU (uuid -> (MiB, compute))."""

    uid: str
    charges: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    priority: int = 0


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


def select_victims(
    node: NodeView,
    demand: PodDemand,
    candidates: Sequence[Victim],
    policy: Policy = Policy.BINPACK,
) -> tuple[str, ...] | None:
    """The UIDs of a minimal set of GPU-holding candidates whose eviction lets the pod fit, or None.

    Only candidates holding a share of this node's GPUs are considered (evicting others frees no GPU).
    With up to EXACT_LIMIT such candidates the set has the fewest victims (ties: lowest priority, then
    least memory); beyond that a greedy choice is pruned until no victim can be spared.
    Returns () when the pod already fits.
    """
    if not demand.wants_gpu:
        return ()
    uuids = {g.uuid for g in node.gpus}
    holders = [v for v in candidates if any(u in uuids and (m or c) for u, (m, c) in v.charges.items())]
    holders.sort(key=lambda v: (v.priority, sum(m for m, _ in v.charges.values()), v.uid))
    if _fits(node, demand, policy, ()):
        return ()
    if not _fits(node, demand, policy, holders):
        return None
    if len(holders) <= EXACT_LIMIT:
        for k in range(1, len(holders) + 1):
            for combo in combinations(holders, k):
                if _fits(node, demand, policy, combo):
                    return tuple(v.uid for v in combo)
    chosen: list[Victim] = []
    for v in holders:
        chosen.append(v)
        if _fits(node, demand, policy, chosen):
            break
    for v in list(reversed(chosen)):
        rest = [x for x in chosen if x is not v]
        if _fits(node, demand, policy, rest):
            chosen = rest
    return tuple(v.uid for v in chosen)
