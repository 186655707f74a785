"""gpushare admission: an unchanged `aliyun.com/*` pod rewritten into a DRA claim (pure: pod in, patch and
ResourceClaimTemplate out).

A namespace moves to DRA with a label (`gpushare.io/allocator=dra`); its workloads stay as they are. When such a pod
is created, the webhook (served by the extender, `services/extender/admission.py`) reads its demand with the
extender's own rules (`shared.placement.demand.parse_pod`: limits win over requests, memory in the configured unit,
`gpu-count` splits memory and compute evenly) and writes:

* a ResourceClaimTemplate of the `gpushare-gpu` class, named by a hash of what it asks (`gpushare-<hash>`: every pod
  of a Deployment, and every workload with the same demand, uses one template), with one request per container that
  holds a share: `count` GPUs, each with `capacity.requests` `memory` (per GPU) and `compute` (per GPU, when asked),
  and the pod's steering annotations as CEL selectors (`shared.dra.selectors`);
* a JSON patch that moves the `aliyun.com/*` entries out of the containers' limits and requests, names the
  container's request in `resources.claims`, adds `spec.resourceClaims` (entry `gpushare`) pointing at the template,
  and records the original demand in the annotation `gpushare.io/dra-demand`.

Containers by Kubernetes' rules: each app container and each sidecar (an init container with `restartPolicy:
Always`, running beside the app) gets its own request. A regular init container runs before the app containers and
its resources are reused by them, so it references the request of an app container that covers it (same `count`,
at least its memory and compute: the smallest such), holding no share of its own, as kube-scheduler's effective
request counts it. Only when no app container covers it does it get its own request, which DRA holds for the pod's
life (a warning says so).

Shapes DRA cannot express are refused with what to write instead: compute without memory (a DRA request without
memory takes the whole GPU), more than 32 GPUs in one pod (`AllocationResultsMaxSize`), `spec.nodeName` set at
creation (no scheduler allocates the claim), hints no CEL selector can carry. A static pod's mirror passes
unchanged (kubelet runs the static pod from its own manifest).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared import annotations as ann
from shared.dra import COMPUTE, DEVICE_CLASS, MEMORY
from shared.dra.quantity import mib_quantity
from shared.dra.selectors import SelectorError, hint_selectors, policy_warning
from shared.placement.demand import ContainerDemand, DemandError, PodDemand, parse_pod
from shared.settings import MemoryUnit

OPT_IN_LABEL = "gpushare.io/allocator"
OPT_IN_VALUE = "dra"
"""The namespace label that moves a namespace's `aliyun.com/*` pods to DRA (the webhook's `namespaceSelector`)."""

DEMAND_ANNOTATION = "gpushare.io/dra-demand"
"""Pod annotation: the `aliyun.com/*` entries the webhook moved out of each container, and the template it wrote."""

CLAIM_ENTRY = "gpushare"
TEMPLATE_PREFIX = "gpushare-"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpushare-admission"
MAX_SHARES = 32  # resource.k8s.io/v1 AllocationResultsMaxSize: devices one claim may be allocated
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"  # a static pod's mirror: kubelet runs the pod already
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class AdmissionRefused(Exception):
    """A pod the webhook refuses; the message says why and what to write instead."""

    def __init__(self, message: str, reason: str = "Invalid") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


@dataclass(frozen=True)
class Rewrite:
    """What admitting one pod on DRA takes: the template (created before the pod is admitted) and the patch."""

    template: dict[str, Any]
    patch: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)

    @property
    def template_name(self) -> str:
        """The generated ResourceClaimTemplate's name."""
        return str(self.template["metadata"]["name"])


def _pointer(*parts: str | int) -> str:
    """An RFC 6901 JSON pointer (`~` -> `~0`, `/` -> `~1`)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _amounts(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{"limits": {...}, "requests": {...}}: the container's `aliyun.com/*` entries as written."""
    res = container.get("resources") or {}
    out: dict[str, dict[str, Any]] = {}
    for section in ("limits", "requests"):
        found = {k: v for k, v in (res.get(section) or {}).items() if k in ann.RESOURCES}
        if found:
            out[section] = found
    return out


def _request(name: str, demand: ContainerDemand, selectors: list[dict[str, Any]]) -> dict[str, Any]:
    """One DRA request for a container's demand: `count` GPUs of the gpushare class, each a share."""
    wanted: dict[str, str] = {MEMORY: mib_quantity(demand.memory_mib)}
    if demand.compute:
        wanted[COMPUTE] = str(demand.compute)
    exactly: dict[str, Any] = {
        "deviceClassName": DEVICE_CLASS,
        "allocationMode": "ExactCount",
        "count": demand.count,
        "capacity": {"requests": wanted},
    }
    if selectors:
        exactly["selectors"] = selectors
    return {"name": name, "exactly": exactly}


def _pod_label(meta: Mapping[str, Any], namespace: str) -> str:
    """`pod NAMESPACE/NAME` for messages (`NAME` is `generateName*` for a pod a controller creates)."""
    name = meta.get("name") or (f"{meta.get('generateName')}*" if meta.get("generateName") else "(unnamed)")
    return f"pod {namespace}/{name}"


def _check_expressible(pod: PodDemand, node_name: object, where: str) -> None:
    if node_name:
        raise AdmissionRefused(
            f"{where} sets spec.nodeName: such a pod skips kube-scheduler, and on DRA only kube-scheduler allocates "
            "the GPU claim; select the node with a nodeSelector on kubernetes.io/hostname instead"
        )
    for c in (*pod.containers, *pod.init_containers):
        if c.memory_mib == 0:
            raise AdmissionRefused(
                f"{where}: {c.kind} {c.name} asks {ann.RESOURCE_CORE} without {ann.RESOURCE_MEM}; on DRA a share "
                f"without memory takes the whole GPU's memory. Write {ann.RESOURCE_MEM} as well (the memory it "
                "needs, in the cluster's unit)"
            )
        if not _DNS_LABEL.match(c.name):
            raise AdmissionRefused(f"{where}: {c.kind} name {c.name!r} is not a DNS label (lower-case a-z, 0-9, -)")
    total = sum(c.count for c in (*pod.containers, *pod.init_containers))
    if total > MAX_SHARES:
        raise AdmissionRefused(
            f"{where} asks {total} GPU shares over its containers; one DRA claim holds at most {MAX_SHARES} "
            "devices. Split the work over several pods"
        )


def _covering(init: ContainerDemand, apps: tuple[ContainerDemand, ...]) -> ContainerDemand | None:
    """The app container whose request a regular init container can use: same count, at least its memory and
    compute, the smallest such (None when no app container covers it)."""
    fits = [a for a in apps if a.count == init.count and a.memory_mib >= init.memory_mib and a.compute >= init.compute]
    return min(fits, key=lambda a: (a.memory_mib, a.compute, a.index), default=None)


def template_name(spec: Mapping[str, Any]) -> str:
    """`gpushare-<hash>` of a template's spec: the same demand always names the same template."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return TEMPLATE_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _entry_name(spec: Mapping[str, Any]) -> str:
    taken = {str(e.get("name")) for e in spec.get("resourceClaims") or [] if isinstance(e, Mapping)}
    name, n = CLAIM_ENTRY, 1
    while name in taken:
        n += 1
        name = f"{CLAIM_ENTRY}-{n}"
    return name


def rewrite_pod(pod: object, namespace: str, unit: MemoryUnit) -> Rewrite | None:
    """The rewrite that puts a pod's `aliyun.com/*` demand on DRA, or None when it asks no GPU share (nothing to
    change). Raises AdmissionRefused for a pod that cannot be read or a shape DRA cannot express."""
    if not isinstance(pod, Mapping):
        raise AdmissionRefused("the request's object is not a pod (a JSON object)", "BadRequest")
    meta = pod.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        raise AdmissionRefused("pod metadata must be an object", "BadRequest")
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise AdmissionRefused("the pod has no spec object", "BadRequest")
    if MIRROR_ANNOTATION in ((meta or {}).get("annotations") or {}):
        return None  # kubelet runs the static pod from its own manifest; its mirror only shows it
    where = _pod_label(meta or {}, namespace)
    try:
        demand = parse_pod({**pod, "metadata": {**(meta or {}), "namespace": namespace}}, unit)
    except DemandError as exc:
        raise AdmissionRefused(f"{where}: {exc}") from None
    if not demand.wants_gpu:
        return None
    entries = spec.get("resourceClaims")
    if entries is not None and not isinstance(entries, list):
        raise AdmissionRefused("spec.resourceClaims must be a list", "BadRequest")
    _check_expressible(demand, spec.get("nodeName"), where)
    try:
        selectors = hint_selectors(demand.hints)
    except SelectorError as exc:
        raise AdmissionRefused(f"{where}: {exc}") from None
    warnings = [w for w in (policy_warning(demand.hints),) if w]

    requests: list[dict[str, Any]] = []
    uses: dict[tuple[bool, int], str] = {}  # (init, index) -> the request the container names
    for c in demand.containers:
        requests.append(_request(c.name, c, selectors))
        uses[(False, c.index)] = c.name
    for c in demand.init_containers:
        app = None if c.sidecar else _covering(c, demand.containers)
        if app is not None:
            uses[(True, c.index)] = app.name
            continue
        requests.append(_request(c.name, c, selectors))
        uses[(True, c.index)] = c.name
        if not c.sidecar:
            warnings.append(
                f"init container {c.name}'s GPU share ({c.count} x {mib_quantity(c.memory_mib)}) is larger than any "
                "app container's, so it gets a share of its own, which DRA holds for the whole life of the pod; "
                "ask no more in the init container than in an app container to let it use that container's share"
            )
    claim_spec = {"devices": {"requests": requests}}
    name = template_name(claim_spec)
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "spec": {"spec": claim_spec},
    }
    entry = _entry_name(spec)
    patch: list[dict[str, Any]] = []
    moved: dict[str, dict[str, dict[str, Any]]] = {}
    for init, key in ((False, "containers"), (True, "initContainers")):
        for index, container in enumerate(spec.get(key) or []):
            amounts = _amounts(container)
            if amounts:
                moved[str(container.get("name"))] = amounts
            for section, found in amounts.items():
                for resource in found:
                    patch.append({"op": "remove", "path": _pointer("spec", key, index, "resources", section, resource)})
            request = uses.get((init, index))
            if request is None:
                continue
            use = {"name": entry, "request": request}
            # a container that names a request asks a share, so it has `resources` (parse_pod read them)
            claims = container["resources"].get("claims")
            at = _pointer("spec", key, index, "resources", "claims")
            if isinstance(claims, list) and claims:
                patch.append({"op": "add", "path": at + "/-", "value": use})
            else:
                patch.append({"op": "add", "path": at, "value": [use]})
    claim_ref = {"name": entry, "resourceClaimTemplateName": name}
    if entries:
        patch.append({"op": "add", "path": _pointer("spec", "resourceClaims", "-"), "value": claim_ref})
    else:
        patch.append({"op": "add", "path": _pointer("spec", "resourceClaims"), "value": [claim_ref]})
    record = json.dumps({"template": name, "claim": entry, "containers": moved}, sort_keys=True, separators=(",", ":"))
    if isinstance((meta or {}).get("annotations"), Mapping):
        patch.append({"op": "add", "path": _pointer("metadata", "annotations", DEMAND_ANNOTATION), "value": record})
    elif meta is None:
        patch.append({"op": "add", "path": "/metadata", "value": {"annotations": {DEMAND_ANNOTATION: record}}})
    else:
        patch.append({"op": "add", "path": _pointer("metadata", "annotations"), "value": {DEMAND_ANNOTATION: record}})
    return Rewrite(template, patch, warnings)


def _contains(stored: Any, wanted: Any) -> bool:
    """Whether `stored` holds everything `wanted` says (fields the API server added are allowed)."""
    if isinstance(wanted, Mapping):
        return isinstance(stored, Mapping) and all(k in stored and _contains(stored[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (
            isinstance(stored, list)
            and len(stored) == len(wanted)
            and all(_contains(s, w) for s, w in zip(stored, wanted, strict=True))
        )
    return bool(stored == wanted)


def template_matches(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether a template found under the generated name asks what the rewrite needs (a name is a hash of its
    spec, so only a hand-edited or foreign object differs). kube-apiserver adds defaults to what it stores
    (`spec.metadata: {}`), so the stored spec must contain the wanted one."""
    return _contains(existing.get("spec") or {}, wanted.get("spec") or {})
