"""What an allocated gpushare ResourceClaim means for the ledger (pure: claim and pod in, allocation out).

kube-scheduler allocates a claim's requests from the node's ResourceSlice: each result names a device (a GPU),
a `shareID` and the `consumedCapacity` after the request policy's rounding. The ledger records that allocation
before the pod is bound: `read_claim` turns the claim, its pod and the node's GPUs as the ledger holds them into
a `ClaimAllocation` (the ledger's parts, the event that records them, the allocation id), or refuses with a
`ClaimRefused` that says why and what to do instead. The node agent reads the same claim's shares the same way
when kubelet prepares it (`claim_shares`), so both sides agree on every share, and takes who holds them from the
ledger's record (`from_record`) rather than from the pod.

Which container holds which share comes from the pod spec only (no request name is assumed):
`containers[].resources.claims[]` names the pod's claim entry and a `request` (empty: every request of the
claim); init containers and sidecars count as containers. A request is one share per device; when several
containers reference one request they use that one share, charged once, held by the first of them in this
order: app containers, then init containers (in spec order). Each container may reference one gpushare request
(a request with `count` gives it several GPUs); a request no container references is refused (it would hold a
share nobody uses).

DRA keeps every share of a claim for the pod's whole life, also an init container's: the ledger records an init
container's share as held beside the app containers (`init` and `sidecar` set), so that `rules.gpu_charges` sums
what the scheduler summed (the ledger's counters always equal the claims' `consumedCapacity`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from shared.dra import COMPUTE, DRIVER, MEMORY
from shared.dra.quantity import QuantityError, parse_quantity
from shared.events.catalogue import AllocationPart, ClaimReservedEvent, ClaimResult
from shared.kube import pods
from shared.settings import MemoryUnit

ALLOCATION_NAMESPACE = uuid.UUID("0b9d3c2e-5a41-4c8e-9f0e-6d2b8a7c1e55")
MIB = 2**20


class ClaimRefused(Exception):
    """An allocation the ledger will not record. `reason` is a condition reason (CamelCase), the message says what
    is wrong and what to write instead."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class LedgerGpu:
    """A GPU of the node as the ledger holds it."""

    uuid: str
    index: int
    memory_mib: int
    compute_units: int = 100


@dataclass(frozen=True)
class ClaimShare:
    """One allocation result of the gpushare driver: a share of one GPU."""

    request: str  # the request containers reference (a `firstAvailable` subrequest's parent)
    result_request: str  # as the result names it (`request/subrequest` for a subrequest)
    device: str
    pool: str
    share_id: str
    gpu_uuid: str
    gpu_index: int
    memory_mib: int
    compute: int


@dataclass(frozen=True)
class ContainerRef:
    """A container of the pod as the ledger names it."""

    name: str
    index: int
    init: bool
    sidecar: bool


@dataclass(frozen=True)
class ClaimAllocation:
    """A claim's allocation as the ledger records it."""

    allocation_id: uuid.UUID
    claim_uid: str
    claim_name: str
    namespace: str
    pod_uid: str
    pod_name: str
    node: str
    shares: tuple[ClaimShare, ...]
    users: Mapping[str, tuple[ContainerRef, ...]]  # request -> containers that reference it, holder first
    parts: tuple[AllocationPart, ...]
    owner_kind: str = ""
    owner_name: str = ""
    pod_created_at: datetime | None = None

    def event(self, *, source: str = "") -> ClaimReservedEvent:
        """The event that records this allocation."""
        return ClaimReservedEvent(
            allocation_id=self.allocation_id,
            pod_uid=self.pod_uid,
            namespace=self.namespace,
            pod_name=self.pod_name,
            owner_kind=self.owner_kind,
            owner_name=self.owner_name,
            node=self.node,
            parts=list(self.parts),
            pod_created_at=self.pod_created_at,
            claim_uid=self.claim_uid,
            claim_name=self.claim_name,
            results=[ClaimResult(request=s.result_request, device=s.device, share_id=s.share_id) for s in self.shares],
            source=source,
        )

    def shares_of(self, request: str) -> tuple[ClaimShare, ...]:
        """The shares of one request, in result order."""
        return tuple(s for s in self.shares if s.request == request)

    def requests(self) -> list[str]:
        """The requests that got shares, in result order."""
        return list(dict.fromkeys(s.request for s in self.shares))

    def pod_memory_mib(self) -> int:
        """Everything the pod's claim holds (every DRA share is held for the pod's life)."""
        return sum(s.memory_mib for s in self.shares)


def allocation_id(claim_uid: str, share_ids: list[str]) -> uuid.UUID:
    """The ledger's id of one allocation of a claim: the same claim allocation always gives the same id (a repeated
    watch event or a restarted binder records nothing twice); a new allocation has new share ids."""
    return uuid.uuid5(ALLOCATION_NAMESPACE, f"{claim_uid}/{','.join(sorted(share_ids))}")


def base_request(name: str) -> str:
    """The request a container references for a result's request (`req/sub` -> `req`)."""
    return name.split("/", 1)[0]


def claim_key(claim: Mapping[str, Any]) -> str:
    """`namespace/name` of a claim, for messages."""
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def our_results(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The allocation results of the gpushare driver (none when the claim is not allocated)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [r for r in results if r.get("driver") == DRIVER]


def requests_gpushare(claim: Mapping[str, Any], device_class: str) -> bool:
    """Whether a claim's spec asks the gpushare device class in any request (before it is allocated)."""
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        options = [request.get("exactly") or {}, *(request.get("firstAvailable") or [])]
        if any(o.get("deviceClassName") == device_class for o in options):
            return True
    return False


def pod_consumer(claim: Mapping[str, Any]) -> dict[str, Any] | None:
    """The one pod a claim is reserved for; None while nobody is; ClaimRefused for any other consumer set."""
    consumers = (claim.get("status") or {}).get("reservedFor") or []
    if not consumers:
        return None
    if len(consumers) > 1:
        raise ClaimRefused(
            "SharedClaim",
            f"claim {claim_key(claim)} is reserved for {len(consumers)} consumers; a gpushare claim serves exactly one "
            "pod (let each pod have its own claim, e.g. from a ResourceClaimTemplate)",
        )
    consumer = consumers[0]
    if consumer.get("resource") != "pods" or consumer.get("apiGroup") not in (None, ""):
        raise ClaimRefused(
            "NotAPod",
            f"claim {claim_key(claim)} is reserved for {consumer.get('resource')} {consumer.get('name')}; gpushare "
            "claims serve pods only",
        )
    return dict(consumer)


def pod_claim_entry(pod: Mapping[str, Any], claim_name: str) -> str | None:
    """The name of the pod's `spec.resourceClaims` entry that resolves to the claim `claim_name` (kubelet's
    `resourceclaim.Name`: a `resourceClaimName`, or a template's claim as `status.resourceClaimStatuses` names it)."""
    statuses = {
        s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = entry.get("name")
        if entry.get("resourceClaimName") == claim_name:
            return str(name)
        if entry.get("resourceClaimTemplateName") and statuses.get(name) == claim_name:
            return str(name)
    return None


def containers_of(pod: Mapping[str, Any]) -> list[tuple[ContainerRef, dict[str, Any]]]:
    """Every container of the pod with its spec: init containers first, then app containers, in spec order."""
    spec = pod.get("spec") or {}
    out = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        for index, c in enumerate(spec.get(key) or []):
            sidecar = init and c.get("restartPolicy") == "Always"
            out.append((ContainerRef(str(c.get("name") or f"c{index}"), index, init, sidecar), c))
    return out


def request_users(pod: Mapping[str, Any], entry: str, requests: list[str]) -> dict[str, list[ContainerRef]]:
    """request -> the containers whose `resources.claims` reference it through the pod's claim `entry`.

    ClaimRefused when a container references more than one of the claim's gpushare requests, or a request the
    claim does not have."""
    users: dict[str, list[ContainerRef]] = {r: [] for r in requests}
    for ref, spec in containers_of(pod):
        wanted: list[str] = []
        for use in (spec.get("resources") or {}).get("claims") or []:
            if use.get("name") != entry:
                continue
            request = use.get("request") or ""
            if not request:
                wanted.extend(requests)
            elif base_request(request) in users:
                wanted.append(base_request(request))
        wanted = list(dict.fromkeys(wanted))
        if len(wanted) > 1:
            raise ClaimRefused(
                "MultipleRequests",
                f"container {ref.name} uses {len(wanted)} gpushare requests ({', '.join(wanted)}) of claim {entry}; "
                "reference one request per container (`resources.claims: [{name, request}]`) and use `count` for "
                "several GPUs",
            )
        for request in wanted:
            users[request].append(ref)
    return users


def _holder_order(ref: ContainerRef) -> tuple[int, int]:
    # app containers first, then init containers (sidecars and regular ones) in spec order
    return (1 if ref.init else 0, ref.index)


def _memory_mib(share: str, raw: Any, gpu: LedgerGpu, unit: MemoryUnit) -> int:
    try:
        amount = parse_quantity(raw)
    except QuantityError as exc:
        raise ClaimRefused("Unreadable", f"{share}: consumedCapacity.memory {exc}") from None
    unit_bytes = Decimal(unit.mib * MIB)
    if amount <= 0 or amount % unit_bytes != 0:
        raise ClaimRefused(
            "OffStep",
            f"{share}: consumedCapacity.memory {raw} is not a whole number of {unit.value} (the device's request "
            f"policy steps); gpushare records whole {unit.value} only",
        )
    mib = int(amount / MIB)
    if mib > gpu.memory_mib:
        raise ClaimRefused(
            "InsufficientCapacity",
            f"{share}: consumedCapacity.memory {raw} is more than GPU {gpu.index} holds ({gpu.memory_mib} MiB)",
        )
    return mib


def _compute(share: str, raw: Any, gpu: LedgerGpu) -> int:
    try:
        amount = parse_quantity(raw if raw is not None else 0)
    except QuantityError as exc:
        raise ClaimRefused("Unreadable", f"{share}: consumedCapacity.compute {exc}") from None
    if amount < 0 or amount != amount.to_integral_value() or amount > gpu.compute_units:
        raise ClaimRefused(
            "OffStep",
            f"{share}: consumedCapacity.compute {raw} is not a whole percent between 0 and {gpu.compute_units}",
        )
    return int(amount)


def claim_shares(
    claim: Mapping[str, Any],
    gpus: Mapping[str, LedgerGpu],
    unit: MemoryUnit,
) -> tuple[str, tuple[ClaimShare, ...]]:
    """The node and the shares of an allocated claim's gpushare results, in result order (no pod needed).
    `gpus`: the node's GPUs in the ledger by device name (`shared.dra.slices.device_name`). Raises ClaimRefused."""
    key = claim_key(claim)
    results = our_results(claim)
    if not results:
        raise ClaimRefused("NotAllocated", f"claim {key} has no allocation of the {DRIVER} driver")
    nodes = {str(r.get("pool") or "") for r in results}
    if len(nodes) != 1:
        raise ClaimRefused("SeveralNodes", f"claim {key} has gpushare devices of several pools: {sorted(nodes)}")
    node = nodes.pop()
    shares = []
    for r in results:
        label = f"claim {key} request {r.get('request')} device {r.get('device')}"
        if r.get("adminAccess"):
            raise ClaimRefused("AdminAccess", f"{label}: admin access to gpushare GPUs is not supported")
        gpu = gpus.get(str(r.get("device") or ""))
        if gpu is None:
            raise ClaimRefused("UnknownDevice", f"{label}: no GPU of node {node} in the gpushare ledger has that name")
        share_id = r.get("shareID")
        consumed = r.get("consumedCapacity")
        if not share_id or consumed is None or MEMORY not in consumed:
            raise ClaimRefused(
                "NoConsumableCapacity",
                f"{label}: allocated without a share (no shareID / consumedCapacity); kube-apiserver, kube-scheduler "
                "and kubelet need the DRAConsumableCapacity feature",
            )
        shares.append(
            ClaimShare(
                request=base_request(str(r.get("request") or "")),
                result_request=str(r.get("request") or ""),
                device=str(r["device"]),
                pool=node,
                share_id=str(share_id),
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                memory_mib=_memory_mib(label, consumed[MEMORY], gpu, unit),
                compute=_compute(label, consumed.get(COMPUTE), gpu),
            )
        )
    return node, tuple(shares)


def claim_allocation_id(claim: Mapping[str, Any], shares: tuple[ClaimShare, ...]) -> uuid.UUID:
    """The ledger's id of the claim allocation these shares (`claim_shares`) are."""
    return allocation_id(str((claim.get("metadata") or {}).get("uid") or ""), [s.share_id for s in shares])


def read_claim(
    claim: Mapping[str, Any],
    pod: Mapping[str, Any],
    gpus: Mapping[str, LedgerGpu],
    unit: MemoryUnit,
) -> ClaimAllocation:
    """The ledger allocation an allocated claim stands for. `gpus`: the node's GPUs in the ledger by device name
    (`shared.dra.slices.device_name`). Raises ClaimRefused (nothing may be recorded then)."""
    meta = claim.get("metadata") or {}
    key = claim_key(claim)
    if not our_results(claim):
        raise ClaimRefused("NotAllocated", f"claim {key} has no allocation of the {DRIVER} driver")
    consumer = pod_consumer(claim)
    pod_meta = pod.get("metadata") or {}
    if consumer is None or consumer.get("uid") != pod_meta.get("uid"):
        raise ClaimRefused("NotReserved", f"claim {key} is not reserved for pod {pod_meta.get('name')}")
    node, shares = claim_shares(claim, gpus, unit)
    entry = pod_claim_entry(pod, str(meta.get("name") or ""))
    if entry is None:
        raise ClaimRefused("NotReferenced", f"pod {pod_meta.get('name')} does not reference claim {key}")
    requests = list(dict.fromkeys(s.request for s in shares))
    users = request_users(pod, entry, requests)
    unused = [r for r in requests if not users[r]]
    if unused:
        raise ClaimRefused(
            "UnusedRequest",
            f"request(s) {', '.join(unused)} of claim {key} are used by no container of pod {pod_meta.get('name')}; "
            "name them in a container's `resources.claims` (a share nobody uses would still be held)",
        )
    ordered = {r: tuple(sorted(users[r], key=_holder_order)) for r in requests}
    parts = []
    for request in requests:
        holder = ordered[request][0]
        for s in (s for s in shares if s.request == request):
            parts.append(
                AllocationPart(
                    container=holder.name,
                    container_index=holder.index,
                    gpu_uuid=s.gpu_uuid,
                    gpu_index=s.gpu_index,
                    memory_mib=s.memory_mib,
                    compute=s.compute,
                    init=holder.init,
                    sidecar=holder.init,  # a DRA share is held for the pod's whole life (see the module doc)
                )
            )
    seen = {(p.container_index, p.init, p.gpu_uuid) for p in parts}
    if len(seen) != len(parts):
        raise ClaimRefused("DuplicateDevice", f"claim {key} gives one container two shares of the same GPU")
    kind, owner_name = pods.owner(dict(pod))
    created = pod_meta.get("creationTimestamp")
    return ClaimAllocation(
        allocation_id=claim_allocation_id(claim, shares),
        claim_uid=str(meta.get("uid") or ""),
        claim_name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or ""),
        pod_uid=str(pod_meta.get("uid") or ""),
        pod_name=str(pod_meta.get("name") or ""),
        node=node,
        shares=shares,
        users=ordered,
        parts=tuple(parts),
        owner_kind=kind,
        owner_name=owner_name,
        pod_created_at=datetime.fromisoformat(str(created).replace("Z", "+00:00")) if created else None,
    )


@dataclass(frozen=True)
class Recorded:
    """What the ledger recorded of one claim allocation: its pod and the parts its holders hold."""

    pod_uid: str
    pod_name: str
    pod_created_at: datetime | None
    parts: tuple[AllocationPart, ...]


def from_record(claim: Mapping[str, Any], shares: tuple[ClaimShare, ...], recorded: Recorded) -> ClaimAllocation | None:
    """The allocation an allocated claim stands for, its holders taken from the ledger's record of it (what
    `read_claim` made of the pod when the binder recorded it) instead of from the pod. `shares`: `claim_shares` of
    the claim, whose allocation the ledger holds as `recorded`.

    Each share's holder is the recorded part of its GPU with its amounts. None (read the pod then, `read_claim`)
    when the record cannot say it for certain: another pod is the claim's consumer now, the parts are not these
    shares, or two containers hold alike parts of one GPU. Only holders are named (`users`: one per request): the
    record does not keep the other containers that use a request, nor the pod's owner."""
    consumer = pod_consumer(claim)
    if consumer is None or consumer.get("uid") != recorded.pod_uid or not shares:
        return None
    amounts = sorted((p.gpu_uuid, p.memory_mib, p.compute) for p in recorded.parts)
    if amounts != sorted((s.gpu_uuid, s.memory_mib, s.compute) for s in shares):
        return None
    holders: dict[str, ContainerRef] = {}
    for s in shares:
        alike = {
            ContainerRef(p.container, p.container_index, p.init, p.sidecar)
            for p in recorded.parts
            if (p.gpu_uuid, p.memory_mib, p.compute) == (s.gpu_uuid, s.memory_mib, s.compute)
        }
        if len(alike) != 1:
            return None
        holder = alike.pop()
        if holders.setdefault(s.request, holder) != holder:  # one request, one holder
            return None
    meta = claim.get("metadata") or {}
    return ClaimAllocation(
        allocation_id=claim_allocation_id(claim, shares),
        claim_uid=str(meta.get("uid") or ""),
        claim_name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or ""),
        pod_uid=recorded.pod_uid,
        pod_name=recorded.pod_name,
        node=shares[0].pool,
        shares=shares,
        users={r: (h,) for r, h in holders.items()},
        parts=recorded.parts,
        pod_created_at=recorded.pod_created_at,
    )
