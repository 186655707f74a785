"""Pure rules of the allocation life cycle (no I/O).

States only move forward: reserved -> bound -> assigned -> released, or reserved/bound -> failed.
`released` and `failed` are terminal. Applying a transition that is not forward is a no-op, which makes
every consumer idempotent and lets a replay apply events in any order and reach the same state.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Protocol


class AllocationState(StrEnum):
    """Where an allocation is in its life."""

    RESERVED = "reserved"
    BOUND = "bound"
    ASSIGNED = "assigned"
    RELEASED = "released"
    FAILED = "failed"


LIVE_STATES: frozenset[AllocationState] = frozenset(
    {AllocationState.RESERVED, AllocationState.BOUND, AllocationState.ASSIGNED}
)
TERMINAL_STATES: frozenset[AllocationState] = frozenset({AllocationState.RELEASED, AllocationState.FAILED})

_RANK = {
    AllocationState.RESERVED: 1,
    AllocationState.BOUND: 2,
    AllocationState.ASSIGNED: 3,
    AllocationState.RELEASED: 4,
    AllocationState.FAILED: 4,
}


def rank(state: AllocationState | str) -> int:
    """Position of a state in the life cycle (terminal states share the highest rank)."""
    return _RANK[AllocationState(state)]


def advances(current: AllocationState | str, new: AllocationState | str) -> bool:
    """True when moving from `current` to `new` is a forward step (so it should be applied)."""
    return rank(new) > rank(current)


def is_live(state: AllocationState | str) -> bool:
    """True while an allocation holds GPU capacity."""
    return AllocationState(state) in LIVE_STATES


class ChargeablePart(Protocol):
    """Anything with the fields `gpu_charges` needs (event parts, rows, placement results)."""

    gpu_uuid: str
    memory_mib: int
    compute: int
    init: bool


def gpu_charges(parts: Iterable[ChargeablePart]) -> dict[str, tuple[int, int]]:
    """Memory and compute a pod's parts hold on each GPU.

    App containers run together, so their shares on one GPU add up; init containers run one at a time
    before them, so a GPU holds the larger of (the biggest init share, the sum of app shares): Kubernetes'
    effective-request rule, applied per GPU.
    """
    app: dict[str, list[int]] = {}
    init: dict[str, list[int]] = {}
    for part in parts:
        if part.init:
            cur = init.setdefault(part.gpu_uuid, [0, 0])
            cur[0], cur[1] = max(cur[0], part.memory_mib), max(cur[1], part.compute)
        else:
            cur = app.setdefault(part.gpu_uuid, [0, 0])
            cur[0] += part.memory_mib
            cur[1] += part.compute
    charges: dict[str, tuple[int, int]] = {}
    for gpu in sorted(set(app) | set(init)):
        a, i = app.get(gpu, [0, 0]), init.get(gpu, [0, 0])
        charges[gpu] = (max(a[0], i[0]), max(a[1], i[1]))
    return charges
