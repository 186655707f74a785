"""The binder's pure parts and the shared Kubernetes helpers that need no server."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from services.binder.decide import Action, binding_checks_uid, decide
from services.binder.lifecycle import is_gpu_pod, release_reason
from services.binder.reads import LiveAllocation
from services.binder.reconcile import (
    AdoptionError,
    adoption_candidates,
    adoption_request,
    find_orphans,
    stale_reservations,
    unmarked_terminating,
)
from shared.annotations import ALLOCATION, GPU_MEM_IDX, GPU_MEM_POD, allocation_record
from shared.events.catalogue import AllocationPart
from shared.kube import pods
from shared.kube.binding import binding_body
from shared.kube.retry import RetryPolicy, call_with_retry, describe_failure, is_retryable
from shared.kube.watching import Gone, WatchEvent, parse_line
from shared.settings import MemoryUnit
from tests.waiting import eventually

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def pod(
    uid: str = "u1",
    node: str = "",
    phase: str = "Pending",
    deleting: bool = False,
    ann: dict | None = None,
    gib: int = 2,
) -> dict:
    meta: dict = {"name": f"p-{uid}", "namespace": "ns", "uid": uid, "annotations": ann or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "controller": True}]
    return {
        "metadata": meta,
        "spec": {
            "nodeName": node or None,
            "containers": [
                {"name": "side"},
                {"name": "main", "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)}}},
            ],
        },
        "status": {"phase": phase},
    }


@pytest.mark.parametrize(
    ("state", "the_pod", "action", "outcome"),
    [
        (None, pod(), Action.SKIP, "skipped_unknown"),
        ("bound", pod(), Action.SKIP, "skipped_already_done"),
        ("failed", pod(), Action.SKIP, "skipped_ended"),
        ("reserved", None, Action.FAIL, "failed_pod_gone"),
        ("reserved", pod(uid="other"), Action.FAIL, "failed_uid_changed"),
        ("reserved", pod(node="n1"), Action.MARK_BOUND, "already_bound"),
        ("reserved", pod(node="n2"), Action.FAIL, "failed_bound_elsewhere"),
        ("reserved", pod(deleting=True), Action.FAIL, "failed_terminating"),
        ("reserved", pod(phase="Failed"), Action.FAIL, "failed_terminated"),
        ("reserved", pod(), Action.BIND, "bound"),
    ],
)
def test_decide(state, the_pod, action, outcome) -> None:
    decision = decide(state=state, pod=the_pod, pod_uid="u1", node="n1")
    assert (decision.action, decision.outcome) == (action, outcome)


def test_pod_helpers() -> None:
    p = pod(node="n1", phase="Succeeded")
    assert pods.owner(p) == ("ReplicaSet", "rs")
    assert pods.is_terminated(p) and not pods.is_terminating(p)
    assert pods.container_amounts(p, "aliyun.com/gpu-mem") == [("main", 1, False, 2, False)]
    assert pods.requests_resource_prefix(p) and is_gpu_pod(p)
    plain = {"metadata": {"uid": "x"}, "spec": {"containers": [{"name": "c"}]}}
    assert not is_gpu_pod(plain)
    assert is_gpu_pod({"metadata": {"annotations": {GPU_MEM_IDX: "0"}}, "spec": {}})
    assert release_reason("DELETED", pod()) == "pod deleted"
    assert release_reason("MODIFIED", pod(phase="Failed")) == "pod failed"
    # a terminating pod's containers may still use the GPU: its share stays until the object is gone
    assert release_reason("MODIFIED", pod(node="n", phase="Running", deleting=True)) is None
    assert release_reason("MODIFIED", pod(node="n", phase="Succeeded", deleting=True)) == "pod succeeded"
    assert release_reason("DELETED", pod(node="n", phase="Running", deleting=True)) == "pod deleted"
    assert release_reason("MODIFIED", pod(node="n")) is None


def test_binding_body_carries_uid_and_annotations() -> None:
    body = binding_body("ns", "p", "n1", uid="u1", annotations={"a": "b"})
    assert body["metadata"] == {"name": "p", "namespace": "ns", "uid": "u1", "annotations": {"a": "b"}}
    assert body["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}


def test_parse_watch_lines() -> None:
    event = parse_line(json.dumps({"type": "ADDED", "object": {"metadata": {"resourceVersion": "7"}}}).encode())
    assert event == WatchEvent("ADDED", {"metadata": {"resourceVersion": "7"}})
    assert parse_line(b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}') == "9"
    assert parse_line(b"  \n") is None
    with pytest.raises(Gone):
        parse_line(b'{"type":"ERROR","object":{"code":410,"message":"too old"}}')
    with pytest.raises(ApiException):
        parse_line(b'{"type":"ERROR","object":{"code":500,"message":"boom"}}')


def test_retryable_errors() -> None:
    assert is_retryable(ApiException(status=429)) and is_retryable(ApiException(status=503))
    assert is_retryable(aiohttp.ClientConnectionError()) and is_retryable(TimeoutError())
    assert not is_retryable(ApiException(status=409)) and not is_retryable(ValueError())
    assert RetryPolicy(attempts=4, base_s=0.1, max_s=0.3).delays() == [0.1, 0.2, 0.3]


def test_retry_logs_name_the_http_status() -> None:
    assert describe_failure(ApiException(status=429, reason="Too Many Requests")) == "HTTP 429 Too Many Requests"
    assert describe_failure(ApiException(status=503)) == "HTTP 503"
    assert describe_failure(TimeoutError("read")) == "TimeoutError('read')"


async def test_call_with_retry_retries_transient_then_gives_up() -> None:
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ApiException(status=503)
        return "ok"

    policy = RetryPolicy(attempts=3, base_s=0.01, max_s=0.02)
    assert await call_with_retry(flaky, policy=policy) == "ok" and len(calls) == 3

    async def down() -> None:
        raise ApiException(status=500)

    with pytest.raises(ApiException):
        await call_with_retry(down, policy=policy)

    async def conflict() -> None:
        calls.append(1)
        raise ApiException(status=409)

    calls.clear()
    with pytest.raises(ApiException):
        await call_with_retry(conflict, policy=policy)
    assert len(calls) == 1  # answers are not retried


def _alloc(uid: str, state: str, age_s: float, terminating: bool = False) -> LiveAllocation:
    return LiveAllocation(
        uuid.uuid4(), uid, "ns", f"p-{uid}", "n1", state, NOW - timedelta(seconds=age_s), NOW if terminating else None
    )


def test_orphans_and_stale_reservations() -> None:
    live = [
        _alloc("gone-young", "reserved", 5),
        _alloc("gone-old", "reserved", 50),
        _alloc("gone-bound", "bound", 1),
        _alloc("done", "assigned", 100),
        _alloc("alive", "bound", 100),
        _alloc("waiting", "reserved", 50),
        _alloc("fresh", "reserved", 1),
        _alloc("leaving", "assigned", 100),
        _alloc("left-marked", "assigned", 100, terminating=True),
        _alloc("left-done", "assigned", 100, terminating=True),
    ]
    by_uid = {
        "done": pod(uid="done", node="n1", phase="Succeeded"),
        "alive": pod(uid="alive", node="n1", phase="Running"),
        "waiting": pod(uid="waiting"),
        "fresh": pod(uid="fresh"),
        "leaving": pod(uid="leaving", node="n1", phase="Running", deleting=True),
        "left-marked": pod(uid="left-marked", node="n1", phase="Running", deleting=True),
        "left-done": pod(uid="left-done", node="n1", phase="Failed", deleting=True),
    }
    orphans = {o.allocation.pod_uid: o.reason for o in find_orphans(live, by_uid, now=NOW, grace_s=30)}
    assert orphans == {
        "gone-old": "pod no longer exists",
        "gone-bound": "pod no longer exists",
        "done": "pod succeeded",
        "left-done": "pod failed",
    }, "a terminating pod keeps its share until it is gone or terminated"
    assert [a.pod_uid for a in stale_reservations(live, by_uid, now=NOW, grace_s=30)] == ["waiting"]
    assert [a.pod_uid for a in unmarked_terminating(live, by_uid)] == ["leaving"]


def test_adoption_of_gpushare_pods() -> None:
    gpus = {0: ("GPU-a", 16 * 1024), 1: ("GPU-b", 16 * 1024)}
    legacy = pod(uid="l", node="n1", phase="Running", ann={GPU_MEM_IDX: "1", GPU_MEM_POD: "2"}, gib=2)
    request = adoption_request(legacy, gpus, MemoryUnit.GIB)
    assert request.node == "n1" and (request.owner_kind, request.owner_name) == ("ReplicaSet", "rs")
    assert [(p.container, p.container_index, p.gpu_uuid, p.memory_mib) for p in request.parts] == [
        ("main", 1, "GPU-b", 2048)
    ]
    in_mib = adoption_request(legacy, gpus, MemoryUnit.MIB)
    assert in_mib.parts[0].memory_mib == 2
    with pytest.raises(AdoptionError, match="no GPU with index 3"):
        adoption_request(pod(uid="x", node="n1", ann={GPU_MEM_IDX: "3"}), gpus, MemoryUnit.GIB)
    with pytest.raises(AdoptionError):
        adoption_request(pod(uid="x", node="n1", ann={GPU_MEM_IDX: "0,1"}), gpus, MemoryUnit.GIB)
    leaving = pod(uid="t", node="n1", phase="Running", deleting=True, ann={GPU_MEM_IDX: "0"})
    finished = pod(uid="f", node="n1", phase="Succeeded", ann={GPU_MEM_IDX: "0"})
    candidates = adoption_candidates(
        [
            legacy,
            pod(uid="unbound", ann={GPU_MEM_IDX: "0"}),
            pod(uid="known", node="n1", ann={GPU_MEM_IDX: "0"}),
            leaving,
            finished,
        ],
        {"known"},
    )
    assert [pods.pod_uid(p) for p in candidates] == ["l", "t"], "a terminating pod still holds its GPU: adopt it"


def test_adoption_records_sidecars_and_never_takes_a_gated_pod() -> None:
    gpus = {0: ("GPU-a", 16 * 1024)}
    legacy = pod(uid="s", node="n1", phase="Running", ann={GPU_MEM_IDX: "0"}, gib=8)
    legacy["spec"]["initContainers"] = [
        {"name": "setup", "resources": {"limits": {"aliyun.com/gpu-mem": "6"}}},
        {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {"aliyun.com/gpu-mem": "4"}}},
    ]
    parts = {p.container: p for p in adoption_request(legacy, gpus, MemoryUnit.GIB).parts}
    assert (parts["setup"].init, parts["setup"].sidecar) == (True, False)
    assert (parts["proxy"].init, parts["proxy"].sidecar, parts["proxy"].container_index) == (True, True, 1)
    assert not parts["main"].init and not parts["main"].sidecar
    # a gated pod cannot be bound, so whatever annotations it was created with, it is not adopted
    gated = pod(uid="g", ann={GPU_MEM_IDX: "0", "gpushare.io/allocation": "{}"})
    gated["spec"]["schedulingGates"] = [{"name": "example.com/hold"}]
    assert adoption_candidates([gated], set()) == []


def test_adoption_charges_the_pods_request_in_its_shape_never_the_annotations() -> None:
    gpus = {0: ("GPU-a", 16 * 1024), 1: ("GPU-b", 16 * 1024)}
    claim = {GPU_MEM_IDX: "0", GPU_MEM_POD: "16"}
    hostile = pod(uid="h", node="n1", phase="Running", ann=claim)
    hostile["spec"]["containers"] = [{"name": "main"}]  # no GPU request at all
    with pytest.raises(AdoptionError, match=r"limits no aliyun\.com/gpu-mem") as refused:
        adoption_request(hostile, gpus, MemoryUnit.GIB)
    assert refused.value.kind == "no_request"
    only_core = pod(uid="c", node="n1", ann=claim)
    only_core["spec"]["containers"][1]["resources"] = {"limits": {"aliyun.com/gpu-core": "50"}}
    with pytest.raises(AdoptionError, match=r"limits no aliyun\.com/gpu-mem"):
        adoption_request(only_core, gpus, MemoryUnit.GIB)

    # what it requests, not what ALIYUN_COM_GPU_MEM_POD says; its compute share too
    shared = pod(uid="s", node="n1", ann=claim, gib=2)
    shared["spec"]["containers"][1]["resources"]["limits"]["aliyun.com/gpu-core"] = "30"
    (part,) = adoption_request(shared, gpus, MemoryUnit.GIB).parts
    assert (part.gpu_uuid, part.memory_mib, part.compute) == ("GPU-a", 2048, 30)
    # one annotated index cannot hold a pod that asks for two GPUs
    spread = pod(uid="t", node="n1", ann=claim, gib=8)
    spread["spec"]["containers"][1]["resources"]["limits"]["aliyun.com/gpu-count"] = "2"
    with pytest.raises(AdoptionError, match="names one GPU but the pod requests container main") as refused:
        adoption_request(spread, gpus, MemoryUnit.GIB)
    assert refused.value.kind == "shape"

    # gpushare's own record: exactly the request, on the GPUs it names
    def record(*parts: AllocationPart) -> dict[str, str]:
        return {ALLOCATION: json.dumps(allocation_record(uuid.uuid4(), "n1", list(parts)))}

    def share(gpu: int, mib: int, container: str = "main", index: int = 1) -> AllocationPart:
        uuid_, _ = gpus[gpu]
        return AllocationPart(container=container, container_index=index, gpu_uuid=uuid_, gpu_index=gpu, memory_mib=mib)

    spread["metadata"]["annotations"] = record(share(0, 4096), share(1, 4096))
    assert [(p.gpu_uuid, p.memory_mib) for p in adoption_request(spread, gpus, MemoryUnit.GIB).parts] == [
        ("GPU-a", 4096),
        ("GPU-b", 4096),
    ]
    for parts, problem in (
        ((share(0, 8192),), "records 8192 MiB/0% on GPU 0 for what it requests"),  # all on one GPU
        ((share(0, 4096), share(0, 4096)), "on each of 2 GPUs"),  # twice the same GPU
        ((share(0, 8192), share(1, 8192)), "records 8192 MiB/0% on GPU 0, 8192 MiB/0% on GPU 1"),  # more memory
        ((share(0, 4096), share(1, 4096), share(0, 4096, "side", 0)), "shares for side, which request none"),
    ):
        spread["metadata"]["annotations"] = record(*parts)
        with pytest.raises(AdoptionError, match=re.escape(problem)) as refused:
            adoption_request(spread, gpus, MemoryUnit.GIB)
        assert refused.value.kind == "shape"


async def test_capacity_nudger_coalesces_stamps_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.binder.nudge as nudge
    from services.binder.nudge import LABEL, CapacityNudger

    patched: list[tuple[str, dict]] = []

    class _Core:
        def __init__(self, api: object) -> None:
            pass

        async def patch_node(self, name: str, body: dict) -> None:
            patched.append((name, body))

    def stamps(node: str) -> int:
        return sum(1 for n, _ in patched if n == node)

    async def has(node: str, count: int) -> bool:
        return stamps(node) >= count

    monkeypatch.setattr(nudge.client, "CoreV1Api", _Core)
    nudger = CapacityNudger(object(), min_interval_s=0.2, settle_s=0.5)  # type: ignore[arg-type]
    for _ in range(5):
        nudger.capacity_freed("n1")
    nudger.capacity_freed("n2")
    nudger.capacity_freed("")
    await eventually(lambda: has("n2", 1), within=5, interval=0.01, what="the first stamp on n2")
    assert stamps("n1") == 1, "five releases at once make one stamp"
    assert all(LABEL in body["metadata"]["labels"] for _, body in patched)
    await eventually(lambda: has("n1", 2), within=5, interval=0.01, what="the follow-up stamp on n1")
    await eventually(lambda: has("n2", 2), within=5, interval=0.01, what="the follow-up stamp on n2")
    await eventually(lambda: _done(nudger), within=5, interval=0.01, what="the nudger to go idle")
    assert (stamps("n1"), stamps("n2")) == (2, 2), "one stamp now and one follow-up per release burst"

    # a release during the settle wait earns one more follow-up after it
    nudger.capacity_freed("n1")
    await eventually(lambda: has("n1", 3), within=5, interval=0.01, what="a new stamp on n1")
    nudger.capacity_freed("n1")
    await eventually(lambda: _done(nudger), within=5, interval=0.01, what="the nudger to go idle")
    assert stamps("n1") == 5
    await nudger.close()


async def _done(nudger: object) -> bool:
    return not nudger._pending  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("major", "minor", "checks"),
    [
        ("1", "20", False),  # the dev cluster: a Binding's metadata.uid is ignored
        ("1", "22", False),
        ("1", "23", True),
        ("1", "24+", True),
        ("1", "25", False),  # regressed
        ("1", "26", False),  # fixed only in some patch releases: read the pod to be safe
        ("1", "27", True),
        ("1", "30+", True),
        ("2", "0", True),
        ("", "", False),
        ("1", "x", False),
    ],
)
def test_binding_checks_uid(major: str, minor: str, checks: bool) -> None:
    assert binding_checks_uid(major, minor) is checks
