"""Read-only views of nodes and their GPUs, with per-node summaries computed once."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.placement.hints import HintError, parse_version

_SHAPES: dict[tuple, _Shape] = {}
_SHAPES_MAX = 100_000


class _Shape:
    """An interned node shape: per GPU (index, healthy, memory, compute units, free memory, free compute).

    Nodes with equal shapes get the same object, so caches keyed by it hash by identity (cheap) and still
    mean "every node with this capacity layout"; see `shared.placement.plan`.
    """

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key


def _intern(key: tuple) -> _Shape:
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()  # only costs cache hits: caches hold their own references
        shape = _SHAPES.setdefault(key, _Shape(key))
    return shape


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU: its capacity and what live allocations hold of it (MiB, compute units)."""

    uuid: str
    index: int
    memory_mib: int
    allocated_memory_mib: int = 0
    compute_units: int = 100
    allocated_compute: int = 0
    model: str = ""
    healthy: bool = True

    @property
    def free_memory_mib(self) -> int:
        """Free memory, never negative (a GPU holding more than it has is simply full)."""
        return max(0, self.memory_mib - self.allocated_memory_mib)

    @property
    def free_compute(self) -> int:
        """Free compute units, never negative."""
        return max(0, self.compute_units - self.allocated_compute)


@dataclass(frozen=True)
class NodeView:
    """A node's GPUs (sorted by index) and summaries used by the fast paths of filter and score."""

    name: str
    gpus: tuple[GpuView, ...] = ()
    cuda_version: str = ""
    # summaries (computed in __post_init__)
    free_pairs: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    max_free_memory_mib: int = field(init=False, repr=False, compare=False)
    max_free_index: int = field(init=False, repr=False, compare=False)
    max_capacity_mib: int = field(init=False, repr=False, compare=False)
    healthy_memory_mib: int = field(init=False, repr=False, compare=False)
    healthy_allocated_mib: int = field(init=False, repr=False, compare=False)
    cuda: tuple[int, ...] | None = field(init=False, repr=False, compare=False)
    free_memory_desc: tuple[int, ...] = field(init=False, repr=False, compare=False)
    shape: _Shape | None = field(init=False, repr=False, compare=False)
    score_key: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        gpus = tuple(sorted(self.gpus, key=lambda g: g.index))
        healthy = [g for g in gpus if g.healthy]
        pairs = tuple((g.free_memory_mib, g.free_compute) for g in healthy)
        try:
            cuda = parse_version(self.cuda_version) if self.cuda_version else None
        except HintError:
            cuda = None
        s = object.__setattr__
        s(self, "gpus", gpus)
        s(self, "free_pairs", pairs)
        best = max(healthy, key=lambda g: (g.free_memory_mib, -g.index), default=None)
        s(self, "max_free_memory_mib", best.free_memory_mib if best else 0)
        s(self, "max_free_index", best.index if best else -1)
        s(self, "max_capacity_mib", max((g.memory_mib for g in gpus), default=0))
        s(self, "healthy_memory_mib", sum(g.memory_mib for g in healthy))
        s(self, "healthy_allocated_mib", sum(min(g.allocated_memory_mib, g.memory_mib) for g in healthy))
        s(self, "cuda", cuda)
        s(self, "free_memory_desc", tuple(sorted((m for m, _ in pairs), reverse=True)))
        distinct = len({g.uuid for g in gpus}) == len(gpus)  # duplicate UUIDs: no shared shape, no fast path
        key = tuple(
            (g.index, g.healthy, g.memory_mib, g.compute_units, g.free_memory_mib, g.free_compute) for g in gpus
        )
        s(self, "shape", _intern(key) if distinct else None)
        # (healthy allocated, healthy memory) as one int, all a node's score depends on (None: out of range)
        total, used = self.healthy_memory_mib, self.healthy_allocated_mib
        s(self, "score_key", (used << 42) + total if 0 <= total < 1 << 42 else None)

    def gpu(self, uuid: str) -> GpuView | None:
        """The GPU with this UUID, if the node has it."""
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        return None
