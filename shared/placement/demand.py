"""What a pod asks for: per-container GPU shares read from a Kubernetes Pod (as a JSON dict).

Each container (and init container) may request `aliyun.com/gpu-mem` (in the configured unit),
`aliyun.com/gpu-core` (percent of one GPU's compute, 1..100) and `aliyun.com/gpu-count` (how many
distinct GPUs; memory and compute are split evenly across them). Limits win over requests, as for
every extended resource (Kubernetes requires both to be equal when both are set). An init container with
`restartPolicy: Always` is a sidecar: it keeps running beside the app containers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from shared import annotations as ann
from shared.events.catalogue import MAX_COMPUTE, MAX_GPU_COUNT, MAX_MIB
from shared.ledger.rules import effective_request
from shared.placement.hints import HintError, Hints, parse_hints
from shared.settings import MemoryUnit

MAX_CONTAINERS = 256


class DemandError(ValueError):
    """A pod whose GPU request cannot be satisfied as written (the message says what to fix)."""


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    """One container's request: `count` GPUs, each holding `memory_mib` and `compute` of it.

    `index` is its position in `spec.containers` or, for init containers, in `spec.initContainers`;
    `sidecar` marks an init container with `restartPolicy: Always`.
    """

    name: str
    index: int
    memory_mib: int
    compute: int = 0
    count: int = 1
    init: bool = False
    sidecar: bool = False

    @property
    def kind(self) -> str:
        """How reasons name it: container, init container or sidecar container."""
        return "sidecar container" if self.sidecar else "init container" if self.init else "container"

    @property
    def total_memory_mib(self) -> int:
        """Memory across all its GPUs."""
        return self.memory_mib * self.count

    @property
    def total_compute(self) -> int:
        """Compute across all its GPUs."""
        return self.compute * self.count


@dataclass(frozen=True)
class PodDemand:
    """A pod's GPU request: app containers (run together) and init containers in spec order (regular ones run
    one at a time; sidecars start in turn and then run beside everything after them)."""

    uid: str
    namespace: str
    name: str
    containers: tuple[ContainerDemand, ...] = ()
    init_containers: tuple[ContainerDemand, ...] = ()
    hints: Hints = field(default_factory=Hints)
    owner_kind: str = ""
    owner_name: str = ""
    created_at: datetime | None = None  # metadata.creationTimestamp: the order kubelet admits pods in
    gates: tuple[str, ...] = ()

    @property
    def gated(self) -> bool:
        """Held by `spec.schedulingGates`: not to be placed, reserved or reported as refused until they go."""
        return bool(self.gates)

    def gated_reason(self) -> str:
        """Why a gated pod is not placed (for answers to kube-scheduler)."""
        return (
            f"pod {self.namespace}/{self.name} is held by schedulingGates ({', '.join(self.gates)}); "
            "gpushare neither reserves GPUs for it nor reports it as refused until the gates are removed"
        )

    @property
    def wants_gpu(self) -> bool:
        """False for pods that ask for no GPU share at all (they fit everywhere)."""
        return bool(self.containers or self.init_containers)

    @cached_property
    def memory_mib(self) -> int:
        """Kubernetes' effective request (`shared.ledger.rules.effective_request`), over all GPUs."""
        return effective_request(
            sum(c.total_memory_mib for c in self.containers),
            [(c.total_memory_mib, c.sidecar) for c in self.init_containers],
        )

    @cached_property
    def compute(self) -> int:
        """Effective compute request, by the same rule."""
        return effective_request(
            sum(c.total_compute for c in self.containers), [(c.total_compute, c.sidecar) for c in self.init_containers]
        )

    @cached_property
    def simple(self) -> bool:
        """One app container on one GPU, no init containers, no GPU hints: the fast path."""
        return (
            len(self.containers) == 1
            and not self.init_containers
            and self.containers[0].count == 1
            and not self.hints.constrains_gpus
            and self.hints.min_cuda is None
        )

    @cached_property
    def memory_only(self) -> bool:
        """`simple` and asking no compute: whether it fits depends on the freest GPU's memory alone."""
        return self.simple and self.containers[0].compute == 0


_ASCII_WHOLE = re.compile(r"[ \t]*\+?[0-9]{1,19}[ \t]*")  # `\d` and int() would take full-width or superscript digits


def parse_quantity(value: object, what: str) -> int:
    """An extended-resource quantity: a non-negative integer (int, or a string of ASCII digits)."""
    if isinstance(value, bool):
        raise DemandError(f"{what} must be a whole number, not {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _ASCII_WHOLE.fullmatch(value):
        number = int(value)
    elif isinstance(value, str) and value.strip().startswith("-"):
        raise DemandError(f"{what} must not be negative: {value!r}")
    elif isinstance(value, str) and any(c.isdigit() and not c.isascii() for c in value):
        raise DemandError(f"{what} must be written with ASCII digits 0-9, not {value!r}")
    else:
        raise DemandError(f"{what} must be a whole number, not {value!r}")
    if number < 0:
        raise DemandError(f"{what} must not be negative: {value!r}")
    return number


def _resources(container: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    res = container.get("resources") or {}
    if not isinstance(res, Mapping):
        raise DemandError(f"{where}: resources must be an object")
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    if not isinstance(limits, Mapping) or not isinstance(requests, Mapping):
        raise DemandError(f"{where}: resources.limits and resources.requests must be objects")
    merged = dict(requests)
    merged.update(limits)
    return merged


def parse_container(container: object, index: int, *, init: bool, unit: MemoryUnit) -> ContainerDemand | None:
    """One container's GPU demand, or None when it asks for no GPU share."""
    kind = "initContainer" if init else "container"
    if not isinstance(container, Mapping):
        raise DemandError(f"{kind} {index} must be an object")
    name = container.get("name") or f"{kind}-{index}"
    if not isinstance(name, str):
        raise DemandError(f"{kind} {index}: name must be a string")
    where = f"{kind} {name}"
    sidecar = init and _restarts_always(container, where)
    res = _resources(container, where)
    if not any(k in res for k in (ann.RESOURCE_MEM, ann.RESOURCE_CORE, ann.RESOURCE_COUNT)):
        return None
    mem_units = parse_quantity(res.get(ann.RESOURCE_MEM, 0), f"{where}: {ann.RESOURCE_MEM}")
    core = parse_quantity(res.get(ann.RESOURCE_CORE, 0), f"{where}: {ann.RESOURCE_CORE}")
    count = parse_quantity(res.get(ann.RESOURCE_COUNT, 1), f"{where}: {ann.RESOURCE_COUNT}")
    if mem_units > MAX_MIB // unit.mib:
        raise DemandError(f"{where}: {ann.RESOURCE_MEM} {mem_units} {unit.value} is more than any GPU has")
    memory = mem_units * unit.mib
    if core > MAX_COMPUTE:
        raise DemandError(f"{where}: {ann.RESOURCE_CORE} {core} is out of range (1..100 per GPU)")
    if not 1 <= count <= MAX_GPU_COUNT:
        raise DemandError(f"{where}: {ann.RESOURCE_COUNT} must be 1..{MAX_GPU_COUNT}, not {count}")
    if memory == 0 and core == 0:
        if ann.RESOURCE_COUNT in res and ann.RESOURCE_MEM not in res and ann.RESOURCE_CORE not in res:
            raise DemandError(f"{where}: {ann.RESOURCE_COUNT} needs {ann.RESOURCE_MEM} (memory per pod share)")
        return None
    if mem_units % count or core % count:
        raise DemandError(
            f"{where}: {mem_units} {unit.value} and {core}% compute cannot be split evenly across {count} GPUs"
        )
    per_core = core // count
    if per_core > 100:
        raise DemandError(f"{where}: {ann.RESOURCE_CORE} {core} over {count} GPU(s) is more than 100% of a GPU")
    return ContainerDemand(name, index, (mem_units // count) * unit.mib, per_core, count, init, sidecar)


def _restarts_always(container: Mapping[str, Any], where: str) -> bool:
    """True for `restartPolicy: Always` (an init container that is a sidecar)."""
    policy = container.get("restartPolicy")
    if policy is not None and not isinstance(policy, str):
        raise DemandError(f"{where}: restartPolicy must be a string, not {policy!r}")
    return policy == "Always"


def parse_pod(pod: object, unit: MemoryUnit = MemoryUnit.GIB) -> PodDemand:
    """The GPU demand of a Kubernetes Pod given as a JSON dict; raises DemandError naming the problem."""
    if not isinstance(pod, Mapping):
        raise DemandError("the pod must be a JSON object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise DemandError("pod metadata and spec must be objects")
    uid, namespace, name = meta.get("uid") or "", meta.get("namespace") or "default", meta.get("name") or ""
    if not all(isinstance(v, str) for v in (uid, namespace, name)):
        raise DemandError("pod metadata uid, namespace and name must be strings")
    try:
        hints = parse_hints(meta.get("annotations") or {})
    except HintError as exc:
        raise DemandError(str(exc)) from None
    lists = []
    for key in ("containers", "initContainers"):
        items = spec.get(key) or []
        if not isinstance(items, list):
            raise DemandError(f"spec.{key} must be a list")
        if len(items) > MAX_CONTAINERS:
            raise DemandError(f"spec.{key} has more than {MAX_CONTAINERS} entries")
        lists.append(items)
    containers = tuple(
        d for i, c in enumerate(lists[0]) if (d := parse_container(c, i, init=False, unit=unit)) is not None
    )
    inits = tuple(d for i, c in enumerate(lists[1]) if (d := parse_container(c, i, init=True, unit=unit)) is not None)
    owner_kind = owner_name = ""
    owners = meta.get("ownerReferences") or []
    if isinstance(owners, list):
        ref = next((o for o in owners if isinstance(o, Mapping) and o.get("controller")), None)
        ref = ref or next((o for o in owners if isinstance(o, Mapping)), None)
        if ref is not None:
            owner_kind, owner_name = str(ref.get("kind") or "")[:64], str(ref.get("name") or "")[:253]
    return PodDemand(
        uid,
        namespace,
        name,
        containers,
        inits,
        hints,
        owner_kind,
        owner_name,
        _timestamp(meta.get("creationTimestamp")),
        _gates(spec),
    )


def _timestamp(value: object) -> datetime | None:
    """An RFC 3339 timestamp as the API writes it, or None when absent or unreadable (it only orders pods)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _gates(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The names in `spec.schedulingGates` (a list of {name} objects)."""
    gates = spec.get("schedulingGates") or []
    if not isinstance(gates, list) or len(gates) > MAX_CONTAINERS:
        raise DemandError(f"spec.schedulingGates must be a list of at most {MAX_CONTAINERS} {{name}} objects")
    names = []
    for gate in gates:
        name = gate.get("name") if isinstance(gate, Mapping) else None
        if not isinstance(name, str) or not name:
            raise DemandError(f"spec.schedulingGates entries must be objects with a name, not {gate!r}"[:300])
        names.append(name[:253])
    return tuple(names)
