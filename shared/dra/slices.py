"""The ResourceSlice a DRA node publishes: one device per GPU, shared through consumable capacity (pure).

A node's GPUs are one pool named after the node, in one slice. Each GPU is a device that several claims may
share (`allowMultipleAllocations`), with two capacities whose request policies make kube-scheduler count as the
ledger counts:

* `memory`: the ledger's schedulable memory (`gpus.memory_mib`, whole resource units); a request is rounded up
  to whole units (`validRange.step`), at least one unit, and a request that names no memory takes the whole GPU
  (`default`);
* `compute`: the GPU's compute units (100); whole percent, and a request that names none takes none.

By default a device carries no binding condition: kube-scheduler's allocator keeps every device within its
capacity, binds the pod as soon as PreBind wrote the claim's allocation, and the binder records that allocation
in the ledger from its claim watch (the node agent prepares no claim the ledger does not hold). A node pool whose
nodes carry the label `gpushare.io/dra-gate=ledger` (`GATE_LABEL`) publishes the binding condition
`gpushare.io/LedgerReserved` and the failure condition `gpushare.io/LedgerRefused` on every device instead:
kube-scheduler then binds a pod only once the binder recorded its allocation (the gate; kube-scheduler 1.37.2 polls
it every 5 s, docs/dra.md). An unhealthy GPU carries the taint `gpushare.io/unhealthy` (NoSchedule).

Field rules (ResourceSlice validation of v1.37.2, `pkg/apis/resource/validation`): a device name is a DNS label;
a request policy needs `allowMultipleAllocations`; `default` and `max` lie on `min + n * step`; `min + step` may
not exceed the capacity; at most 128 devices in a slice, 64 once a device has taints.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from shared.dra import COMPUTE, DRIVER, MEMORY, REFUSED_CONDITION, RESERVED_CONDITION, UNHEALTHY_TAINT
from shared.dra.quantity import mib_quantity
from shared.events.catalogue import GpuInfo
from shared.settings import MemoryUnit

GATE_LABEL = "gpushare.io/dra-gate"
GATE_VALUE = "ledger"
"""The node label that makes a DRA node's devices carry the ledger's binding conditions (a gated node pool)."""
MAX_DEVICES_WITH_TAINTS = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures; an unhealthy GPU makes a slice tainted
_LABEL = re.compile(r"[^a-z0-9-]+")


class SliceError(ValueError):
    """An inventory that cannot be published as one slice (the message says why)."""


def device_name(gpu_uuid: str) -> str:
    """The device name of a GPU: its UUID lower-cased, as a DNS label (`GPU-3F1C...` -> `gpu-3f1c...`)."""
    name = _LABEL.sub("-", gpu_uuid.lower()).strip("-")[:63].strip("-")
    if not name:
        raise SliceError(f"GPU UUID {gpu_uuid!r} gives no device name")
    return name


def slice_name(node: str) -> str:
    """The node's ResourceSlice name (one per node)."""
    return f"{node}-{DRIVER}"


def semver(version: str) -> str | None:
    """A driver or CUDA version as the semantic version a `version` attribute needs (`12.2` -> `12.2.0`,
    `535.104.05` -> `535.104.5`), or None when it has no numeric form."""
    parts = re.findall(r"\d+", version or "")
    if not parts or not re.fullmatch(r"\d+(\.\d+){0,2}", version.strip()):
        return None
    numbers = [str(int(p)) for p in parts[:3]]
    return ".".join(numbers + ["0"] * (3 - len(numbers)))


def memory_policy(memory_mib: int, unit: MemoryUnit) -> dict[str, Any]:
    """The `memory` capacity: whole units, at least one, the whole GPU by default."""
    value = mib_quantity(memory_mib)
    step = mib_quantity(unit.mib)
    valid_range: dict[str, str] = {"min": step}
    if memory_mib >= 2 * unit.mib:  # validation: min + step must not exceed the capacity
        valid_range["step"] = step
    else:
        valid_range["max"] = value
    return {"value": value, "requestPolicy": {"default": value, "validRange": valid_range}}


def compute_policy(compute_units: int) -> dict[str, Any]:
    """The `compute` capacity: whole percent, none by default."""
    return {
        "value": str(compute_units),
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": str(compute_units), "step": "1"}},
    }


def gated(node_labels: dict[str, str] | None) -> bool:
    """Whether a node's labels put it in a gated pool (its devices carry the ledger's binding conditions)."""
    return (node_labels or {}).get(GATE_LABEL) == GATE_VALUE


def gpu_device(
    gpu: GpuInfo, unit: MemoryUnit, *, driver_version: str = "", cuda_version: str = "", gate: bool = False
) -> dict[str, Any]:
    """One GPU as a slice device (`gate`: with the ledger's binding conditions)."""
    attributes: dict[str, Any] = {
        "uuid": {"string": gpu.uuid},
        "index": {"int": gpu.index},
        "model": {"string": gpu.model or "unknown"},
    }
    if gpu.numa_node is not None:
        attributes["numaNode"] = {"int": gpu.numa_node}
    if gpu.pci_bus_id:
        attributes["pciBusID"] = {"string": gpu.pci_bus_id}
    for name, raw in (("driverVersion", driver_version), ("cudaVersion", cuda_version)):
        version = semver(raw)
        if version is not None:
            attributes[name] = {"version": version}
    device: dict[str, Any] = {
        "name": device_name(gpu.uuid),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {MEMORY: memory_policy(gpu.memory_mib, unit), COMPUTE: compute_policy(gpu.compute_units)},
    }
    if gate:
        device["bindingConditions"] = [RESERVED_CONDITION]
        device["bindingFailureConditions"] = [REFUSED_CONDITION]
    if not gpu.healthy:
        device["taints"] = [{"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}]
    return device


def slice_spec(
    node: str,
    gpus: Sequence[GpuInfo],
    unit: MemoryUnit,
    *,
    generation: int,
    driver_version: str = "",
    cuda_version: str = "",
    gate: bool = False,
) -> dict[str, Any]:
    """The slice's `spec`: the node's pool at `generation`, one device per GPU that can hold a share (`gate`: a
    gated pool's devices, with the ledger's binding conditions).

    A GPU with less than one unit of schedulable memory cannot hold a share and is left out. Raises
    `SliceError` for more GPUs than one slice may carry, or two GPUs with one device name.
    """
    usable = sorted((g for g in gpus if g.memory_mib >= unit.mib), key=lambda g: g.index)
    if len(usable) > MAX_DEVICES_WITH_TAINTS:
        raise SliceError(f"{len(usable)} GPUs on {node}: one slice carries at most {MAX_DEVICES_WITH_TAINTS}")
    devices = [gpu_device(g, unit, driver_version=driver_version, cuda_version=cuda_version, gate=gate) for g in usable]
    names = [d["name"] for d in devices]
    if len(set(names)) != len(names):
        raise SliceError(f"two GPUs of {node} have the same device name: {sorted(names)}")
    return {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": devices,
    }


def resource_slice(node: str, node_uid: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The whole ResourceSlice object, owned by its Node (deleted with it)."""
    owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node), "ownerReferences": [owner] if node_uid else []},
        "spec": spec,
    }


def next_generation(current: dict[str, Any] | None, devices: list[dict[str, Any]]) -> tuple[int, bool]:
    """(the pool generation to publish, whether the slice must be written) given the slice as stored now:
    the same devices keep the generation, any change of the inventory raises it by one."""
    if current is None:
        return 1, True
    spec = current.get("spec") or {}
    generation = int((spec.get("pool") or {}).get("generation") or 0)
    if _comparable(spec.get("devices") or []) == _comparable(devices):
        return generation, False
    return generation + 1, True


def _comparable(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Devices without what the API server adds (a taint's `timeAdded`), for comparing stored and desired."""
    out = []
    for d in devices:
        d = dict(d)
        if d.get("taints"):
            d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]
        out.append(d)
    return out


def device_to_gpu(gpu_uuids: Sequence[str]) -> dict[str, str]:
    """Device name -> GPU UUID for the GPUs of a node (how an allocation result's `device` is read back)."""
    return {device_name(u): u for u in gpu_uuids}
