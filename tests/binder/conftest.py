"""Fixtures for the binder tests: a real control plane per module, real Postgres and NATS, simulated nodes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.cluster import ControlPlane
from devstack.cluster.nodes import create_gpu_node, delete_node, set_node_status, untaint_not_ready
from services.binder.service import Binder, BinderConfig
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent
from shared.kube.retry import RetryPolicy
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, gpus
from shared.ledger.outbox import OutboxRelay
from shared.ledger.reservations import Reservation, ReservationRequest
from tests.system_tools import running_control_plane
from tests.waiting import eventually

GIB = 1024
SCHEDULER_NONE = "nobody"  # no scheduler serves this name: pods wait for the binder


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    """A control plane of this module's own (skipped when the binaries are missing, failed under CI)."""
    with running_control_plane() as cp:
        yield cp


@pytest.fixture
async def kube(control_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    """An API client for the module's cluster."""
    async with control_plane.api_client() as api:
        yield api


@pytest.fixture
async def relay(engine: AsyncEngine, bus: EventBus) -> AsyncIterator[OutboxRelay]:
    """The outbox relay every ledger of the test kicks."""
    r = OutboxRelay(engine, bus, poll_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(r.run(stop))
    yield r
    stop.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


@pytest.fixture
def ledger(engine: AsyncEngine, bus: EventBus, relay: OutboxRelay) -> Ledger:
    """The test's (the extender's stand-in) ledger."""
    return Ledger(engine, prefix=bus.names.prefix, source="test", on_commit=relay.kick)


@dataclass
class Node:
    """A simulated node, in the cluster and in the ledger."""

    name: str
    gpus: list[str]
    memory_mib: int


@dataclass
class Cluster:
    """Pods and nodes of one test (removed afterwards)."""

    api: ApiClient
    namespace: str = "default"
    pods: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    async def node(self, ledger: Ledger, gpus_gib: tuple[int, ...] = (16, 16)) -> Node:
        """Create a node with GPUs of the given sizes in the cluster and in the ledger."""
        name = f"gpu-{uuid.uuid4().hex[:8]}"
        spec = [(g, "Tesla-V100") for g in gpus_gib]
        try:
            await create_gpu_node(self.api, name, gpus=spec)
        except ApiException as exc:
            # untaint_not_ready's JSON-patch `test` of resourceVersion loses races with the TTL controller
            if exc.status != 422:
                raise
            for _ in range(5):
                try:
                    await untaint_not_ready(self.api, name)
                    break
                except ApiException as again:
                    if again.status != 422:
                        raise
                    await asyncio.sleep(0.1)
            await set_node_status(self.api, name, spec)
        self.nodes.append(name)
        infos = [
            GpuInfo(uuid=f"GPU-{name}-{i}", index=i, model="Tesla-V100", memory_mib=g * GIB, memory_total_mib=g * GIB)
            for i, g in enumerate(gpus_gib)
        ]
        await ledger.record(InventoryEvent(node=name, gpus=infos))
        return Node(name, [g.uuid for g in infos], gpus_gib[0] * GIB)

    async def pod(
        self,
        *,
        gib: int = 2,
        node_name: str | None = None,
        annotations: dict[str, str] | None = None,
        name: str | None = None,
        limits: dict[str, str] | None = None,
    ) -> client.V1Pod:
        """Create a pod asking for `gib` of aliyun.com/gpu-mem (or for `limits`, when given) that no scheduler
        will place."""
        name = name or f"p-{uuid.uuid4().hex[:8]}"
        spec: dict[str, Any] = {
            "schedulerName": SCHEDULER_NONE,
            "containers": [
                {
                    "name": "main",
                    "image": "busybox:1.36",
                    "command": ["sleep", "3600"],
                    "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)} if limits is None else limits},
                }
            ],
        }
        if node_name:
            spec["nodeName"] = node_name
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": spec,
        }
        self.pods.append(name)
        return await self.core.create_namespaced_pod(self.namespace, body)

    async def read(self, name: str) -> client.V1Pod | None:
        try:
            return await self.core.read_namespaced_pod(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def delete_pod(self, name: str, *, grace: int | None = 0) -> None:
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace)

    async def cleanup(self) -> None:
        for name in self.pods:
            await self.delete_pod(name, grace=0)
        for name in self.nodes:
            await delete_node(self.api, name)


@pytest.fixture
async def cluster(kube: ApiClient) -> AsyncIterator[Cluster]:
    """Tracks what a test creates in the cluster and removes it afterwards."""
    c = Cluster(kube)
    yield c
    await c.cleanup()


def request_for(
    pod: client.V1Pod, node: Node, *, gib: int = 2, gpu: int = 0, uid: str | None = None
) -> ReservationRequest:
    """A one-container reservation on one GPU of `node` (what the extender would reserve)."""
    return ReservationRequest(
        pod_uid=uid or pod.metadata.uid,
        namespace=pod.metadata.namespace,
        pod_name=pod.metadata.name,
        node=node.name,
        parts=(
            AllocationPart(
                container="main", container_index=0, gpu_uuid=node.gpus[gpu], gpu_index=gpu, memory_mib=gib * GIB
            ),
        ),
    )


@pytest.fixture
def binder_env(database_url: str, nats_url: str, bus: EventBus, control_plane: ControlPlane) -> dict[str, str]:
    """The environment a `gpushare binder` subprocess of the test runs with (its database, stream, cluster)."""
    return {
        **os.environ,
        "GPUSHARE_DATABASE_URL": database_url,
        "GPUSHARE_NATS_URL": nats_url,
        "GPUSHARE_STREAM_NAME": bus.names.stream,
        "GPUSHARE_SUBJECT_PREFIX": bus.names.prefix,
        "GPUSHARE_LOG_FORMAT": "text",
        "KUBECONFIG": str(control_plane.kubeconfig_path),
    }


@pytest.fixture
async def start_binder(
    engine: AsyncEngine, bus: EventBus, relay: OutboxRelay, kube: ApiClient
) -> AsyncIterator[Callable[..., Awaitable[Binder]]]:
    """Start in-process binders (stopped at teardown); `api`: another client than the admin's for it."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def _start(api: ApiClient | None = None, **overrides: Any) -> Binder:
        config = BinderConfig(
            concurrency=4, reconcile_interval_s=3600, retry=RetryPolicy(attempts=4, base_s=0.1, max_s=1.0), **overrides
        )
        ledger = Ledger(engine, prefix=bus.names.prefix, source="binder", on_commit=relay.kick)
        binder = Binder(ledger, bus, api or kube, config)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(binder.run(stop))))
        await eventually(binder.ready, what="binder ready", within=30)
        return binder

    yield _start
    for stop, task in running:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def allocation(engine: AsyncEngine, allocation_id: uuid.UUID) -> Any:
    """The allocation row."""
    async with engine.connect() as conn:
        return (await conn.execute(select(allocations).where(allocations.c.id == allocation_id))).first()


async def state_becomes(engine: AsyncEngine, res: Reservation, *states: str, within: float = 20.0) -> Any:
    """Wait until the allocation reaches one of `states`; returns the row."""

    async def check() -> Any:
        row = await allocation(engine, res.allocation_id)
        return row if row is not None and row.state in states else None

    return await eventually(check, what=f"allocation {res.allocation_id} to become {'/'.join(states)}", within=within)


async def gpu_usage(engine: AsyncEngine, node: Node) -> dict[str, int]:
    """Allocated MiB per GPU UUID of the node."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(select(gpus.c.uuid, gpus.c.allocated_memory_mib).where(gpus.c.node == node.name))
        ).all()
    return {r.uuid: int(r.allocated_memory_mib) for r in rows}
