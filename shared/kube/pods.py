"""Reading pods as the API returns them (JSON dicts): identity, owner, node, life-cycle state, requests.

Every helper takes the pod as a dict with the API's camelCase keys, e.g. from `raw.read_json`, a watch
event's object, or `api_client.sanitize_for_serialization(v1_pod)` for a model object.
"""

from datetime import UTC, datetime
from typing import Any, NamedTuple

from kubernetes_asyncio import client

from shared.kube.raw import DEFAULT_TIMEOUT_S, read_json

Pod = dict[str, Any]

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def metadata(pod: Pod) -> dict[str, Any]:
    """The pod's metadata (empty dict when absent)."""
    return pod.get("metadata") or {}


def pod_uid(pod: Pod) -> str:
    """The pod's UID."""
    return str(metadata(pod).get("uid") or "")


def pod_key(pod: Pod) -> str:
    """`namespace/name`, for logs."""
    meta = metadata(pod)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def annotations(pod: Pod) -> dict[str, str]:
    """The pod's annotations (empty dict when none)."""
    return metadata(pod).get("annotations") or {}


def node_name(pod: Pod) -> str:
    """The node the pod is bound to, or '' when not bound."""
    return str((pod.get("spec") or {}).get("nodeName") or "")


def phase(pod: Pod) -> str:
    """`status.phase` ('' when unknown)."""
    return str((pod.get("status") or {}).get("phase") or "")


def is_terminated(pod: Pod) -> bool:
    """The pod ran to completion or failed: its containers hold nothing any more."""
    return phase(pod) in TERMINAL_PHASES


def is_terminating(pod: Pod) -> bool:
    """The pod has a deletionTimestamp: it is on its way out, but its containers may still run.

    A terminating pod keeps every resource it holds until its object is gone or it reaches a terminal
    phase, exactly as kube-scheduler keeps counting it: its processes may hold GPU memory for the whole
    grace period, or for ever when the pod is stuck Terminating.
    """
    return bool(metadata(pod).get("deletionTimestamp"))


def parse_time(text: Any) -> datetime | None:
    """A Kubernetes timestamp (`2026-12-06T10:00:00Z`) as an aware datetime; None when absent or unreadable."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def scheduled_at(pod: Pod) -> datetime | None:
    """When the pod was bound: its PodScheduled condition's lastTransitionTime once True with a node set. The
    Binding sets that condition True with the time of the bind (`BindingREST.setPodNodeAndMetadata`,
    pkg/registry/core/pod/storage/storage.go, through `UpdatePodCondition`, pkg/api/pod/util.go, v1.37.2)."""
    if not node_name(pod):
        return None
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
            return parse_time(condition.get("lastTransitionTime"))
    return None


UNPLACED_REASONS = ("Unschedulable", "SchedulerError")  # v1.PodReasonUnschedulable, v1.PodReasonSchedulerError


def unplaced_condition(pod: Pod) -> dict[str, Any] | None:
    """kube-scheduler's word on an unbound, unterminated pod it could not place: its `PodScheduled` condition with
    status False and reason Unschedulable or SchedulerError (`handleSchedulingFailure` -> `updatePod`,
    pkg/scheduler/schedule_one.go; the message is its FailedScheduling message). None otherwise (not tried yet,
    gated, bound, ended)."""
    if node_name(pod) or is_terminated(pod):
        return None
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return condition if condition.get("reason") in UNPLACED_REASONS else None
    return None


def owner(pod: Pod) -> tuple[str, str]:
    """(kind, name) of the pod's controller (the ownerReference with controller=true), or ('', '')."""
    refs = metadata(pod).get("ownerReferences") or []
    for ref in refs:
        if ref.get("controller"):
            return str(ref.get("kind") or ""), str(ref.get("name") or "")
    if refs:
        return str(refs[0].get("kind") or ""), str(refs[0].get("name") or "")
    return "", ""


def _quantity_int(value: Any) -> int:
    """An integer extended-resource quantity ('4', 4); 0 when absent or unreadable."""
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return 0


class ContainerAmount(NamedTuple):
    """How much of one resource one container asks for; `sidecar`: an init container with restartPolicy Always."""

    name: str
    index: int  # type: ignore[assignment]  # the field shadows tuple.index, as in every NamedTuple with an index
    init: bool
    amount: int
    sidecar: bool = False


def container_amounts(pod: Pod, resource: str) -> list[ContainerAmount]:
    """Every container asking for `resource` (limit, else request), init containers first, in spec order."""
    spec = pod.get("spec") or {}
    out: list[ContainerAmount] = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        for index, container in enumerate(spec.get(key) or []):
            resources = container.get("resources") or {}
            amount = _quantity_int((resources.get("limits") or {}).get(resource)) or _quantity_int(
                (resources.get("requests") or {}).get(resource)
            )
            if amount > 0:
                sidecar = init and container.get("restartPolicy") == "Always"
                out.append(ContainerAmount(str(container.get("name") or f"c{index}"), index, init, amount, sidecar))
    return out


def requests_resource_prefix(pod: Pod, prefix: str = "aliyun.com/") -> bool:
    """True when any container requests or limits a resource whose name starts with `prefix`."""
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or []:
            resources = container.get("resources") or {}
            for section in ("limits", "requests"):
                if any(name.startswith(prefix) for name in resources.get(section) or {}):
                    return True
    return False


async def get_pod(
    api: client.ApiClient, namespace: str, name: str, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Pod | None:
    """GET one pod as a dict; None when it does not exist. Other errors raise `ApiException`."""
    core = client.CoreV1Api(api)
    resp = await core.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=timeout_s)
    if resp.status == 404:
        resp.release()
        return None
    return await read_json(resp)


async def list_pods(api: client.ApiClient, *, timeout_s: float = 60.0, **params: Any) -> tuple[list[Pod], str]:
    """All pods cluster-wide as dicts, with the list's resourceVersion (`params`: selectors)."""
    core = client.CoreV1Api(api)
    body = await read_json(
        await core.list_pod_for_all_namespaces(_preload_content=False, _request_timeout=timeout_s, **params)
    )
    return list(body.get("items") or []), str((body.get("metadata") or {}).get("resourceVersion") or "")
