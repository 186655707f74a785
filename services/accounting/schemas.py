"""The bodies accounting's REST API answers with, as pydantic models: the OpenAPI document describes every
answer from these, and FastAPI checks each answer against them (`extra="forbid"`: a key the model does not
declare is an error, not silently dropped).

Timestamps are ISO 8601 strings with a UTC offset, as `datetime.isoformat` writes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from shared.ledger.rules import AllocationState
from shared.settings import MemoryUnit

STATE_NAMES: tuple[str, ...] = tuple(s.value for s in AllocationState)

Timestamp = Annotated[str, Field(description="ISO 8601 with a UTC offset")]
PodStatus = Literal[(*STATE_NAMES, "pending")]  # type: ignore[valid-type]


class Answer(BaseModel):
    """A JSON object with exactly these keys."""

    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- errors


class Problem(Answer):
    """A refusal: what is wrong."""

    error: str


class FieldProblem(Answer):
    """One invalid parameter or body field."""

    field: str
    problem: str


class InvalidRequest(Answer):
    """A request that fails validation (`details` per field when the parameters or body are malformed)."""

    error: str
    details: list[FieldProblem] = Field(default_factory=list)


# ---------------------------------------------------------------- nodes and GPUs


class Gpu(Answer):
    """A GPU: capacity, what live allocations hold, what its latest usage sample used."""

    uuid: str
    index: int
    model: str
    memory_mib: int
    memory_total_mib: int
    allocated_memory_mib: int
    compute_units: int
    allocated_compute: int
    used_memory_mib: int | None = Field(description="sum of the GPU's latest usage sample; null when never sampled")
    used_at: Timestamp | None
    healthy: bool
    health_reason: str


class Node(Answer):
    """A node and its GPUs."""

    name: str
    address: str
    driver_version: str
    cuda_version: str
    retired: bool
    gpu_count: int
    memory_mib: int
    allocated_memory_mib: int
    used_memory_mib: int
    pending_memory_mib: int = Field(description="live shares on GPUs the node no longer lists")
    live_allocations: int
    gpus: list[Gpu]


class NodeList(Answer):
    """`GET /v1/nodes`."""

    items: list[Node]
    memory_unit: MemoryUnit


class GpuShare(Answer):
    """A live allocation's share of one GPU."""

    id: str
    pod_uid: str
    namespace: str
    pod_name: str
    state: AllocationState
    terminating_at: Timestamp | None = Field(description="the pod is being deleted; its share stays held")
    container: str
    memory_mib: int


class GpuDetail(Gpu):
    """A GPU with the live shares it holds."""

    allocations: list[GpuShare]


# ---------------------------------------------------------------- allocations and pods


class Part(Answer):
    """One container's share of one GPU."""

    container: str
    container_index: int
    init: bool
    sidecar: bool = Field(description="an init container with restartPolicy Always: held for the pod's whole life")
    gpu_uuid: str
    gpu_index: int
    memory_mib: int
    compute: int
    assigned_at: Timestamp | None


class Allocation(Answer):
    """An allocation of GPU shares to a pod, in any state."""

    id: str
    pod_uid: str
    namespace: str
    pod_name: str
    owner_kind: str
    owner_name: str
    node: str
    state: AllocationState
    memory_mib: int
    compute: int
    reason: str
    reserved_at: Timestamp
    bound_at: Timestamp | None
    assigned_at: Timestamp | None
    ended_at: Timestamp | None
    terminating_at: Timestamp | None = Field(
        description="when the pod began terminating: the share stays held until the pod is gone"
    )
    parts: list[Part]


class NodeDetail(Node):
    """`GET /v1/nodes/{name}`: the node, each GPU with its live shares, and the node's live allocations."""

    gpus: list[GpuDetail]  # type: ignore[assignment]
    pending_allocations: list[GpuShare] = Field(description="live shares on GPUs the node no longer lists")
    allocations: list[Allocation]
    memory_unit: MemoryUnit


class AllocationPage(Answer):
    """`GET /v1/allocations`: one page, newest first."""

    items: list[Allocation]
    total: int
    limit: int
    offset: int
    next_offset: int | None = Field(description="null on the last page")


class TimelineStep(Answer):
    """One step of an allocation's life."""

    allocation_id: str
    step: str
    at: Timestamp
    node: str
    detail: str


class TerminatingHolder(Answer):
    """A pod being deleted that still holds a share on a node a pending pod was refused on."""

    namespace: str
    pod_name: str
    node: str
    memory_mib: int
    terminating_since: Timestamp


class SchedulerVerdict(Answer):
    """kube-scheduler's own verdict on a pod it could not place: its PodScheduled condition."""

    reason: str = Field(description="Unschedulable, or SchedulerError")
    message: str = Field(
        description="its FailedScheduling message: what its own filters refused (`Insufficient aliyun.com/gpu-mem`: "
        "too little GPU memory in total on a node, which the extender never sees) and what the extender said"
    )
    since: Timestamp | None = Field(description="when the pod became unschedulable (lastTransitionTime)")


class Pending(Answer):
    """A pod's latest refusal: a summary, the reason per node, and who holds GPUs there on the way out."""

    pod_uid: str
    namespace: str
    pod_name: str
    summary: str
    reasons: dict[str, str] = Field(description="the extender's reason per node it refused (none from kube-scheduler)")
    refused_at: Timestamp
    source: Literal["extender", "kube-scheduler"] = Field(
        "extender",
        description="who refused: the extender (reasons per node), or kube-scheduler's own filters before the "
        "extender saw any node (its message is the summary)",
    )
    scheduler: SchedulerVerdict | None = Field(
        None, description="kube-scheduler's latest verdict on the pod; null without Kubernetes access or before any"
    )
    terminating_holders: list[TerminatingHolder] = Field(
        description="terminating pods still holding shares on the refusing nodes (on every node when kube-scheduler "
        "found nodes short of GPU resources in total): the pod may fit once they are gone"
    )
    created_at: Timestamp | None = Field(
        description="the pod's creationTimestamp, from the API server; null without Kubernetes access or once bound"
    )
    waiting_seconds: int | None = Field(description="how long it has waited since its creation (whole seconds)")


class PendingList(Answer):
    """`GET /v1/pending`."""

    items: list[Pending]


class GpuUsage(Answer):
    """What a pod's processes used on one GPU at its latest usage sample."""

    gpu_uuid: str
    container: str = Field(description="empty when several of the pod's containers share the GPU")
    used_memory_mib: int
    sm_utilization_pct: float | None = Field(
        description="percent of the GPU's SMs the pod's processes kept busy (NVML per-process); null: unknown"
    )


class PodUsage(Answer):
    """A pod's latest usage sample: memory and SM utilisation over its GPUs, and per GPU."""

    sampled_at: Timestamp
    used_memory_mib: int
    sm_utilization_pct: float | None = Field(
        description="percent of one GPU's SMs, summed over the pod's GPUs that could say; null when none could"
    )
    gpus: list[GpuUsage]


class PodView(Answer):
    """`GET /v1/pods/{namespace}/{name}`."""

    namespace: str
    pod_name: str
    pod_uid: str
    status: PodStatus
    allocation: Allocation | None
    allocations: list[Allocation]
    timeline: list[TimelineStep]
    pending: Pending | None
    last_refusal: Pending | None
    usage: PodUsage | None = Field(description="the current (or latest) allocation's latest usage sample")


AllocationsByState: type[Answer] = create_model(  # type: ignore[call-overload]  # one key per state, each required
    "AllocationsByState", __base__=Answer, **{name: (int, ...) for name in STATE_NAMES}
)


class Cluster(Answer):
    """`GET /v1/cluster`."""

    nodes: int
    gpus: int
    unhealthy_gpus: int
    memory_mib: int
    allocated_memory_mib: int
    used_memory_mib: int
    allocated_pct: int
    allocations_by_state: AllocationsByState  # type: ignore[valid-type]
    pending_pods: int
    memory_unit: MemoryUnit


# ---------------------------------------------------------------- usage and right-sizing


class ByNamespace(Answer):
    """Figures of one namespace."""

    namespace: str


class ByWorkload(ByNamespace):
    """Figures of one workload (a pod without owner is `Pod` / its name)."""

    owner_kind: str
    owner_name: str


class Usage(Answer):
    """GPU-memory-hours allocated vs used."""

    allocated_gib_hours: float
    used_gib_hours: float
    efficiency_pct: int | None
    pods: int
    pods_with_samples: int


class NamespaceUsage(Usage, ByNamespace):
    """Usage of one namespace."""


class WorkloadUsage(Usage, ByWorkload):
    """Usage of one workload."""


class Window(Answer):
    """The range the figures cover."""

    since: Timestamp
    until: Timestamp


class NamespaceUsageList(Window):
    """`GET /v1/usage/namespaces`."""

    items: list[NamespaceUsage]


class WorkloadUsageList(Window):
    """`GET /v1/usage/workloads`."""

    items: list[WorkloadUsage]


class LivePod(ByWorkload):
    """A live allocation's pod: what it holds and what its latest usage sample says."""

    pod_name: str
    pod_uid: str
    node: str
    allocated_memory_mib: int
    allocated_compute: int = Field(description="its gpu-core share, percent of one GPU (0: none)")
    used_memory_mib: int | None = Field(description="null when never sampled")
    sm_utilization_pct: float | None = Field(
        description="percent of one GPU's SMs its processes kept busy (NVML per-process); null: unknown"
    )
    sampled_at: Timestamp | None


class LivePodList(Answer):
    """`GET /v1/usage/pods`."""

    items: list[LivePod]


class Sizing(Answer):
    """Allocated vs peak and p95 used, and the recommended share; SM utilisation and what it says."""

    allocated_mib: int
    peak_used_mib: int
    p95_used_mib: int
    recommended_mib: int
    density_gain_pct: int
    allocated_compute: int = Field(description="the gpu-core share of its newest pod, percent of one GPU (0: none)")
    sm_mean_pct: float | None = Field(description="mean SM utilisation of its pods, percent of one GPU; null: unknown")
    sm_peak_pct: float | None = Field(description="peak SM utilisation of its pods; null: unknown")
    compute_idle: bool = Field(
        description="its pods' SMs stayed idle in the window: the share holds memory for nothing"
    )
    recommended_compute: int | None = Field(description="a smaller gpu-core share that covers the peak, or null")
    pods_sampled: int
    samples: int
    summary: str


class Suggestion(Sizing, ByWorkload):
    """A right-sizing suggestion for one workload."""


class Suggestions(Window):
    """`GET /v1/rightsizing`."""

    step_mib: int
    items: list[Suggestion]


# ---------------------------------------------------------------- quotas


class Quota(Answer):
    """A namespace quota and what the namespace holds now."""

    namespace: str
    memory_mib: int | None
    compute: int | None
    updated_at: Timestamp
    allocated_memory_mib: int


class ResourceQuotaUsage(Answer):
    """A Kubernetes ResourceQuota's limit on one of gpushare's resources, and what it counts now."""

    namespace: str
    name: str
    key: str = Field(description="the quota's key, e.g. `requests.aliyun.com/gpu-mem`")
    resource: str = Field(
        description="the resource it limits, e.g. `aliyun.com/gpu-mem`, or "
        "`gpushare-gpu.deviceclass.resource.k8s.io/devices` (DRA: one device per share a claim asks)"
    )
    hard: int = Field(description="the limit, in the resource's unit (gpu-mem: `memory_unit`; DRA: devices)")
    used: int = Field(description="what the namespace's pods request now, as the quota controller counts it")


class QuotaList(Answer):
    """`GET /v1/quotas`: the ledger's quotas, and the cluster's ResourceQuotas on gpushare's resources."""

    items: list[Quota]
    resource_quotas: list[ResourceQuotaUsage]
    resource_quotas_unavailable: str | None = Field(
        description="why `resource_quotas` is empty although there may be some (no Kubernetes access); null otherwise"
    )
    memory_unit: MemoryUnit


class QuotaDeleted(Answer):
    """`DELETE /v1/quotas/{namespace}`."""

    namespace: str
    deleted: Literal[True]


# ---------------------------------------------------------------- documented refusals

REFUSALS: dict[int, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body is nested too deeply"},
    401: {
        "model": Problem,
        "description": "no bearer token",
        "headers": {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}},
    },
    403: {"model": Problem, "description": "a wrong token, or quota changes are disabled (no admin token)"},
    404: {"model": Problem, "description": "not known"},
    422: {"model": InvalidRequest, "description": "invalid parameters or body"},
    503: {"model": Problem, "description": "this instance cannot write to the ledger"},
}


def refusals(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route that may refuse with these status codes."""
    return {code: REFUSALS[code] for code in codes}


def lookup(summary: str, answer: type[Answer]) -> dict[str, Any]:
    """Route arguments of a `GET` of one named thing: its answer, or 404 (and 422 for a malformed name)."""
    return {"summary": summary, "response_model": answer, "responses": refusals(404, 422)}
