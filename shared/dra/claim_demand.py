"""What a gpushare ResourceClaim can take at most, counted when it is created (pure: claim spec in, MiB and % out).

gpushare admission counts a claim against its namespace's GiB quota before kube-scheduler allocates it, so it counts
what the allocation can consume at most, by the rules kube-scheduler allocates with (`calculateConsumedCapacity`,
`roundUpRange` in dynamic-resource-allocation@v0.37.2 structured/internal/incubating/consumable_capacity.go) over
the request policies every gpushare device publishes (`shared.dra.slices`):

* `memory`: a request is rounded up to whole units of `GPUSHARE_RESOURCE_MEMORY_UNIT` (`min` one unit, `step` one
  unit); a request that names no memory takes the whole GPU (`default`), counted as the largest GPU the ledger
  knows on a DRA node;
* `compute`: rounded up to whole percent; a request that names none takes none;
* a request takes `count` devices (`allocationMode: ExactCount`, 1 by default); `allocationMode: All` takes a
  number of GPUs nobody knows at creation and is refused in a namespace with a quota;
* `firstAvailable`: the largest of its gpushare alternatives (which one kube-scheduler picks is not known yet).

Requests of other device classes count nothing: they are not gpushare's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from shared.dra import COMPUTE, DEVICE_CLASS, MEMORY
from shared.dra.quantity import QuantityError, parse_quantity
from shared.settings import MemoryUnit

MIB = 2**20


class ClaimDemandError(ValueError):
    """A claim whose largest possible allocation cannot be counted (the message says why and what to write)."""


@dataclass(frozen=True)
class ClaimDemand:
    """The most a claim's gpushare requests can consume: MiB of GPU memory and % of compute, summed over devices."""

    memory_mib: int
    compute: int
    devices: int


def asks_gpushare(claim: Mapping[str, Any], device_class: str = DEVICE_CLASS) -> bool:
    """Whether any request of the claim (or of its `firstAvailable` alternatives) asks the gpushare class."""
    return any(_ours(option, device_class) for request in _requests(claim) for option in _options(request))


def asks_whole_gpu(claim: Mapping[str, Any], device_class: str = DEVICE_CLASS) -> bool:
    """Whether a gpushare request (or alternative) names no memory: it takes a whole GPU, of a size not known yet."""
    for request in _requests(claim):
        for option in _options(request):
            capacity = option.get("capacity")
            wanted = capacity.get("requests") if isinstance(capacity, Mapping) else None
            if _ours(option, device_class) and not (isinstance(wanted, Mapping) and MEMORY in wanted):
                return True
    return False


def claim_demand(
    claim: Mapping[str, Any], unit: MemoryUnit, whole_gpu_mib: int, device_class: str = DEVICE_CLASS
) -> ClaimDemand:
    """The most the claim's gpushare requests can consume. `whole_gpu_mib`: what a request without memory takes
    (the largest GPU on a DRA node). Raises ClaimDemandError."""
    memory = compute = devices = 0
    for request in _requests(claim):
        name = str(request.get("name") or "")
        counted = [_option(name, o, unit, whole_gpu_mib) for o in _options(request) if _ours(o, device_class)]
        if counted:  # each at its largest over the alternatives
            memory += max(c[0] for c in counted)
            compute += max(c[1] for c in counted)
            devices += max(c[2] for c in counted)
    return ClaimDemand(memory, compute, devices)


def _requests(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    spec = claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    return [r for r in requests if isinstance(r, dict)] if isinstance(requests, list) else []


def _options(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    exactly = request.get("exactly")
    alternatives = request.get("firstAvailable")
    out = [exactly] if isinstance(exactly, dict) else []
    if isinstance(alternatives, list):
        out += [a for a in alternatives if isinstance(a, dict)]
    return out


def _ours(option: Mapping[str, Any], device_class: str) -> bool:
    return option.get("deviceClassName") == device_class


def _option(request: str, option: Mapping[str, Any], unit: MemoryUnit, whole_gpu_mib: int) -> tuple[int, int, int]:
    """(MiB, %, devices) one request alternative can take."""
    label = f"request {request}" + (f"/{option['name']}" if option.get("name") else "")
    mode = option.get("allocationMode") or "ExactCount"
    if mode == "All":
        raise ClaimDemandError(
            f"{label}: allocationMode All takes every matching GPU, which cannot be counted against the namespace's "
            "GPU quota when the claim is created; ask for `count` GPUs instead"
        )
    count = option.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ClaimDemandError(f"{label}: count {count!r} is not a positive whole number")
    capacity = option.get("capacity")
    wanted = capacity.get("requests") if isinstance(capacity, Mapping) else None
    wanted = wanted if isinstance(wanted, Mapping) else {}
    mib = whole_gpu_mib if MEMORY not in wanted else _memory_mib(label, wanted[MEMORY], unit)
    pct = 0 if COMPUTE not in wanted else _compute(label, wanted[COMPUTE])
    return count * mib, count * pct, count


def _memory_mib(label: str, raw: Any, unit: MemoryUnit) -> int:
    try:
        amount = parse_quantity(raw)
    except QuantityError as exc:
        raise ClaimDemandError(f"{label}: capacity.requests.memory {exc}") from None
    if amount <= 0:
        raise ClaimDemandError(f"{label}: capacity.requests.memory {raw} is not positive")
    units = math.ceil(amount / Decimal(unit.mib * MIB))  # rounded up to the policy's step; at least `min`, one unit
    return max(1, units) * unit.mib


def _compute(label: str, raw: Any) -> int:
    try:
        amount = parse_quantity(raw)
    except QuantityError as exc:
        raise ClaimDemandError(f"{label}: capacity.requests.compute {exc}") from None
    if amount < 0:
        raise ClaimDemandError(f"{label}: capacity.requests.compute {raw} is negative")
    return math.ceil(amount)
