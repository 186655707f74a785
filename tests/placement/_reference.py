"""An independent reference for the placement solver: exhaustive search over small instances.

It shares nothing with `shared.placement.plan` but the facts a placement must respect: every container gets
`count` distinct GPUs (healthy ones, allowed by the pod's hints, unless `capacity` asks whether the pod could
ever fit), each holding its share, and what the pod then holds on each GPU, by Kubernetes' effective-request rule
(`shared.ledger.rules.gpu_charges`, the rule the ledger charges), fits the GPU's free memory and compute; and
the containers kubelet hands the same devices (a regular init container's reuse group, `shared.placement.reuse`,
a rule like `gpu_charges`) hold the same GPUs, while a pod kubelet cannot be predicted for has no placement at all.
Every assignment of every container to GPUs is tried, so the reference knows whether a placement exists at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from shared.ledger.rules import effective_request, gpu_charges
from shared.placement import GpuView, NodeView, Policy, reuse
from shared.placement.demand import ContainerDemand, PodDemand


class Share(NamedTuple):
    """One container's share of one GPU (what `gpu_charges` reads)."""

    container: str
    container_index: int
    init: bool
    sidecar: bool
    gpu_uuid: str
    memory_mib: int
    compute: int


def containers(demand: PodDemand) -> list[ContainerDemand]:
    """Every container that asks for a share: app containers, then init containers (sidecars among them)."""
    return [*demand.containers, *demand.init_containers]


def usable(node: NodeView, demand: PodDemand, *, capacity: bool = False) -> list[GpuView]:
    """The GPUs a placement may use: healthy ones (any, with `capacity`) that the pod's hints allow; none when the
    node's CUDA is older than the pod asks or unknown."""
    need = demand.hints.min_cuda
    if need is not None and (node.cuda is None or node.cuda < need):
        return []
    hints = demand.hints
    return [
        g
        for g in node.gpus
        if (capacity or g.healthy) and (not hints.constrains_gpus or hints.gpu_allowed(g.uuid, g.model))
    ]


def room(g: GpuView, *, capacity: bool = False) -> tuple[int, int]:
    """(MiB, compute) the pod may take on the GPU: all of it with `capacity`, else what is free."""
    return (g.memory_mib, g.compute_units) if capacity else (g.free_memory_mib, g.free_compute)


def charges(shares: Iterable[Share]) -> dict[str, tuple[int, int]]:
    """What the pod holds on each GPU (the ledger's rule)."""
    return gpu_charges(shares)


def fits(shares: Sequence[Share], gpus: Sequence[GpuView], *, capacity: bool = False) -> bool:
    """True when what the shares hold on each GPU fits it (and every share is on one of `gpus`)."""
    by_uuid = {g.uuid: g for g in gpus}
    for uuid, (memory, compute) in charges(shares).items():
        g = by_uuid.get(uuid)
        if g is None:
            return False
        free_memory, free_compute = room(g, capacity=capacity)
        if memory > free_memory or compute > free_compute:
            return False
    return True


def assignments(node: NodeView, demand: PodDemand, *, capacity: bool = False) -> Iterator[list[Share]]:
    """Every placement of the pod on the node that fits, in no particular order."""
    gpus = usable(node, demand, capacity=capacity)
    if demand.init_containers and reuse.inexact(demand):
        return
    groups = reuse.reuse_groups(demand) if demand.init_containers else ()
    assert len({g.uuid for g in gpus}) == len(gpus), "GPUs sharing a UUID cannot be told apart by their shares"
    wanted = containers(demand)
    choices = [itertools.combinations(gpus, c.count) for c in wanted]
    for chosen in itertools.product(*choices):
        on_gpus = {
            (c.name, c.index, c.init): frozenset(g.uuid for g in on) for c, on in zip(wanted, chosen, strict=True)
        }
        if any(len({on_gpus[(c.name, c.index, c.init)] for c in group}) > 1 for group in groups):
            continue  # kubelet would hand this group's containers the same devices
        shares = [
            Share(c.name, c.index, c.init, c.sidecar, g.uuid, c.memory_mib, c.compute)
            for c, on in zip(wanted, chosen, strict=True)
            for g in on
        ]
        if fits(shares, gpus, capacity=capacity):
            yield shares


def exists(node: NodeView, demand: PodDemand, *, capacity: bool = False) -> bool:
    """True when some placement of the pod fits the node (now, or with `capacity` ever)."""
    return next(assignments(node, demand, capacity=capacity), None) is not None


def score(node: NodeView, demand: PodDemand, policy: Policy) -> int:
    """The documented score: u = (MiB allocated on healthy GPUs + the pod's effective MiB) / MiB of healthy GPUs,
    binpack round(10 u), spread round(10 (1 - u)); 0 for a node without healthy memory."""
    healthy = [g for g in node.gpus if g.healthy]
    total = sum(g.memory_mib for g in healthy)
    if total <= 0:
        return 0
    pod = effective_request(
        sum(c.memory_mib * c.count for c in demand.containers),
        [(c.memory_mib * c.count, c.sidecar) for c in demand.init_containers],
    )
    used = sum(min(g.allocated_memory_mib, g.memory_mib) for g in healthy) + pod
    u = min(1.0, used / total)
    if (demand.hints.policy or policy) is Policy.SPREAD:
        u = 1 - u
    return int(10 * u + 0.5)
