"""Bind reserves for the pod the API server has, never for the pod a (forged) filter call described.

A real kube-apiserver holds the pods; the extender reads them with a kubeconfig, as in a cluster. Filter calls
are unauthenticated in the usual set-up: a caller that sends a filter call with a real pending pod's UID and
other resources must not change what that pod's reservation holds, and a bind naming a UID the API server does
not have must reserve nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client
from prometheus_client import REGISTRY
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.cluster import ControlPlane
from services.extender.app import create_app
from services.extender.pods import FilterPods, PodCache
from services.extender.service import ExtenderService
from shared.events.bus import EventBus
from shared.http import dump_json
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations
from shared.settings import MemoryUnit
from tests import system_tools
from tests.extender.conftest import PREFIX, StandInBinder, add_node, bind_args, gpu_pod, names_args
from tests.waiting import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    """A real kube-apiserver (the extender reads pods from it)."""
    with system_tools.running_control_plane(system_tools.control_plane_binaries()) as cp:
        yield cp


@pytest.fixture
async def kube(control_plane: ControlPlane) -> AsyncIterator[tuple[Any, str]]:
    """(ApiClient, a fresh namespace)."""
    api = control_plane.api_client()
    namespace = f"verify-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    await core.create_namespace({"metadata": {"name": namespace}})
    try:
        yield api, namespace
    finally:
        await core.delete_namespace(namespace)
        await api.close()


@pytest.fixture
async def verifying(
    engine: AsyncEngine, bus: EventBus, ledger: Ledger, control_plane: ControlPlane
) -> AsyncIterator[tuple[ExtenderService, httpx.AsyncClient]]:
    """An extender that verifies pods in the API server (the default outside development)."""
    svc = ExtenderService(
        engine=engine,
        ledger=ledger,
        bus=bus,
        unit=MemoryUnit.GIB,
        bind_timeout_s=5.0,
        kubeconfig=str(control_plane.kubeconfig_path),
        poll_s=0.2,
    )
    await svc.start()
    app = create_app(svc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://extender") as c:
        yield svc, c
    await svc.close()


async def create_pending_pod(api: Any, namespace: str, name: str, mem_gib: int) -> dict:
    """A pod that no scheduler takes (schedulerName nobody runs), asking `mem_gib` GiB of GPU memory."""
    limits = {"aliyun.com/gpu-mem": str(mem_gib)}
    body = {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": "nobody-schedules-this",
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits}}],
        },
    }
    created = await client.CoreV1Api(api).create_namespaced_pod(namespace, body)
    return api.sanitize_for_serialization(created)


async def reserved_mib(engine: AsyncEngine, pod_uid: str) -> list[int]:
    async with engine.connect() as conn:
        rows = (await conn.execute(select(allocations.c.memory_mib).where(allocations.c.pod_uid == pod_uid))).all()
    return [r.memory_mib for r in rows]


async def test_a_forged_filter_call_cannot_change_what_bind_reserves(
    verifying: tuple[ExtenderService, httpx.AsyncClient],
    kube: tuple[Any, str],
    ledger: Ledger,
    engine: AsyncEngine,
    binder: StandInBinder,
) -> None:
    service, http = verifying
    api, namespace = kube
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    real = await create_pending_pod(api, namespace, "victim", 8)
    uid = real["metadata"]["uid"]
    # the forger describes the victim's UID as a 1 GiB pod (to squeeze it next to its own workload, say)
    forged = gpu_pod("victim", 1, uid=uid, namespace=namespace)
    assert (await http.post(f"{PREFIX}/filter", json=names_args(forged, ["n1"]))).json()["NodeNames"] == ["n1"]
    answer = (await http.post(f"{PREFIX}/bind", json=bind_args(forged, "n1"))).json()
    assert answer["Error"] == "", answer
    assert await reserved_mib(engine, uid) == [8 * 1024]  # the API server's 8 GiB, not the forged 1 GiB
    assert [e.pod_uid for e in binder.seen] == [uid]
    assert len(service.pods.filtered) == 0  # nothing a filter call said was kept


async def test_bind_for_a_uid_the_api_server_does_not_have_reserves_nothing(
    verifying: tuple[ExtenderService, httpx.AsyncClient], kube: tuple[Any, str], ledger: Ledger, engine: AsyncEngine
) -> None:
    service, http = verifying
    api, namespace = kube
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    await create_pending_pod(api, namespace, "real", 2)
    invented = gpu_pod("real", 2, namespace=namespace)  # the real pod's name, an invented UID
    await http.post(f"{PREFIX}/filter", json=names_args(invented, ["n1"]))
    answer = (await http.post(f"{PREFIX}/bind", json=bind_args(invented, "n1"))).json()
    assert f"not {invented['metadata']['uid']}" in answer["Error"], answer
    ghost = gpu_pod("ghost", 2, namespace=namespace)  # no such pod at all
    await http.post(f"{PREFIX}/filter", json=names_args(ghost, ["n1"]))
    answer = (await http.post(f"{PREFIX}/bind", json=bind_args(ghost, "n1"))).json()
    assert "could not be read from the Kubernetes API: not found" in answer["Error"], answer
    async with engine.connect() as conn:
        assert (await conn.execute(select(allocations))).first() is None


def test_filter_pods_are_bounded_by_entries_and_bytes() -> None:
    """The development-only filter LRU keeps neither more entries nor more bytes than it is given."""
    pods = FilterPods(max_entries=100, max_bytes=20_000)
    big = [gpu_pod(f"p{i}", 1, annotations={"pad": "x" * 3000}) for i in range(10)]
    for pod in big:
        pods.remember(pod)
    assert pods.bytes <= 20_000 and 0 < len(pods) < 10
    assert pods.get(big[-1]["metadata"]["uid"]) is not None and pods.get(big[0]["metadata"]["uid"]) is None
    huge = gpu_pod("huge", 1, annotations={"pad": "x" * 30_000})
    pods.remember(huge)
    assert pods.get(huge["metadata"]["uid"]) is None and pods.bytes <= 20_000
    small = FilterPods(max_entries=3, max_bytes=10**9)
    for i in range(5):
        small.remember(gpu_pod(f"s{i}", 1))
    assert len(small) == 3
    kept = [pod for pod in big if pods.get(pod["metadata"]["uid"]) is not None]
    assert pods.bytes == sum(len(dump_json(pod)) for pod in kept)


def pod_reads() -> dict[str, float]:
    """gpushare_extender_bind_pod_reads_total by source, in this process."""
    name = "gpushare_extender_bind_pod_reads_total"
    return {s: REGISTRY.get_sample_value(name, {"source": s}) or 0.0 for s in ("watch", "api")}


async def test_bind_takes_unbound_gpu_pods_from_the_watch_and_reads_the_rest(
    verifying: tuple[ExtenderService, httpx.AsyncClient],
    kube: tuple[Any, str],
    ledger: Ledger,
    engine: AsyncEngine,
    binder: StandInBinder,
) -> None:
    """The watch of unbound pods spares bind its GET: what it reserves is still the API server's pod (a forged
    filter call changes nothing), a pod once bound leaves the watch, pods without GPU resources are never kept,
    and a pod the watch shows under another UID is read before anything is reserved."""
    service, http = verifying
    api, namespace = kube
    core = client.CoreV1Api(api)
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    real = await create_pending_pod(api, namespace, "watched", 8)
    uid = real["metadata"]["uid"]
    plain = {
        "metadata": {"name": "plain", "namespace": namespace},
        "spec": {"schedulerName": "nobody-schedules-this", "containers": [{"name": "c", "image": "busybox"}]},
    }
    await core.create_namespaced_pod(namespace, plain)
    await eventually(lambda: service.pods.watched.get(namespace, "watched") is not None, what="the watch")
    assert service.pods.watched.get(namespace, "plain") is None  # no GPU resources: not kept

    before = pod_reads()
    forged = gpu_pod("watched", 1, uid=uid, namespace=namespace)
    await http.post(f"{PREFIX}/filter", json=names_args(forged, ["n1"]))
    answer = (await http.post(f"{PREFIX}/bind", json=bind_args(forged, "n1"))).json()
    assert answer["Error"] == "", answer
    assert await reserved_mib(engine, uid) == [8 * 1024]  # the API server's 8 GiB, from the watch
    after = pod_reads()
    assert (after["watch"] - before["watch"], after["api"] - before["api"]) == (1, 0)

    # the stand-in binder does not create Bindings: bind the pod here, and the watch lets it go
    binding = {"metadata": {"name": "watched"}, "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}
    await core.create_namespaced_binding(namespace, binding, _preload_content=False)
    await eventually(lambda: service.pods.watched.get(namespace, "watched") is None, what="the bound pod to leave")

    # recreated under the same name: until the watch catches up, a bind naming the new UID reads the pod
    await create_pending_pod(api, namespace, "again", 2)
    await eventually(lambda: service.pods.watched.get(namespace, "again") is not None, what="the watch")
    service.pods.watched.update("MODIFIED", gpu_pod("again", 2, uid="stale-uid", namespace=namespace))
    fresh = await core.read_namespaced_pod("again", namespace)
    renamed = gpu_pod("again", 2, uid=fresh.metadata.uid, namespace=namespace)
    before = pod_reads()
    answer = (await http.post(f"{PREFIX}/bind", json=bind_args(renamed, "n1"))).json()
    assert answer["Error"] == "", answer
    after = pod_reads()
    assert (after["watch"] - before["watch"], after["api"] - before["api"]) == (0, 1)


def test_the_unbound_pod_index_keeps_gpu_pods_only_and_is_bounded() -> None:
    """Pure: the watch keeps unbound pods asking for aliyun.com/ resources, drops them once bound, and keeps
    no more than its bound (readers fall back to a GET)."""
    cache = PodCache(size=2, kubeconfig=None)
    index = cache.watched
    index.synced()
    index.update("ADDED", gpu_pod("a", 1, namespace="ml"))
    index.update("ADDED", {"metadata": {"name": "cpu", "namespace": "ml", "uid": "u"}, "spec": {"containers": [{}]}})
    assert index.get("ml", "a") is not None and index.get("ml", "cpu") is None
    bound = gpu_pod("a", 1, namespace="ml")
    bound["spec"]["nodeName"] = "n1"
    index.update("MODIFIED", bound)
    assert index.get("ml", "a") is None and len(index) == 0
    for name in ("b", "c", "d"):
        index.update("ADDED", gpu_pod(name, 1, namespace="ml"))
    assert len(index) == 2 and index.get("ml", "d") is None and index.skipped == 1
