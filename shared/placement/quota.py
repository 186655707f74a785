"""Namespace quotas on GPU memory and compute."""

from __future__ import annotations

from shared.placement.demand import PodDemand


def quota_refusal(
    demand: PodDemand,
    used: tuple[int, int],
    quota: tuple[int | None, int | None] | None,
) -> str | None:
    """Why the pod would exceed its namespace quota (`used` = live memory MiB, compute), or None."""
    if quota is None or not demand.wants_gpu:
        return None
    limit_memory, limit_compute = quota
    if limit_memory is not None and used[0] + demand.memory_mib > limit_memory:
        return (
            f"namespace {demand.namespace} GPU memory quota {limit_memory} MiB would be exceeded: "
            f"{used[0]} MiB in use, pod needs {demand.memory_mib} MiB"
        )
    if limit_compute is not None and used[1] + demand.compute > limit_compute:
        return (
            f"namespace {demand.namespace} GPU compute quota {limit_compute}% would be exceeded: "
            f"{used[1]}% in use, pod needs {demand.compute}%"
        )
    return None
