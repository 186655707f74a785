"""kubelet's device reuse, as counts: which containers of a pod kubelet will hand the same GPUs (pure).

kubelet's device manager allocates a pod's containers at admission, init containers first, then app containers,
each in spec order (`ManagerImpl.Allocate`, k8s.io/kubernetes pkg/kubelet/cm/devicemanager/manager.go, called by the
topology manager for `append(pod.Spec.InitContainers, pod.Spec.Containers...)`). It keeps a per-pod set of reusable
devices (`devicesToReuse`): `devicesToAllocate` takes a container's devices from it first (in Go's set order, which
is arbitrary), and only the rest from free devices (asking the plugin's GetPreferredAllocation); afterwards a
regular init container's devices are added to the set (`podDevices.addContainerAllocatedResources`), an app
container's or a sidecar's taken out of it (`removeContainerAllocatedResources`; a sidecar's since 1.29, before
which there were no sidecars). 1.20 does the same.

So a regular GPU init container and the containers allocated while the pool it started is not empty form a
*reuse group*: each of them takes gpu-mem devices that lie on the GPUs of the one before, and the node agent refuses
an Allocate whose devices lie elsewhere than the container's reservation. The placement must put a group's
containers on the same GPUs. With one GPU per container that is always exact. With several, kubelet's pick from the
pool is exact only when it takes the whole pool (a part of it is an arbitrary subset, possibly all on one GPU), and
only when every container of the group spans the same number of GPUs; other pods are refused (`inexact`).

Pool sizes are counted in MiB: a container's gpu-mem devices are its memory in the configured unit, and the pool
arithmetic only compares them. Containers that ask for no memory take no gpu-mem devices and are not in any group.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.placement.demand import ContainerDemand, PodDemand


def allocation_order(demand: PodDemand) -> list[ContainerDemand]:
    """The pod's GPU containers in the order kubelet allocates them: init containers, then app containers, each
    in spec order."""
    return [
        *sorted(demand.init_containers, key=lambda c: c.index),
        *sorted(demand.containers, key=lambda c: c.index),
    ]


def reuse_groups(demand: PodDemand) -> tuple[tuple[ContainerDemand, ...], ...]:
    """The pod's reuse groups of two or more containers, each in allocation order (a regular init container first):
    the containers that kubelet hands devices along and that must therefore share GPUs."""
    groups: list[list[ContainerDemand]] = []
    pool = 0  # MiB of devices in devicesToReuse
    for c in allocation_order(demand):
        need = c.total_memory_mib
        if need <= 0:
            continue
        regular_init = c.init and not c.sidecar
        if pool > 0:
            groups[-1].append(c)
        elif regular_init:
            groups.append([c])
        if regular_init:
            pool = max(pool, need)  # what it took from the pool, plus its own new devices
        else:
            pool -= min(pool, need)
    return tuple(tuple(g) for g in groups if len(g) > 1)


def inexact(demand: PodDemand) -> str:
    """Why kubelet cannot be predicted for this pod's GPU containers ('' when it can): a reuse group whose containers
    span different numbers of GPUs, or in which a container takes part of a pool that spans several GPUs."""
    for group in reuse_groups(demand):
        first = group[0]
        counts = {c.count for c in group}
        if len(counts) > 1:
            return (
                f"kubelet hands the GPU memory devices of init container {first.name} on to "
                f"{_names(group[1:])} (device reuse), so they must hold the same GPUs, but they ask for different "
                f"numbers of GPUs ({_counts(group)}); give them the same aliyun.com/gpu-count"
            )
        if first.count > 1:
            partial = _partial_take(group)
            if partial is not None:
                return (
                    f"kubelet hands {partial.kind} {partial.name} part of the GPU memory devices that init container "
                    f"{first.name} holds on {first.count} GPUs, picked in no set order, so no placement can tell on "
                    f"which of them it lands; give {partial.name} at least as much aliyun.com/gpu-mem as the pool "
                    "it draws from, or ask for one GPU per container"
                )
    return ""


def _partial_take(group: Sequence[ContainerDemand]) -> ContainerDemand | None:
    """The first container of a group that takes less than the whole pool, or None."""
    pool = 0
    for c in group:
        need = c.total_memory_mib
        if 0 < pool and need < pool:
            return c
        if c.init and not c.sidecar:
            pool = max(pool, need)
        else:
            pool -= min(pool, need)
    return None


def kept_together(parts: Sequence[tuple], groups: Sequence[Sequence[ContainerDemand]]) -> bool:
    """Whether a placement (parts as `plan` writes them: container, index, GPU UUID, ..., init flag at 6) puts the
    containers of each group on the same GPUs."""
    for group in groups:
        sets = {frozenset(p[2] for p in parts if p[0] == c.name and p[1] == c.index and p[6] == c.init) for c in group}
        if len(sets) > 1:
            return False
    return True


def _names(containers: Sequence[ContainerDemand]) -> str:
    return ", ".join(f"{c.kind} {c.name}" for c in containers)


def _counts(containers: Sequence[ContainerDemand]) -> str:
    return ", ".join(f"{c.name}: {c.count}" for c in containers)
