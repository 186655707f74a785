"""Typed, versioned events: the only things services say to each other.

Every event has an `event_id` (also the JetStream `Nats-Msg-Id`, so a re-publish is dropped by the
stream's dedup window and a re-delivery is recognised by consumers), a `kind` that selects its model and
its subject, and a schema `version`. Consumers refuse versions they do not know instead of guessing.
"""

from __future__ import annotations

import json
import typing
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

Name = Annotated[str, Field(min_length=1, max_length=253)]
ShortText = Annotated[str, Field(max_length=2048)]
MAX_MIB = 16 * 1024 * 1024  # the largest memory amount anything carries (16 TiB)
MAX_GPU_COUNT = 64  # distinct GPUs one container may ask for
MAX_COMPUTE = 100 * MAX_GPU_COUNT  # percent of one GPU, over all of a container's GPUs
MiB = Annotated[int, Field(ge=0, le=MAX_MIB)]
Compute = Annotated[int, Field(ge=0, le=MAX_COMPUTE)]

SUPPORTED_VERSION = 1


def _now() -> datetime:
    return datetime.now(UTC)


class EventDecodeError(ValueError):
    """A message that is not a valid event of a known kind and version."""


class _EventBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    version: Literal[1] = SUPPORTED_VERSION  # type: ignore[assignment]  # SUPPORTED_VERSION is 1
    occurred_at: datetime = Field(default_factory=_now)
    source: Annotated[str, Field(max_length=253)] = ""

    @field_validator("version", mode="before")
    @classmethod
    def _version_is_an_integer(cls, value: object) -> object:
        if type(value) is not int:  # JSON true would otherwise pass as 1
            raise ValueError(f"version must be the integer {SUPPORTED_VERSION}")
        return value

    @property
    def subject_token(self) -> str:
        """The last subject token: the node concerned, or `_` for cluster-wide events."""
        node = getattr(self, "node", None)
        return node_token(node) if node else "_"


def node_token(name: str) -> str:
    """The NATS subject token of a node name (dots, wildcards and spaces are not allowed in tokens)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "_"


class GpuInfo(BaseModel):
    """One physical GPU as the node agent discovered it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: Name
    index: Annotated[int, Field(ge=0, le=1024)]
    model: Annotated[str, Field(max_length=253)] = ""
    memory_mib: MiB = Field(description="Schedulable memory: whole resource units only")
    memory_total_mib: MiB = Field(description="Physical memory reported by the driver")
    compute_units: Annotated[int, Field(ge=1, le=100)] = 100
    healthy: bool = True
    mig_mode: bool = False
    numa_node: int | None = None
    pci_bus_id: Annotated[str, Field(max_length=64)] = ""


class AllocationPart(BaseModel):
    """The share of one GPU that one container holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    container: Name
    container_index: Annotated[int, Field(ge=0, le=1024)]
    gpu_uuid: Name
    gpu_index: Annotated[int, Field(ge=0, le=1024)]
    memory_mib: MiB
    compute: Compute = 0
    init: bool = False
    sidecar: bool = Field(
        default=False,
        description="An init container with restartPolicy Always: it runs beside the app containers (init is true)",
    )

    @model_validator(mode="after")
    def _sidecar_is_an_init_container(self) -> AllocationPart:
        if self.sidecar and not self.init:
            raise ValueError("a sidecar part must be an init container's (init: true)")
        return self

    @model_serializer(mode="wrap")
    def _without_default_sidecar(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # parts of pods without sidecars serialise exactly as before the field existed, so a reader from the
        # previous release (extra="forbid") still decodes them during a rolling update
        data = handler(self)
        if not self.sidecar:
            data.pop("sidecar", None)
        return data


class InventoryEvent(_EventBase):
    """The complete set of GPUs on a node (sent at start and on every change)."""

    kind: Literal["inventory"] = "inventory"
    node: Name
    gpus: Annotated[list[GpuInfo], Field(max_length=256)]
    driver_version: Annotated[str, Field(max_length=64)] = ""
    cuda_version: Annotated[str, Field(max_length=64)] = ""
    address: Annotated[str, Field(max_length=253)] = ""
    allocator: Literal["extender", "dra"] = Field(
        default="extender",
        description="Who places shares on the node: the scheduler extender (device plugins) or kube-scheduler's "
        "Dynamic Resource Allocation (the node agent's DRA plugin)",
    )

    @model_serializer(mode="wrap")
    def _without_default_allocator(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a device-plugin node's inventory serialises exactly as before the field existed, so a reader from the
        # previous release (extra="forbid") still decodes it during a rolling update
        data = handler(self)
        if self.allocator == "extender":
            data.pop("allocator", None)
        return data


class NodeRetiredEvent(_EventBase):
    """A node left the cluster: its GPUs are retired and its allocations released."""

    kind: Literal["node_retired"] = "node_retired"
    node: Name


class ReservedEvent(_EventBase):
    """The extender reserved GPUs for a pod in the ledger."""

    kind: Literal["reserved"] = "reserved"
    allocation_id: uuid.UUID
    pod_uid: Name
    namespace: Name
    pod_name: Name
    owner_kind: Annotated[str, Field(max_length=64)] = ""
    owner_name: Annotated[str, Field(max_length=253)] = ""
    node: Name
    parts: Annotated[list[AllocationPart], Field(min_length=1, max_length=1024)]
    pod_created_at: datetime | None = Field(
        default=None, description="The pod's creationTimestamp: kubelet admits pods in this order"
    )


class ClaimResult(BaseModel):
    """One allocation result of a ResourceClaim that the ledger recorded (its request, device and share)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request: Name
    device: Annotated[str, Field(min_length=1, max_length=63)]
    share_id: Annotated[str, Field(min_length=1, max_length=64)]


class ClaimReservedEvent(ReservedEvent):
    """kube-scheduler allocated a pod's gpushare ResourceClaim and the binder recorded it in the ledger, before the
    pod was bound (DRA's binding conditions, docs/dra.md).

    Everything a `reserved` event says (so every view that folds reservations counts it), plus the claim it came
    from. A kind of its own, because the binder's `reserved` consumer would create a Binding that kube-scheduler
    makes itself on DRA nodes.
    """

    kind: Literal["claim_reserved"] = "claim_reserved"  # type: ignore[assignment]
    claim_uid: Name
    claim_name: Name
    results: Annotated[list[ClaimResult], Field(min_length=1, max_length=1024)]


class BoundEvent(_EventBase):
    """The binder created the pod's Binding."""

    kind: Literal["bound"] = "bound"
    allocation_id: uuid.UUID
    pod_uid: Name
    node: Name


class FailedEvent(_EventBase):
    """Binding failed: the reservation is released."""

    kind: Literal["failed"] = "failed"
    allocation_id: uuid.UUID
    pod_uid: Name
    node: Name
    reason: ShortText = ""


class AssignedEvent(_EventBase):
    """The node agent handed the reserved GPU(s) to one container."""

    kind: Literal["assigned"] = "assigned"
    allocation_id: uuid.UUID
    pod_uid: Name
    node: Name
    container: Name
    gpu_uuids: Annotated[list[Name], Field(min_length=1, max_length=64)]


class TerminatingEvent(_EventBase):
    """The pod of a live allocation is being deleted (it has a deletionTimestamp).

    Its containers may hold GPU memory for the whole grace period, or for ever if the pod is stuck
    Terminating, so the share stays held: only the pod object's deletion or a terminal phase releases it.
    The event only records when termination began, so that inspect and pending views can say who holds a
    GPU on the way out.
    """

    kind: Literal["terminating"] = "terminating"
    allocation_id: uuid.UUID
    pod_uid: Name
    node: Name


class ReleasedEvent(_EventBase):
    """An allocation ended (pod deleted, finished, node gone, reconciliation)."""

    kind: Literal["released"] = "released"
    allocation_id: uuid.UUID
    pod_uid: Name
    node: Name
    reason: ShortText = ""


class PartMove(BaseModel):
    """Where one part of a container's share went in an exchange."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allocation_id: uuid.UUID
    container: Name
    from_gpu_uuid: Name
    to_gpu_uuid: Name
    to_gpu_index: Annotated[int, Field(ge=0, le=1024)]


class ExchangedEvent(_EventBase):
    """Two containers on one node swapped their equal-sized GPU shares.

    The node agent learns which pod kubelet really handed a device set to only after Allocate (kubelet's
    Allocate carries no pod identity). When kubelet admitted another pod than the one the agent expected,
    and both wait for shares of identical size, the ledger swaps the two shares so that it records what
    each container really received. Capacity per GPU is unchanged by construction.

    The ledger fills in the result: every part's move and each allocation's new `version` (raised by one per
    exchange). Applying the result instead of swapping again makes the event idempotent: a copy applied
    twice, or applied on top of a snapshot that already holds it, changes nothing (the version says so).
    A command from the node agent carries no result; events from before the result existed are swapped.
    """

    kind: Literal["exchanged"] = "exchanged"
    node: Name
    first_allocation_id: uuid.UUID
    first_container: Name
    second_allocation_id: uuid.UUID
    second_container: Name
    moves: Annotated[list[PartMove], Field(max_length=256)] = Field(default_factory=list)
    versions: Annotated[dict[str, Annotated[int, Field(ge=1)]], Field(max_length=2)] = Field(
        default_factory=dict, description="allocation id -> its version after the exchange"
    )

    def version_of(self, allocation_id: uuid.UUID) -> int | None:
        """The allocation's version after this exchange (None when the event carries no result)."""
        return self.versions.get(str(allocation_id))


class UsageSample(BaseModel):
    """What one process group (a container of a pod, when known) used on one GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_uuid: Name
    pod_uid: Annotated[str, Field(max_length=253)] = ""
    namespace: Annotated[str, Field(max_length=253)] = ""
    pod_name: Annotated[str, Field(max_length=253)] = ""
    container: Annotated[str, Field(max_length=253)] = ""
    used_memory_mib: MiB
    utilization_pct: Annotated[float, Field(ge=0, le=100)] = 0.0  # the whole GPU's utilisation at the sample
    # the share of the GPU's SMs this pod's processes kept busy since the previous sample (NVML's per-process
    # samples, summed over the pod's processes); None when the GPU cannot say (and from agents before it existed)
    sm_utilization_pct: Annotated[float, Field(ge=0, le=100)] | None = None

    @model_serializer(mode="wrap")
    def _without_unknown_sm(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a sample without an SM figure serialises exactly as before the field existed, so a reader from the
        # previous release (extra="forbid") still decodes it; one with the figure needs accounting upgraded first
        data = handler(self)
        if self.sm_utilization_pct is None:
            data.pop("sm_utilization_pct", None)
        return data


class UsageEvent(_EventBase):
    """Periodic usage samples from a node."""

    kind: Literal["usage"] = "usage"
    node: Name
    samples: Annotated[list[UsageSample], Field(max_length=4096)]


class HealthEvent(_EventBase):
    """A GPU became unhealthy or recovered."""

    kind: Literal["health"] = "health"
    node: Name
    gpu_uuid: Name
    healthy: bool
    reason: ShortText = ""


class RefusedEvent(_EventBase):
    """The extender could not place a pod: the reasons per node, for "why is my pod pending"."""

    kind: Literal["refused"] = "refused"
    pod_uid: Name
    namespace: Name
    pod_name: Name
    summary: ShortText
    reasons: Annotated[dict[str, ShortText], Field(max_length=256)] = Field(default_factory=dict)


class UnallocatedUseEvent(_EventBase):
    """A pod's processes use GPU memory on a GPU where the pod holds no share (past the grace period): the GPU
    was reached around the device plugin (its environment, an exemption, a privileged container). Published by
    the node agent once per episode; nothing in the ledger changes."""

    kind: Literal["unallocated"] = "unallocated"
    node: Name
    gpu_uuid: Name
    pod_uid: Name
    namespace: Annotated[str, Field(max_length=253)] = ""  # empty when the pod holds nothing on the node
    pod_name: Annotated[str, Field(max_length=253)] = ""
    used_memory_mib: MiB


class QuotaEvent(_EventBase):
    """A namespace quota was set (limits given) or removed (both None)."""

    kind: Literal["quota"] = "quota"
    namespace: Name
    memory_mib: MiB | None = None
    compute: Annotated[int, Field(ge=0)] | None = None


Event = Annotated[
    InventoryEvent
    | NodeRetiredEvent
    | ReservedEvent
    | ClaimReservedEvent
    | BoundEvent
    | FailedEvent
    | AssignedEvent
    | TerminatingEvent
    | ReleasedEvent
    | ExchangedEvent
    | UsageEvent
    | HealthEvent
    | RefusedEvent
    | QuotaEvent
    | UnallocatedUseEvent,
    Field(discriminator="kind"),
]


def kind_of(event_type: type[_EventBase]) -> str:
    """The `kind` of an event class (its subject's second token)."""
    return event_type.model_fields["kind"].default


EVENT_TYPES: tuple[type[_EventBase], ...] = typing.get_args(typing.get_args(Event)[0])
EVENT_KINDS: tuple[str, ...] = tuple(map(kind_of, EVENT_TYPES))

_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
MAX_EVENT_BYTES = 4 * 1024 * 1024


def encode_event(event: _EventBase) -> bytes:
    """Serialise an event as compact JSON."""
    return event.model_dump_json().encode()


def decode_event(data: bytes | str) -> Event:
    """Parse and validate an event; raise `EventDecodeError` naming what is wrong."""
    if len(data) > MAX_EVENT_BYTES:
        raise EventDecodeError(f"event of {len(data)} bytes exceeds the {MAX_EVENT_BYTES}-byte limit")
    try:  # fast path: parse and validate in one pass (pydantic-core); errors are explained below
        return _ADAPTER.validate_json(data)
    except ValidationError:
        pass
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventDecodeError(f"not JSON: {exc}") from None
    except RecursionError:
        raise EventDecodeError("JSON nested too deeply to be an event") from None
    if not isinstance(raw, dict):
        raise EventDecodeError("an event must be a JSON object")
    kind = raw.get("kind")
    if kind not in EVENT_KINDS:
        raise EventDecodeError(f"unknown event kind {kind!r}")
    version = raw.get("version")
    if type(version) is not int or version != SUPPORTED_VERSION:
        raise EventDecodeError(f"unsupported {kind} event version {version!r} (this build reads 1)")
    try:
        _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or '(root)'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise EventDecodeError(f"invalid {kind} event: {problems}") from None
    raise EventDecodeError(f"invalid {kind} event: not valid as JSON text")


def subject_for(prefix: str, event: _EventBase) -> str:
    """The subject an event is published on: `<prefix>.<kind>.<node or _>`."""
    return f"{prefix}.{event.kind}.{event.subject_token}"  # type: ignore[attr-defined]
