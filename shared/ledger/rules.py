"""Pure rules of the allocation life cycle (no I/O).

States only move forward: reserved -> bound -> assigned -> released, or reserved -> failed.
`released` and `failed` are terminal. Applying a transition that is not forward is a no-op, which makes
every consumer idempotent and lets a replay apply events in any order and reach the same state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Any, Protocol, TypeVar


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
LIVE_STATE_VALUES: tuple[str, ...] = tuple(s.value for s in AllocationState if s in LIVE_STATES)  # as SQL sees them
TERMINAL_STATES: frozenset[AllocationState] = frozenset({AllocationState.RELEASED, AllocationState.FAILED})

# The allocation's timestamp each step sets (the first time it is applied): column and LedgerState field.
STAMPS: dict[AllocationState, str] = {
    AllocationState.BOUND: "bound_at",
    AllocationState.ASSIGNED: "assigned_at",
    AllocationState.RELEASED: "ended_at",
    AllocationState.FAILED: "ended_at",
}

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
    """True when moving from `current` to `new` is a forward step (so it should be applied).

    `failed` means the Binding was never made, so it only follows `reserved`; a pod that is bound
    ends with `released`.
    """
    if AllocationState(new) is AllocationState.FAILED:
        return AllocationState(current) is AllocationState.RESERVED
    return rank(new) > rank(current)


FORWARD: frozenset[tuple[str, str]] = frozenset(
    (a.value, b.value) for a in AllocationState for b in AllocationState if advances(a, b)
)
"""Every (current, new) pair that `advances`, as plain strings: a view's set lookup on its hot path (a state
and an event's kind both compare equal to their strings)."""


def is_live(state: AllocationState | str) -> bool:
    """True while an allocation holds GPU capacity."""
    return AllocationState(state) in LIVE_STATES


class ChargeablePart(Protocol):
    """Anything with the fields `gpu_charges` needs (event parts, rows, placement results), read-only."""

    @property
    def gpu_uuid(self) -> str: ...
    @property
    def container_index(self) -> int: ...
    @property
    def memory_mib(self) -> int: ...
    @property
    def compute(self) -> int: ...
    @property
    def init(self) -> bool: ...
    @property
    def sidecar(self) -> bool: ...


def effective_request(app_total: int, inits: Iterable[tuple[int, bool]]) -> int:
    """Kubernetes' effective request of one resource (component-helpers `PodRequests`).

    `app_total` is the sum over the app containers; `inits` lists the init containers in spec order as
    (amount, is_sidecar). A sidecar (`restartPolicy: Always`) starts and keeps running, so it counts for
    every later init container and beside the app containers; a regular init container runs alone after the
    sidecars before it and ends first:
    max(max over regular init i of (init_i + sidecars before i), sum of sidecars + app_total).
    """
    sidecars = peak = 0
    for amount, sidecar in inits:
        if sidecar:
            sidecars += amount
        else:
            peak = max(peak, amount + sidecars)
    return max(peak, sidecars + app_total)


def gpu_charges(parts: Iterable[ChargeablePart]) -> dict[str, tuple[int, int]]:
    """Memory and compute a pod's parts hold on each GPU: `effective_request` applied per GPU.

    App containers run together, so their shares on one GPU add up; sidecars run beside them (and beside
    every init container that starts after them); regular init containers run one at a time and reuse the
    space of what follows them.
    """
    app: dict[str, list[int]] = {}
    inits: dict[str, list[ChargeablePart]] = {}
    for part in parts:
        if part.init:
            inits.setdefault(part.gpu_uuid, []).append(part)
        else:
            cur = app.setdefault(part.gpu_uuid, [0, 0])
            cur[0] += part.memory_mib
            cur[1] += part.compute
    charges: dict[str, tuple[int, int]] = {}
    for gpu in sorted(set(app) | set(inits)):
        a = app.get(gpu, [0, 0])
        ordered = sorted(inits.get(gpu, []), key=lambda p: p.container_index)
        charges[gpu] = (
            effective_request(a[0], [(p.memory_mib, p.sidecar) for p in ordered]),
            effective_request(a[1], [(p.compute, p.sidecar) for p in ordered]),
        )
    return charges


def long_running(part: ChargeablePart) -> bool:
    """App containers and sidecars: the shares a pod holds for its whole life (regular init ones end first)."""
    return not part.init or part.sidecar


def part_kind(part: ChargeablePart) -> tuple[bool, bool]:
    """(init, sidecar): what a share is, for matching and exchanging only shares of the same kind."""
    return (part.init, part.sidecar)


class ExchangeRefused(Exception):
    """The two shares cannot be swapped (different shapes, nodes, or states)."""


def exchange_plan(first: list[Any], second: list[Any]) -> list[tuple[Any, str, int, str, int]]:
    """Pure: how to swap the GPUs of two containers' parts, or raise `ExchangeRefused`.

    Parts are paired by GPU index order; each pair must hold the same memory and compute. Returns
    (part, new_gpu_uuid, new_gpu_index, old_gpu_uuid, old_gpu_index) for every part of both containers.
    """
    if not first or not second or len(first) != len(second):
        raise ExchangeRefused("containers hold a different number of GPU shares")
    a = sorted(first, key=lambda p: p.gpu_index)
    b = sorted(second, key=lambda p: p.gpu_index)
    plan = []
    for pa, pb in zip(a, b, strict=True):
        if (pa.memory_mib, pa.compute, part_kind(pa)) != (pb.memory_mib, pb.compute, part_kind(pb)):
            raise ExchangeRefused("containers hold shares of different sizes or kinds")
        plan.append((pa, pb.gpu_uuid, pb.gpu_index, pa.gpu_uuid, pa.gpu_index))
        plan.append((pb, pa.gpu_uuid, pa.gpu_index, pb.gpu_uuid, pb.gpu_index))
    return plan


class MovablePart(Protocol):
    """A part that an exchange can move (event parts and rows alike), read-only."""

    @property
    def container(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def gpu_index(self) -> int: ...


def moved_to(allocation_id: Any, part: MovablePart, moves: Iterable[Any]) -> tuple[str, int] | None:
    """(GPU UUID, index) an exchange's `moves` send this part of `allocation_id` to, or None (pure)."""
    for move in moves:
        if move.allocation_id == allocation_id and move.container == part.container:
            if move.from_gpu_uuid == part.gpu_uuid:
                return move.to_gpu_uuid, move.to_gpu_index
    return None


class ExchangeablePart(ChargeablePart, Protocol):
    """A part `swap_shares` can move: which container holds it, and on which GPU."""

    @property
    def container(self) -> str: ...
    @property
    def gpu_index(self) -> int: ...


P = TypeVar("P", bound=ExchangeablePart)


def swap_shares(
    first: Sequence[P],
    first_container: str,
    second: Sequence[P],
    second_container: str,
    relocate: Callable[[P, str, int], P],
) -> tuple[tuple[P, ...], tuple[P, ...]]:
    """Two allocations' parts after an exchange (`ExchangedEvent`): `first_container`'s shares (among the
    parts `first`) and `second_container`'s (among `second`) trade GPUs, as `exchange_plan` pairs them and
    `shared.ledger.transitions.apply_exchange` writes them. Raises `ExchangeRefused`.

    `relocate(part, gpu_uuid, gpu_index)` makes a moved copy of a part. When both containers belong to one
    allocation, pass its parts twice: both results are then its new parts.
    """
    plan = exchange_plan(
        [p for p in first if p.container == first_container],
        [p for p in second if p.container == second_container],
    )
    moved = {id(part): (gpu_uuid, gpu_index) for part, gpu_uuid, gpu_index, _, _ in plan}

    def after(parts: Sequence[P]) -> tuple[P, ...]:
        return tuple(relocate(p, *moved[id(p)]) if id(p) in moved else p for p in parts)

    return after(first), after(second)
