"""Pure rules for a GPU's row in the ledger (no I/O): what an inventory report or a health report makes of it,
and whether placement may use it.

The ledger's tables (`shared.ledger.inventory`), the ledger folded from the stream (`LedgerState`) and the
extender's view (`services.extender.view`) all apply these functions, so they cannot tell different stories
about one GPU. What a GPU holds (its allocated memory and compute) follows `shared.ledger.rules.gpu_charges`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

AGENT_UNHEALTHY = "reported unhealthy by the node agent"
MEMORY_BELOW_ALLOCATED = "reported memory below allocated memory"
COMPUTE_BELOW_ALLOCATED = "reported compute below allocated compute"


class ReportedGpu(Protocol):
    """What a node agent reports about one GPU (`shared.events.catalogue.GpuInfo`)."""

    memory_mib: int
    memory_total_mib: int
    compute_units: int
    healthy: bool


class Known(Protocol):
    """A GPU as the ledger already holds it (a row, a `LedgerState` GPU, a view's GPU): its capacity and what its
    live allocations take."""

    memory_mib: int
    memory_total_mib: int
    compute_units: int
    allocated_memory_mib: int
    allocated_compute: int


class Recorded(NamedTuple):
    """What the ledger records for a reported GPU."""

    memory_mib: int
    memory_total_mib: int
    compute_units: int
    healthy: bool
    health_reason: str

    @property
    def below_allocated(self) -> bool:
        """True when the report was refused in some dimension because allocations hold more than it offers."""
        return not self.healthy and self.health_reason != AGENT_UNHEALTHY


def recorded(info: ReportedGpu, held: Known | None) -> Recorded:
    """The capacity and health the ledger records when an inventory reports `info` for a GPU it holds as `held`
    (None: a GPU the ledger does not know yet).

    A GPU that reports less memory, or fewer compute units, than its live allocations hold keeps its previous
    capacity in that dimension and is marked unhealthy: the allocations stay counted (the ledger's CHECKs hold),
    no new share lands on it, and a later report with the capacity back, or a health event, clears it.
    Otherwise the report is taken as it is.
    """
    memory, memory_total, compute = info.memory_mib, info.memory_total_mib, info.compute_units
    reasons = []
    if held is not None:
        if held.allocated_memory_mib > memory:
            memory, memory_total = held.memory_mib, held.memory_total_mib
            reasons.append(MEMORY_BELOW_ALLOCATED)
        if held.allocated_compute > compute:
            compute = held.compute_units
            reasons.append(COMPUTE_BELOW_ALLOCATED)
    if reasons:
        return Recorded(memory, memory_total, compute, False, "; ".join(reasons))
    return Recorded(memory, memory_total, compute, info.healthy, "" if info.healthy else AGENT_UNHEALTHY)


def health_applies(gpu_node: str, event_node: str) -> bool:
    """A health event changes a GPU only when it comes from the node the ledger holds the GPU on."""
    return gpu_node == event_node


def health_reason(healthy: bool, reason: str) -> str:
    """The reason recorded with a health event's verdict (none for a healthy GPU)."""
    return "" if healthy else reason


def schedulable(healthy: bool, retired: bool) -> bool:
    """True when a reservation may put a new share on the GPU (given room: `allocated + share <= capacity`)."""
    return healthy and not retired
